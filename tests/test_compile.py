"""Regional ``torch.compile`` (``parallel/compile.py``): which devices and modules compile, and eager's losses and
gradients (FP32, to rounding), also under selective recomputation. CPU: ``aot_eager`` (seconds, not inductor's
minutes of C++ builds); the GPU suite runs inductor."""
import copy

import pytest
import torch

import models
from configs import model_preset
from errors import ConfigError
from models.attention import MLA
from models.layers import RMSNorm, SwiGLU
from models.moe import MoE
from parallel.compile import MODES, apply_compile, compiled, enabled
from parallel.recompute import apply_recompute, regions

from .trainer_utils import make_config

IDS = torch.randint(0, 1024, (2, 33), generator=torch.Generator().manual_seed(0))
REGIONS = 33 + 3 * 4 + 2 * 5   # the tiny model's norms and SwiGLUs, its 4 MoE layers' combines, routers and
                               # balance terms, its 5 attentions' query and key/value heads (4 blocks, the MTP's)


def tiny():
    return models.build(model_preset("tiny"), device="cpu", seed=0).train()


def loss_and_grads(model):
    out = model.compute_loss(IDS[:, :-1], IDS[:, 1:], mtp_weight=0.3, aux_alpha=1e-2)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same(eager, comp, tol=1e-5):
    (l0, g0), (l1, g1) = eager, comp
    assert abs(l0.item() - l1.item()) <= tol * abs(l0.item()), (l0, l1)
    assert g0.keys() == g1.keys()
    for n in g0:
        err = ((g0[n] - g1[n]).norm() / g0[n].norm().clamp_min(1e-30)).item()
        assert err < tol, (n, err)


def test_modes_and_devices():
    assert MODES == ("auto", "on", "off")
    assert enabled("auto", "cuda") and not enabled("auto", "cpu")
    assert enabled("on", "cpu") and not enabled("off", torch.device("cuda"))
    with pytest.raises(ValueError, match="train.compile: 'yes' is not one of auto, on, off"):
        enabled("yes", "cpu")
    with pytest.raises(ConfigError, match="train.compile"):
        make_config("train.compile=yes")


def test_every_norm_and_swiglu_becomes_a_region_and_nothing_else_changes():
    model = tiny()
    keys = list(model.state_dict())
    want = sorted([n for n, m in model.named_modules() if isinstance(m, (RMSNorm, SwiGLU))] +
                  [f"{n}.{f}" for n, m in model.named_modules() if isinstance(m, MoE)
                   for f in ("dispatcher.weigh", "gate.select", "balance_terms")] +
                  [f"{n}.{f}" for n, m in model.named_modules() if isinstance(m, MLA)
                   for f in ("query_heads", "kv_heads")])
    names = apply_compile(model, backend="aot_eager")
    assert sorted(names) == want == sorted(compiled(model)) and len(want) == REGIONS
    assert apply_compile(model, backend="aot_eager") == names   # idempotent: no class of a class
    assert type(model.norm).__name__ == "CompiledRMSNorm" and type(model.norm).__mro__[1] is RMSNorm
    assert list(model.state_dict()) == keys


def test_compiled_step_equals_eager():
    model = tiny()
    comp = copy.deepcopy(model)
    apply_compile(comp, backend="aot_eager")
    assert_same(loss_and_grads(model), loss_and_grads(comp))
    # a second step (other shapes reuse the graphs or add one; the values still match)
    model.zero_grad(), comp.zero_grad()
    assert_same(loss_and_grads(model), loss_and_grads(comp))


def test_the_residual_region_is_opt_in_and_equals_eager(monkeypatch):
    """``RMSNorm.residual`` (the FFN norm with the residual add before it) is compiled only with ``RESIDUAL_ENV=1``
    (no GPU has run its kernels yet); then the step still equals eager."""
    from parallel.compile import OTHER_METHODS, RESIDUAL_ENV
    model = tiny()
    default = copy.deepcopy(model)
    apply_compile(default, backend="aot_eager")
    assert type(default.layers[0].ffn_norm).residual is RMSNorm.residual
    monkeypatch.setenv(RESIDUAL_ENV, "1")
    comp = copy.deepcopy(model)
    apply_compile(comp, backend="aot_eager")
    assert type(comp.layers[0].ffn_norm).residual is OTHER_METHODS[RMSNorm]["residual"]
    assert_same(loss_and_grads(model), loss_and_grads(comp))


@pytest.mark.parametrize("env", ["GATHER_ENV", "UNSORT_ENV", "HEADS_ENV"])
def test_the_dispatch_combine_and_heads_opt_ins_equal_eager(monkeypatch, env):
    """``GATHER_ENV=1``: the single-device dispatch's copies as a compiled ``gather_copies`` region;
    ``UNSORT_ENV=1``: the combine's region with ``unsort_rows``' backward; ``HEADS_ENV=1``: the attention heads laid
    out ``[B,T,H,.]``. None by default; with each, the step still equals eager."""
    import parallel.compile as pc
    from models.attention import query_heads, query_heads_bthd
    from models.moe import LocalDispatcher, unsort_and_weight, unsort_rows_and_weight
    model = tiny()
    default = copy.deepcopy(model)
    apply_compile(default, backend="aot_eager")
    moe = default.layers[1].ffn
    assert "gather" not in vars(moe.dispatcher) and moe.dispatcher.weigh.fn is unsort_and_weight
    assert default.layers[0].attn.query_heads.fn is query_heads
    monkeypatch.setenv(getattr(pc, env), "1")
    comp = copy.deepcopy(model)
    names = apply_compile(comp, backend="aot_eager")
    moe = comp.layers[1].ffn
    if env == "GATHER_ENV":
        assert isinstance(vars(moe.dispatcher)["gather"], pc.Region) and "layers.1.ffn.dispatcher.gather" in names
        assert sorted(compiled(comp)) == sorted(names) and LocalDispatcher.gather is not moe.dispatcher.gather
    elif env == "UNSORT_ENV":
        assert moe.dispatcher.weigh.fn is unsort_rows_and_weight
    else:
        assert comp.layers[0].attn.query_heads.fn is query_heads_bthd
    assert_same(loss_and_grads(model), loss_and_grads(comp))


def test_compiled_regions_recompute():
    """Compile before recompute (``parallel.parallelize``'s order): the regions are compiled and recomputed."""
    model = tiny()
    ref = loss_and_grads(copy.deepcopy(model))
    apply_compile(model, backend="aot_eager")
    done = apply_recompute(model, "selective")
    assert done == regions(model) and any(r.endswith("ffn_norm.forward") for r in done)
    assert type(model.norm).__name__ == "RecomputedCompiledRMSNorm"
    assert len(apply_compile(model, backend="aot_eager")) == REGIONS   # again: nothing undone
    assert type(model.norm).__name__ == "RecomputedCompiledRMSNorm" and regions(model) == done
    assert len(compiled(model)) == REGIONS
    assert_same(ref, loss_and_grads(model))


@pytest.mark.parametrize("error", ["TorchDynamoException", "FailOnRecompileLimitHit"])
def test_a_region_that_fails_to_compile_runs_eagerly_with_one_warning(monkeypatch, caplog, error):
    """A compiler error, or dynamo's recompile limit (measured on an H100: a norm's widths, dtypes and batch
    shapes passed the default 8 graphs), leaves the region eager with one warning; the limit is raised first."""
    from parallel import compile as regional
    from models.layers import swiglu

    def broken(fn, **kw):
        def run(*args):
            raise getattr(torch._dynamo.exc, error)("no compiler here")
        return run

    regional.region.cache_clear()
    monkeypatch.setattr(torch, "compile", broken)
    h13 = torch.randn(4, 16)
    try:
        with caplog.at_level("WARNING", logger="parallel"):
            run = regional.region(swiglu, "inductor")
            assert torch.equal(run(h13), swiglu(h13))
            assert torch.equal(run(h13), swiglu(h13))
    finally:
        regional.region.cache_clear()
    assert len(caplog.records) == 1
    assert f"compiling swiglu with inductor failed ({error}: no compiler here)" in caplog.records[0].getMessage()
    assert torch._dynamo.config.recompile_limit >= regional.RECOMPILE_LIMIT


def test_each_new_graph_is_checked_and_a_wrong_one_runs_eagerly(monkeypatch, caplog):
    """Every call that compiled a graph is checked against eager on its inputs (outputs and gradients); calls that
    reuse a graph are not. A backend whose graph is wrong (its outputs scaled by 1.5) sends the region back to
    eager, with one warning: the first call already returns eager's values."""
    from models.layers import swiglu
    from parallel import compile as regional
    monkeypatch.setenv(regional.CHECK_ENV, "1")   # the check is opt-in
    checks = []
    real_check = regional.check_region
    monkeypatch.setattr(regional, "check_region", lambda *a: checks.append(a[1].__name__) or real_check(*a))
    h13 = torch.randn(6, 16, requires_grad=True)
    regional.region.cache_clear()
    try:
        run = regional.region(swiglu, "aot_eager")
        for _ in range(2):
            assert torch.equal(run(h13), swiglu(h13))
        assert checks == ["swiglu"] and not [r for r in caplog.records if r.name == "parallel"]
        lookup = torch._dynamo.lookup_backend

        def wrong(name):
            good = lookup(name)
            return lambda gm, inputs, **kw: (lambda *a: [o * 1.5 for o in good(gm, inputs, **kw)(*a)])
        monkeypatch.setattr(torch._dynamo, "lookup_backend", wrong)
        regional.region.cache_clear()
        with caplog.at_level("WARNING", logger="parallel"):
            run = regional.region(swiglu, "aot_eager")
            for _ in range(2):
                out = run(h13)
                assert torch.equal(out, swiglu(h13))
            out.sum().backward()
    finally:
        regional.region.cache_clear()
    assert torch.equal(h13.grad, torch.autograd.grad(swiglu(h13).sum(), h13)[0])
    warned = [r.getMessage() for r in caplog.records if r.name == "parallel"]
    assert checks == ["swiglu", "swiglu"] and len(warned) == 1
    assert "swiglu compiled with aot_eager differs from eager (output 0: relative error 0.5 > 0.0001)" in warned[0]


def test_a_check_tolerates_rare_index_ties_only():
    """Integer outputs (a router's top-k) may differ on a few rows (1-ulp ties), and the float outputs are then
    compared on the other rows; more rows than ``INDEX_MISMATCH``, or a float error past the tolerance, fail."""
    from parallel.compile import INDEX_MISMATCH, check_region
    idx, w = torch.arange(1000 * 8).view(1000, 8), torch.rand(1000, 8)

    def eager(x):
        return idx, w * x

    def flips(n, scale=1.0):
        def f(x):
            i, v = idx.clone(), w * x * scale
            i[:n, 0] += 1
            v[:n] = 7.0            # whatever those rows hold
            return i, v
        return f
    x = torch.tensor(2.0)
    assert check_region(flips(5), eager, (x,)) == ""
    assert "of an integer output's rows differ" in check_region(flips(int(2 * INDEX_MISMATCH * 1000)), eager, (x,))
    assert "output 1: relative error" in check_region(flips(5, scale=1.01), eager, (x,))


def test_a_check_tolerates_the_rounding_of_the_least_precise_type_involved():
    """An FP32 result computed from BF16 inputs, or under BF16 autocast, carries BF16 rounding: the check's
    tolerance is the least precise type's (measured on an H100: the combine's FP32 output from BF16 expert rows
    differed from eager by 1.7e-3, which FP32's 1e-4 had called wrong); all-FP32 regions keep FP32's."""
    from parallel.compile import CHECK_TOL, check_region
    rows, gates = torch.randn(64, 32).bfloat16(), torch.rand(64, 1)

    def eager(x, g):
        return x.float() * g

    def off_by(rel):
        return lambda x, g: eager(x, g) * (1 + rel)
    bf16, fp32 = CHECK_TOL[torch.bfloat16], CHECK_TOL[torch.float32]
    assert check_region(off_by(bf16 / 10), eager, (rows, gates)) == ""
    assert "output 0: relative error" in check_region(off_by(bf16 * 10), eager, (rows, gates))
    assert "> 0.0001" in check_region(off_by(fp32 * 10), eager, (rows.float(), gates))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert check_region(off_by(fp32 * 10), eager, (rows.float(), gates)) == ""


def _norm(x, w):
    from models.layers import rms_norm
    return rms_norm(x, w, 1e-6)


def _residual_norm(x, y, w):
    from models.layers import add_rms_norm
    return add_rms_norm(x, y, w, 1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's CUDA kernels need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_regions_on_cuda_equal_eager(dtype):
    """Inductor's kernels for the norm (alone and after the residual add), SwiGLU, combine and attention-heads
    regions vs eager: FP32 to rounding,
    BF16 within one BF16 rounding (inductor keeps the norm's FP32 statistics in registers)."""
    from models.attention import key_value_heads, key_value_heads_bthd, query_heads, query_heads_bthd
    from models.layers import swiglu
    from models.moe import gather_copies, unsort_and_weight, unsort_rows_and_weight
    from parallel.compile import region
    g = torch.Generator(device="cuda").manual_seed(0)
    tol = 1e-5 if dtype == torch.float32 else 1e-2

    def check(fn, *inputs):
        def fresh():
            return [t.detach().clone().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t
                    for t in inputs]
        ref_in, got_in = fresh(), fresh()
        want, got = fn(*ref_in), region(fn, "inductor")(*got_in)
        want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
        dys = [torch.randn(w.shape, generator=g, device="cuda", dtype=dtype) for w in want]
        torch.autograd.backward(want, dys), torch.autograd.backward(got, dys)
        grads = [(r.grad, c.grad) for r, c in zip(ref_in, got_in)
                 if isinstance(r, torch.Tensor) and r.is_floating_point()]
        for a, b in list(zip(want, got)) + grads:
            err = ((a.float() - b.float()).norm() / a.float().norm()).item()
            assert err < tol, (fn.__name__, dtype, err)

    cos, sin = (torch.randn(512, 16, generator=g, device="cuda") for _ in range(2))   # [T, R/2]
    # v3_small's heads: 16 x (nope 64 + rope 32) queries, 16 x (nope 64 + value 64) keys/values, one 32-dim rope key
    for qh, kvh in ((query_heads, key_value_heads), (query_heads_bthd, key_value_heads_bthd)):   # default, opt-in
        check(qh, torch.randn(2, 512, 16 * 96, generator=g, device="cuda", dtype=dtype), cos, sin, 16, 64)
        check(kvh, torch.randn(2, 512, 16 * 128, generator=g, device="cuda", dtype=dtype),
              torch.randn(2, 512, 32, generator=g, device="cuda", dtype=dtype), cos, sin, 16, 64)
    for rows in (8192, 1000):          # a new row count, as the routed experts see every step
        x = torch.randn(rows, 1024, generator=g, device="cuda", dtype=dtype)
        w = (1 + 0.1 * torch.randn(1024, generator=g, device="cuda")).to(dtype)
        check(_norm, x, w)
        check(_residual_norm, x, torch.randn(rows, 1024, generator=g, device="cuda", dtype=dtype), w)
        check(swiglu, torch.randn(rows, 2 * 1024, generator=g, device="cuda", dtype=dtype))
        order = torch.randperm(rows, generator=g, device="cuda")          # rows = T * K copies, K = 8
        check(unsort_and_weight, x, order, torch.rand(rows // 8, 8, generator=g, device="cuda"))
        check(unsort_rows_and_weight, x, order, torch.rand(rows // 8, 8, generator=g, device="cuda"))   # opt-ins
        check(gather_copies, x[: rows // 8], order, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's CUDA kernels need a GPU")
def test_inductor_router_regions_on_cuda_equal_eager():
    """The router's selection (its top-k's as ranks, in the generated code) and balance terms under inductor vs
    eager: the same experts for (nearly) every token, gate weights, scores and gradients to FP32 rounding; and the
    selection equals top-k's (``tests/test_routing.py``'s reference) on the device."""
    from models.moe import balance_and_load, select_experts
    from parallel.compile import region
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(8192, 64, generator=g, device="cuda")
    bias = 0.01 * torch.randn(64, generator=g, device="cuda")
    args = (bias, 8, 2, 4, 8, 2.5)                     # v3_small: 8 groups, 4 of them per token, 8 experts
    ref, got = (logits.clone().requires_grad_(True) for _ in range(2))
    (i0, w0, s0), (i1, w1, s1) = select_experts(ref, *args), region(select_experts, "inductor")(got, *args)
    assert (i0 == i1).all(-1).float().mean().item() > 0.999
    from .test_routing import _select_by_top_ks
    i2, _ = _select_by_top_ks(logits, bias, 8, 2, 4, 8, 2.5)
    assert (i0 == i2).all(-1).float().mean().item() > 0.999
    same = (i0 == i1).all(-1)
    dw = torch.randn(w0.shape, generator=g, device="cuda")
    (l0, c0), (l1, c1) = (f(s.view(4, 2048, 64), i.view(4, 2048, 8))
                          for f, s, i in ((balance_and_load, s0, i0), (region(balance_and_load, "inductor"), s1, i1)))
    assert torch.equal(c0, c1) == bool(same.all()) and abs(l0.item() - l1.item()) < 1e-5 * abs(l0.item())
    ((w0 * dw).sum() + l0).backward(), ((w1 * dw).sum() + l1).backward()
    for a, b in ((w0[same], w1[same]), (s0, s1), (ref.grad[same], got.grad[same])):
        assert ((a - b).norm() / a.norm()).item() < 1e-5
