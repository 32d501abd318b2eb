"""The Triton AdamW (``kernels/adamw.py``) vs its torch reference and ``torch.optim.AdamW``, the optimizers' kernel
paths vs their torch paths, the self-check's fallback, and ``FP32Grads``. Interpreted on CPU, compiled on a GPU."""
import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("triton")

import kernels  # noqa: E402

kernels.configure()
from kernels import adamw, selfcheck  # noqa: E402
from models.layers import RMSNorm  # noqa: E402
from parallel.dims import ParallelDims  # noqa: E402
from parallel.zero import Replicated  # noqa: E402
from parallel.zero.master import FP32Grads  # noqa: E402
from parallel.zero.native import ZeroOptimizer  # noqa: E402

from .fp8_utils import DEV, fresh_verdicts  # noqa: E402,F401 - autouse

ONE = ParallelDims(world_size=1)
N = 1000           # not a multiple of the block (256 here): a ragged last program
HYPER = dict(beta1=0.9, beta2=0.95, eps=1e-8)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def run(fn, grads, moments=torch.float32, wd=0.1, coef=None, lrs=(1e-2, 3e-3, 5e-3)):
    """Steps of ``fn`` from the same start; returns master, moments and the last BF16 ``out``."""
    master = torch.randn(N, generator=torch.Generator().manual_seed(1)).to(DEV)
    m, v = torch.zeros(N, dtype=moments, device=DEV), torch.zeros(N, dtype=moments, device=DEV)
    out = torch.empty(N, dtype=torch.bfloat16, device=DEV)
    for step, (g, lr) in enumerate(zip(grads, lrs), 1):
        fn(master, g, m, v, lr=lr, weight_decay=wd, step=step, coef=coef, out=out, **HYPER)
    return master, m, v, out


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal to FP32 rounding: a few ulps of each element, or of the tensor's largest element near zero."""
    torch.testing.assert_close(a, b, rtol=2 ** -20, atol=2 ** -21 * float(b.abs().max()))


def grads_of(dtype, steps=3):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(N, generator=g) * 3).to(device=DEV, dtype=dtype) for _ in range(steps)]


def kernel(*args, **kwargs):
    return adamw.triton_adamw_(*args, block=256, **kwargs)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("clip", [None, 1.0, 0.37])
def test_kernel_matches_reference_and_torch_adamw(grad_dtype, wd, clip):
    """Three steps, lr changing between them: master and moments within FP32 rounding of the reference and of
    ``torch.optim.AdamW`` (fed the clipped FP32 gradient); ``out`` is the master rounded to BF16, bit for bit."""
    grads = grads_of(grad_dtype)
    coef = None if clip is None else torch.tensor(clip, device=DEV)
    got = run(kernel, grads, wd=wd, coef=coef)
    want = run(adamw.reference_adamw_, grads, wd=wd, coef=coef)
    assert torch.equal(got[3], got[0].to(torch.bfloat16))
    for a, b in zip(got[:3], want[:3]):
        close(a, b)
    # torch.optim.AdamW on the same master, the gradient clipped beforehand
    p = nn.Parameter(torch.randn(N, generator=torch.Generator().manual_seed(1)).to(DEV))
    opt = torch.optim.AdamW([p], lr=1.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    for g, lr in zip(grads, (1e-2, 3e-3, 5e-3)):
        p.grad = g.float() * (coef.float() if coef is not None else 1.0)
        opt.param_groups[0]["lr"] = lr
        opt.step()
    st = opt.state[p]
    for a, b in zip(got[:3], (p.detach(), st["exp_avg"], st["exp_avg_sq"])):
        close(a, b)
    unclipped = run(kernel, grads, wd=wd)[0]
    assert torch.equal(got[0], unclipped) == (clip != 0.37)      # a coefficient of 1 changes no bit


def test_bf16_moments_match_the_native_zero_maths():
    """BF16 moments (``optim.moment_dtype=bf16``, ZeRO's default): maths in FP32, moments rounded once per step;
    a last-ulp FP32 difference may flip a BF16 rounding, so moments agree to one BF16 ulp, the master to ~1e-7."""
    grads = grads_of(torch.float32)
    coef = torch.tensor(0.5, device=DEV)
    got = run(kernel, grads, moments=torch.bfloat16, coef=coef)
    want = run(adamw.reference_adamw_, grads, moments=torch.bfloat16, coef=coef)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    assert rel(got[0], want[0]) < 1e-6
    for a, b in zip(got[1:3], want[1:3]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -8, atol=0)
        assert (a != b).float().mean() < 0.01


def test_empty_tensor_and_layout_asserts():
    e = torch.empty(0, device=DEV)
    adamw.triton_adamw_(e, e, e.clone(), e.clone(), lr=1e-3, weight_decay=0.0, step=1, **HYPER)
    with pytest.raises(AssertionError):
        x = torch.zeros(4, 4, device=DEV)
        adamw.triton_adamw_(x, x.t(), x.clone(), x.clone(), lr=1e-3, weight_decay=0.0, step=1, **HYPER)


def test_split_master_halves_join_to_the_fp32_value_bit_for_bit():
    """``split_master`` / ``join_master``: every finite FP32 value (both signs, zero, subnormals, the largest,
    ties) comes back bit for bit; the high half is BF16 round-to-nearest-even except at exact ties, which it rounds
    toward zero (so the low half alone says whether the high half was rounded up)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g) * 10.0 ** torch.randint(-44, 38, (20000,), generator=g).float()
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-40, 3.4e38, -3.4e38, 1.0, -1.0])])
    x = x[torch.isfinite(x)].to(DEV)
    ties = ((x.view(torch.int32) & ~0xFFFF) | 0x8000).view(torch.float32)
    for t in (x, ties):
        high, low = adamw.split_master(t)
        assert high.dtype == torch.bfloat16 and low.dtype == torch.int16
        assert torch.equal(adamw.join_master(high, low).view(torch.int32), t.view(torch.int32))
    high, _ = adamw.split_master(x)
    assert torch.equal(high.view(torch.int16), x.bfloat16().view(torch.int16))   # no tie among the random values
    high, _ = adamw.split_master(ties)
    assert torch.equal(high.view(torch.int16), (ties.view(torch.int32) >> 16).to(torch.int16))   # toward zero


def run_split(fn, grads, coef=None, lrs=(1e-2, 3e-3, 5e-3)):
    """``run`` on a split master (BF16 moments): returns the joined master, the moments and the two halves."""
    start = torch.randn(N, generator=torch.Generator().manual_seed(1)).to(DEV)
    out, low = adamw.split_master(start)
    m, v = torch.zeros(N, dtype=torch.bfloat16, device=DEV), torch.zeros(N, dtype=torch.bfloat16, device=DEV)
    for step, (g, lr) in enumerate(zip(grads, lrs), 1):
        fn(low, g, m, v, lr=lr, weight_decay=0.1, step=step, coef=coef, out=out, **HYPER)
    return adamw.join_master(out, low), m, v, out, low


def test_the_split_master_kernel_updates_as_the_fp32_master_does():
    """The kernel on a split master (the BF16 weight and 16 low bits) against the kernel on an FP32 master, three
    steps: the joined master is the FP32 master bit for bit (the same maths on the same values), the moments are
    the same, and the weight is the split of the master; the torch reference likewise to FP32 rounding."""
    grads = grads_of(torch.bfloat16)
    coef = torch.tensor(0.5, device=DEV)
    master, m, v, out, low = run_split(kernel, grads, coef=coef)
    want = run(kernel, grads, moments=torch.bfloat16, coef=coef)
    assert torch.equal(master, want[0]) and torch.equal(m, want[1]) and torch.equal(v, want[2])
    high, low2 = adamw.split_master(master)
    assert torch.equal(out.view(torch.int16), high.view(torch.int16)) and torch.equal(low, low2)
    ref = run_split(adamw.reference_adamw_, grads, coef=coef)
    assert rel(ref[0], master) < 1e-6
    assert adamw.split_self_check(DEV) < adamw.CHECK_TOL


# ---- the optimizers' kernel paths -----------------------------------------------------------------------
def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(24, 40, bias=True), RMSNorm(40), nn.Linear(40, 8, bias=False)).to(DEV)
    xs = [torch.randn(6, 24, device=DEV) for _ in range(4)]
    return model, xs


def train(opt, model, xs, steps, micro, max_norm, dtype):
    norms = []
    for s in range(steps):
        for x in xs[s * micro % len(xs):][:micro]:
            opt.backward(model(x.to(dtype)).float().square().mean() * 50 / micro)
        assert bool(opt.grads_finite())
        norms.append(float(opt.step(max_norm)))
        opt.zero_grad()
    return norms


def _optim():
    return SimpleNamespace(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, moment_dtype="fp32")


@pytest.mark.parametrize("weights,micro,max_norm", [("bf16", 1, 0.5), ("bf16", 2, 1e3), ("fp32", 1, 0.5)])
def test_replicated_kernel_path_equals_the_torch_path(weights, micro, max_norm):
    """``Replicated(kernel=True)`` vs ``kernel=False``: same norms, master, moments and step counts to FP32
    rounding; the weights are the master in BF16."""
    runs = []
    for k in (False, True):
        model, xs = model_and_data()
        opt = Replicated(model, _optim(), ONE, None, weights=weights, kernel=k)
        assert opt.kernel is k and bool(opt.optimizer.defaults.get("fused")) == (DEV.type == "cuda" and not k)
        dtype = torch.bfloat16 if weights == "bf16" else torch.float32
        norms = train(opt, model, xs, 3, micro, max_norm, dtype)
        state = {n: opt.optimizer.state[t] for n, t in opt.named}
        runs.append((norms, {n: t.detach().clone() for n, t in opt.named}, state))
        for (_, p), (_, m) in zip(opt.params, opt.named):
            assert torch.equal(p.detach(), m.detach().to(p.dtype))
    (n0, w0, s0), (n1, w1, s1) = runs
    assert n0 == pytest.approx(n1, rel=1e-6) and (max_norm < min(n0)) == (max_norm == 0.5)
    for n in w0:
        assert rel(w1[n], w0[n]) < 1e-6, n
        assert float(s1[n]["step"]) == float(s0[n]["step"]) == 3
        for k in ("exp_avg", "exp_avg_sq"):
            assert rel(s1[n][k], s0[n][k]) < 1e-5, (n, k)


def test_zero_kernel_path_equals_its_torch_maths():
    """``ZeroOptimizer(kernel=True)``: one launch per bucket, the clip coefficient folded in (no pass over the
    gradient), BF16 moments; vs the same maths in torch (``kernel=False``)."""
    runs = []
    for k in (False, True):
        model, xs = model_and_data()
        opt = ZeroOptimizer(model, _optim(), ONE, stage=1, moment_dtype="bf16", weights="bf16", kernel=k)
        norms = train(opt, model, xs, 3, 1, 0.5, torch.bfloat16)
        runs.append((norms, [b.master.clone() for b in opt.buckets], [b.exp_avg.float() for b in opt.buckets]))
    (n0, m0, a0), (n1, m1, a1) = runs
    assert n0 == n1 and 0.5 < min(n0)                 # the norm is computed before the update: the same bits
    for x, y in zip(m1, m0):
        assert rel(x, y) < 1e-6
    for x, y in zip(a1, a0):
        torch.testing.assert_close(x, y, rtol=2 ** -8, atol=0)


def test_replicated_bf16_moments_are_kept_and_match_the_native_zero():
    """``optim.moment_dtype=bf16`` without ZeRO: ``Replicated`` keeps BF16 moments (``memory()`` says so), updated
    as the native ZeRO optimizer does, on both paths; ``build_optimizer`` passes the setting."""
    from parallel.zero import build_optimizer
    runs = []
    for make in (lambda m: ZeroOptimizer(m, _optim(), ONE, stage=1, moment_dtype="bf16", weights="bf16", kernel=False),
                 lambda m: Replicated(m, _optim(), ONE, None, weights="bf16", kernel=False, moments="bf16"),
                 lambda m: Replicated(m, _optim(), ONE, None, weights="bf16", kernel=True, moments="bf16")):
        model, xs = model_and_data()
        opt = make(model)
        norms = train(opt, model, xs, 3, 1, 0.5, torch.bfloat16)
        masters = opt.master_weights()
        runs.append((norms, {n: t.float() for n, t in masters.items()}))
        if isinstance(opt, Replicated):
            assert {opt.optimizer.state[t][k].dtype for _, t in opt.named for k in ("exp_avg", "exp_avg_sq")} == \
                {torch.bfloat16}
            n = sum(p.numel() for p in model.parameters())
            assert opt.memory().measured["optim"] == 2 * 2 * n
    (n0, w0), (n1, w1), (n2, w2) = runs
    assert n1 == pytest.approx(n0, rel=1e-6) and n2 == pytest.approx(n0, rel=1e-6)
    for name in w0:
        assert rel(w1[name], w0[name]) < 1e-6, name
        assert rel(w2[name], w0[name]) < 1e-4, name     # a fused multiply-add may flip a BF16 moment's rounding
    optim = SimpleNamespace(**{**vars(_optim()), "moment_dtype": "bf16"})
    opt = build_optimizer(model_and_data()[0], optim, ONE, weights="bf16")
    assert isinstance(opt, Replicated) and opt.moments == torch.bfloat16


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the inf gradient, interpreted
@pytest.mark.parametrize("weights", ["bf16", "fp32"])
def test_the_finiteness_check_and_the_clip_read_the_gradients_once(monkeypatch, weights):
    """``grads_finite`` then ``step`` (the trainer's order) pass over the gradients once: the clip reuses the
    check's sums, and the norm is the one ``step`` alone computes, bit for bit. A gradient changed in place after
    the check, or a check that found an inf, is not reused."""
    calls = []
    real = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda ts, *a, **k: calls.append(len(ts)) or real(ts, *a, **k))
    dtype = torch.bfloat16 if weights == "bf16" else torch.float32
    norms = []
    for check, poke in ((False, None), (True, None), (True, 2.0), (True, float("inf"))):
        model, xs = model_and_data()
        opt = Replicated(model, _optim(), ONE, None, weights=weights, kernel=True)
        opt.backward(model(xs[0].to(dtype)).float().square().mean() * 50)
        calls.clear()
        if check:
            assert bool(opt.grads_finite())
        if poke is not None:
            with torch.no_grad():
                next(g for g in opt._held() if g is not None).mul_(poke)
        norms.append(float(opt.step(0.5)))
        assert sum(calls) == (2 if check and poke is not None else 1) * len(opt.params), (check, poke, calls)
        assert opt._sq == (None, None)
    plain, checked, doubled, inf = norms
    assert checked == plain and doubled > plain and inf == float("inf")


def test_a_wrong_kernel_gives_way_to_the_torch_path(monkeypatch, caplog):
    """``kernel=None`` self-checks the kernel first (forced to here, off CUDA); a wrong one warns once and
    ``Replicated`` steps as with ``kernel=False``."""
    import parallel.zero as zero
    real = adamw.triton_adamw_

    def wrong(master, *args, **kwargs):
        real(master, *args, **kwargs)
        master.add_(1e-3)
    monkeypatch.setattr(adamw, "triton_adamw_", wrong)
    monkeypatch.setattr(adamw, "usable", lambda device, split=False: adamw.verified(device))
    monkeypatch.setattr(zero, "triton_adamw", lambda tensors: True)
    results = []
    for k in (None, False):
        model, xs = model_and_data()
        opt = Replicated(model, _optim(), ONE, None, weights="bf16", kernel=k)
        with caplog.at_level(logging.WARNING, logger="kernels"):
            train(opt, model, xs, 2, 1, 0.5, torch.bfloat16)
        results.append([m.detach().clone() for _, m in opt.named])
    assert len(caplog.records) == 1 and "adamw self-check failed" in caplog.records[0].getMessage()
    assert all(rel(a, b) < 1e-6 for a, b in zip(*results))     # the wrong kernel would be 1e-3 off
    monkeypatch.setattr(adamw, "triton_adamw_", real)
    selfcheck.forget()
    assert adamw.verified(DEV) and adamw.self_check(DEV) < adamw.CHECK_TOL


# ---- FP32Grads --------------------------------------------------------------------------------------------
def test_fp32_grads_keeps_one_backward_in_the_param_dtype_and_sums_more_in_fp32():
    torch.manual_seed(0)
    lin = nn.Linear(8, 8, bias=False).to(DEV, torch.bfloat16)
    other = nn.Parameter(torch.zeros(3, device=DEV, dtype=torch.bfloat16))
    acc = FP32Grads([lin.weight, other])
    xs = [torch.randn(4, 8, device=DEV, dtype=torch.bfloat16) for _ in range(2)]
    singles = []
    for x in xs:
        lin.weight.grad = None
        lin(x).float().square().sum().backward()
        singles.append(acc.grads.pop(lin.weight))
        assert lin.weight.grad is None
    assert all(g.dtype == torch.bfloat16 for g in singles)
    for x in xs:                                           # two backwards: the FP32 sum of the BF16 gradients
        lin(x).float().square().sum().backward()
    got = acc.get(lin.weight)
    assert got.dtype == torch.float32 and torch.equal(got, singles[0].float() + singles[1].float())
    acc.clear()
    lin(xs[0]).float().square().sum().backward()
    assert acc.grads[lin.weight].dtype == torch.bfloat16
    filled = acc.get(lin.weight, fill=True)                # asked for: FP32 (kept), the same values
    assert filled.dtype == torch.float32 and acc.grads[lin.weight] is filled and torch.equal(filled, singles[0].float())
    zeros = acc.get(other, fill=True)
    assert zeros.dtype == torch.float32 and not zeros.any() and acc.pop(other) is zeros
