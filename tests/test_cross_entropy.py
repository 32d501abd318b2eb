"""The Triton cross-entropy (``kernels/cross_entropy.py``) against ``F.cross_entropy`` of the FP32 logits: loss and
gradient, with ignored labels, ragged vocabulary blocks, BF16 and FP32 logits; its self-check; and the dispatch
(Triton on a device where it passed its check, the reference elsewhere). Under the interpreter on CPU, compiled
on a GPU."""
import logging

import pytest
import torch

pytest.importorskip("triton")

import kernels  # noqa: E402

kernels.configure()
from kernels import cross_entropy as ce  # noqa: E402
from kernels import selfcheck  # noqa: E402

from .fp8_utils import DEV, fresh_verdicts  # noqa: E402,F401 - autouse


def problem(N, V, dtype, seed=0, ignore_every=5):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, V, generator=g) * 3).to(device=DEV, dtype=dtype)
    labels = torch.randint(0, V, (N,), generator=g).to(DEV)
    if ignore_every:
        labels[::ignore_every] = ce.IGNORE
    return logits, labels


def loss_and_grad(fn, logits, labels, scale=1.0):
    x = logits.clone().requires_grad_(True)
    loss = fn(x, labels)
    (loss * scale).backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,V,block", [(37, 1000, 256), (5, 300, 1024), (16, 4099, 512)])
def test_matches_f_cross_entropy(dtype, N, V, block):
    logits, labels = problem(N, V, dtype)
    want, dwant = loss_and_grad(ce.reference_cross_entropy, logits, labels, scale=0.7)
    got, dgot = loss_and_grad(lambda x, y: ce.triton_cross_entropy(x, y, block_v=block), logits, labels, scale=0.7)
    assert dgot.dtype == dtype and dgot.shape == logits.shape
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
    # the gradient: the same FP32 value up to summation order, rounded once to the logits' dtype
    tol = {torch.bfloat16: 8e-3, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(dgot.float(), dwant.float(), rtol=tol, atol=tol * dwant.abs().max().item())
    assert (dgot[labels == ce.IGNORE] == 0).all()
    assert float((dgot.float() - dwant.float()).norm() / dwant.float().norm()) < 1e-3


def test_strided_logits_and_labels():
    """A logits view with a row stride wider than V and labels taken every other element (the kernels read rows at
    their stride and make the labels contiguous)."""
    wide, labels2 = problem(12, 640, torch.float32, seed=2)
    logits, labels = wide[:, :600], torch.stack([labels2.clamp_max(599)] * 2, 1)[:, 0]
    assert logits.stride(0) == 640 and labels.stride(0) == 2
    want, dwant = loss_and_grad(ce.reference_cross_entropy, logits, labels)
    got, dgot = loss_and_grad(lambda x, y: ce.triton_cross_entropy(x, y, block_v=256), logits, labels)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
    torch.testing.assert_close(dgot, dwant, rtol=1e-5, atol=1e-6)


def test_large_logits_and_every_label_ignored():
    logits, labels = problem(8, 700, torch.float32, ignore_every=0)
    logits = logits * 1e3                        # exp overflows without the running max
    want, dwant = loss_and_grad(ce.reference_cross_entropy, logits, labels)
    got, dgot = loss_and_grad(lambda x, y: ce.triton_cross_entropy(x, y, block_v=128), logits, labels)
    assert torch.isfinite(got) and torch.isfinite(dgot).all()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(dgot, dwant, rtol=1e-5, atol=1e-6)
    none = torch.full_like(labels, ce.IGNORE)
    got, dgot = loss_and_grad(lambda x, y: ce.triton_cross_entropy(x, y, block_v=128), logits, none)
    assert float(got) == 0.0 and (dgot == 0).all()      # nothing to average (F.cross_entropy: 0/0 = nan)


def test_self_check_passes_here_and_a_wrong_kernel_gives_way(monkeypatch, caplog):
    assert ce.self_check(DEV) < ce.CHECK_TOL
    with torch.no_grad():                                   # a first use in evaluation checks it all the same
        assert ce.self_check(DEV) < ce.CHECK_TOL
    logits, labels = problem(9, 300, torch.bfloat16)
    if DEV.type == "cuda":
        monkeypatch.setattr(ce, "self_check", lambda device: 0.5)
        with caplog.at_level(logging.WARNING, logger="kernels"):
            got = ce.cross_entropy(logits, labels)
            ce.cross_entropy(logits, labels)
        assert len(caplog.records) == 1 and "using F.cross_entropy instead" in caplog.records[0].getMessage()
        assert float(got) == float(ce.reference_cross_entropy(logits, labels))
    else:       # off CUDA the reference runs (the interpreter is for tests), and no check is made
        assert float(ce.cross_entropy(logits, labels)) == float(ce.reference_cross_entropy(logits, labels))
        assert not selfcheck.verdicts()


def _kept_bytes(fn, logits, labels) -> int:
    """Bytes of the distinct storages ``fn``'s autograd keeps for the backward, the labels' excepted."""
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() != labels.untyped_storage().data_ptr():
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    x = logits.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(x, labels)
    loss.backward()
    return sum(kept.values())


def test_what_each_loss_keeps_for_the_backward_is_what_the_memory_plan_counts():
    """``trainer.activations.HEAD_KEEPS``: per token of BF16 logits, the kernels keep the logits and one FP32
    log-sum-exp (and one count), ``F.cross_entropy`` of the FP32 logits the FP32 log-probabilities (and one
    scalar)."""
    from trainer.activations import HEAD_KEEPS
    N, V = 24, 1000
    logits, labels = problem(N, V, torch.bfloat16, ignore_every=0)
    fused = _kept_bytes(lambda x, y: ce.triton_cross_entropy(x, y, block_v=256), logits, labels)
    plain = _kept_bytes(ce.reference_cross_entropy, logits, labels)
    assert fused == N * HEAD_KEEPS["fused"](V, 2) + 8            # + the count of labels, one int64
    assert plain == N * HEAD_KEEPS["plain"](V, 2) + 4            # + nll_loss's total weight, one FP32


def head_problem(N, D, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g).to(device=DEV, dtype=dtype)
    w = (torch.randn(V, D, generator=g) * 0.3).to(device=DEV, dtype=dtype)
    labels = torch.randint(0, V, (N,), generator=g).to(DEV)
    labels[::5] = ce.IGNORE
    return x, w, labels


def head_grads(fn, x, w, labels, scale):
    a, b = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = fn(a, b, labels)
    (loss * scale).backward()
    return loss.detach(), a.grad, b.grad


def fused_head(x, w, labels):
    return ce.triton_cross_entropy(torch.nn.functional.linear(x, w), labels, block_v=256)


def inplace_head(x, w, labels):
    return ce.triton_head_cross_entropy(x, w, labels, block_v=256)


@pytest.mark.parametrize("scale", [1.0, 0.3])
def test_the_gradient_in_the_forward_equals_the_fused_head_in_fp32(scale):
    """``head_cross_entropy`` (``train.head_loss=inplace``): the loss, and the head input's and weight's gradients
    (the incoming gradient applied through the GEMMs' small operands) equal the fused head's to FP32 rounding."""
    x, w, labels = head_problem(37, 48, 1000, torch.float32)
    want, dxw, dww = head_grads(fused_head, x, w, labels, scale)
    got, dx, dw = head_grads(inplace_head, x, w, labels, scale)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
    torch.testing.assert_close(dx, dxw, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(dw, dww, rtol=1e-5, atol=1e-7)
    assert (dw.abs().sum(1) > 0).all() and (dx[labels == ce.IGNORE] == 0).all()


def test_the_gradient_in_the_forward_is_as_close_to_fp64_as_the_fused_head_in_bf16():
    """BF16: the gradients carry one more rounding than the fused head's when the incoming gradient is not 1
    (the GEMM's output, then its product with it); both stay within BF16's error of the FP64 truth."""
    x, w, labels = head_problem(37, 48, 1000, torch.bfloat16, seed=3)
    truth = head_grads(lambda a, b, y: ce.reference_cross_entropy(torch.nn.functional.linear(a, b), y),
                       x.double(), w.double(), labels, 0.3)
    for fn in (fused_head, inplace_head):
        loss, dx, dw = head_grads(fn, x, w, labels, 0.3)
        assert dx.dtype == dw.dtype == torch.bfloat16
        torch.testing.assert_close(loss.double(), truth[0].double(), rtol=1e-3, atol=0)   # BF16 logits
        for got, want in ((dx, truth[1]), (dw, truth[2])):
            assert float((got.double() - want).norm() / want.norm()) < 8e-3


def test_the_gradient_in_the_forward_under_autocast_and_without_grad():
    """Under BF16 autocast the head's GEMM runs in BF16 and the gradients come back in the inputs' dtype (FP32),
    as ``F.linear``'s do; without grad only the loss is computed (the plain kernel, no gradient pass)."""
    x, w, labels = head_problem(21, 32, 700, torch.float32, seed=4)
    with torch.autocast(DEV.type, dtype=torch.bfloat16):
        want, dxw, dww = head_grads(fused_head, x, w, labels, 1.0)
        got, dx, dw = head_grads(inplace_head, x, w, labels, 1.0)
        with torch.no_grad():
            quiet = inplace_head(x, w, labels)
    assert dx.dtype == dw.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
    assert float(quiet) == float(got)
    for a, b in ((dx, dxw), (dw, dww)):   # the same BF16 values (g = 1: no second rounding), widened
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_head_check_catches_a_wrong_scale_and_leaves_the_fused_kernels_alone(monkeypatch):
    assert ce.head_self_check(DEV) < ce.CHECK_TOL
    monkeypatch.setattr(ce, "_scaled", lambda t, g, copy=False: (t.float() * g * (1 + 2 ** -7)).to(t.dtype))
    assert ce.head_self_check(DEV) == float("inf")
    assert ce.self_check(DEV) < ce.CHECK_TOL


def test_the_gradient_in_the_forward_keeps_its_logits_buffer_only():
    """``HEAD_KEEPS["inplace"]``: per token, the BF16 logits' buffer (holding their gradient) and nothing in FP32;
    the head's input and weight are kept as the plain head's ``F.linear`` keeps them."""
    from trainer.activations import HEAD_KEEPS
    N, D, V = 24, 16, 1000
    x, w, labels = head_problem(N, D, V, torch.bfloat16)
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    a, b = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = inplace_head(a, b, labels)
    loss.backward()
    assert sum(kept.values()) == N * HEAD_KEEPS["inplace"](V, 2) + a.nbytes + b.nbytes


def test_a_model_with_the_gradient_in_the_forward_equals_the_fused_head(monkeypatch):
    """The tiny model (main and MTP heads on one weight, MTP's loss weighted 0.3: an incoming gradient that is
    not 1) with ``train.head_loss=inplace`` against ``fused``: the loss and every parameter's gradient, in FP32.
    Off CUDA the Triton paths are forced (the interpreter), as the heads would take them on a GPU."""
    import models
    from configs import model_preset
    from parallel import head_loss
    if DEV.type != "cuda":
        monkeypatch.setattr(head_loss, "cross_entropy", lambda x, y: ce.triton_cross_entropy(x, y, block_v=256))
        monkeypatch.setattr(head_loss, "head_cross_entropy",
                            lambda x, w, y: ce.triton_head_cross_entropy(x, w, y, block_v=256))
    ids = torch.randint(0, 1024, (2, 33), generator=torch.Generator().manual_seed(0)).to(DEV)
    runs = []
    for kind in ("fused", "inplace"):
        model = models.build(model_preset("tiny"), device=DEV, seed=0).train()
        head_loss.apply_head_loss(model, kind)
        out = model.compute_loss(ids[:, :-1], ids[:, 1:], mtp_weight=0.3)
        out.loss.backward()
        runs.append((out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = runs
    assert type(model.head) is head_loss.InplaceLossHead and float(b.mtp_loss) > 0
    for x, y in ((a.loss, b.loss), (a.lm_loss, b.lm_loss), (a.mtp_loss, b.mtp_loss)):
        torch.testing.assert_close(y, x, rtol=2e-6, atol=0)
    assert ga.keys() == gb.keys() and "head.weight" in ga
    for n in ga:
        assert float((gb[n] - ga[n]).norm() / ga[n].norm().clamp_min(1e-30)) < 1e-5, n
