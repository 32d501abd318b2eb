"""Cross-entropy over a large vocabulary in two Triton passes, without FP32 logits (family: fused softmax CE).

``cross_entropy(logits [N,V], labels [N])`` -> the mean over the labels that are not ``IGNORE`` of
``logsumexp(logits_n) - logits_n[label_n]``, computed in FP32 from logits in their own dtype (BF16 under
autocast):

- forward (``_ce_fwd_kernel``, one program per row): a running max and sum per lane over the row in blocks of
  ``BLOCK_V``, combined into the row's log-sum-exp; writes the row's loss and log-sum-exp (8 bytes per row);
- backward (``_ce_bwd_kernel``): ``dlogits = (softmax - onehot) · g / n_valid`` in the logits' dtype, rows of
  ignored labels zero.

The backward keeps only the logits (the head's output, in its dtype) and the per-row log-sum-exp. The plain path
``F.cross_entropy(logits.float())`` keeps ``N x V`` FP32 log-probabilities and makes an FP32 copy of the logits on
the way (on an H100 its softmax kernels are 20 % of the v3_small step's GPU time). Same numbers up to FP32
summation order. On CUDA the kernels run once they passed their self-check (``selfcheck.py``); elsewhere, and
where the check fails, ``reference_cross_entropy`` runs.

``head_cross_entropy(x [N,D], w [V,D], labels [N])`` (``train.head_loss=inplace``) is the same loss of the head's
logits ``x wᵀ`` with the gradient taken in the forward: one kernel (``_ce_fwd_grad_kernel``) reads each row, then
writes ``(softmax - onehot) / n_valid`` over it (the second read of the row mostly from L2), and the backward is
the head's two GEMMs on that buffer, scaled by the incoming gradient through their small operands (``dx = (d w) g``,
``dW = dᵀ (x g)``). Against ``fused``, the logits are read once and written once instead of read twice and written
once: 2 bytes per logit less (v3_small, two heads of 8,192 x 129,280 BF16 logits: 4.2 GB a step), same memory.
That needs the second read to hit L2: a 129,280-word row is 253 KiB, and an H100's 50 MB of L2 holds about 200 of
them, about as many as its SMs run at once; where the rows in flight outgrow it, the second read goes to HBM and
the two paths move the same bytes. Opt-in until a GPU has timed it (``bench.step_variants`` variant N).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import configure, interpreting, selfcheck

IGNORE = -100           # F.cross_entropy's ignore_index
BLOCK_V = 4096          # vocabulary block per step of a row's loop (GPU)
CHECK_TOL = 1e-5        # relative error of loss and gradient vs F.cross_entropy; FP32 reordering gives ~1e-7


def reference_cross_entropy(logits_NV: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    """What the kernels compute, in torch: ``F.cross_entropy`` of the FP32 logits (mean over labels != IGNORE)."""
    return F.cross_entropy(logits_NV.float(), labels_N, ignore_index=IGNORE)


def cross_entropy(logits_NV: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits [N,V]`` against ``labels [N]``: the Triton kernels on a CUDA device where
    they passed their self-check, else ``reference_cross_entropy`` (module docstring)."""
    if logits_NV.device.type == "cuda" and _verified(logits_NV.device):
        return triton_cross_entropy(logits_NV, labels_N)
    return reference_cross_entropy(logits_NV, labels_N)


def triton_cross_entropy(logits_NV: torch.Tensor, labels_N: torch.Tensor, block_v: int | None = None) -> torch.Tensor:
    """The Triton path, unconditionally (tests; the interpreter on CPU). ``block_v``: the vocabulary block."""
    return _CrossEntropy.apply(logits_NV, labels_N, block_v)


def head_cross_entropy(x_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``x @ w.T`` against ``labels``: the head's GEMM and ``_HeadCrossEntropy`` on a CUDA
    device where the kernels passed their self-check, else ``F.linear`` and ``reference_cross_entropy``."""
    if x_ND.device.type == "cuda" and _head_verified(x_ND.device):
        return triton_head_cross_entropy(x_ND, w_VD, labels_N)
    return reference_cross_entropy(F.linear(x_ND, w_VD), labels_N)


def triton_head_cross_entropy(x_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor,
                              block_v: int | None = None) -> torch.Tensor:
    """The gradient-in-the-forward path, unconditionally (tests; the interpreter on CPU)."""
    return _HeadCrossEntropy.apply(x_ND, w_VD, labels_N, block_v)


def _verified(device: torch.device) -> bool:
    return selfcheck.verified("cross_entropy", device, lambda: self_check(device), CHECK_TOL, "cross-entropy",
                              "F.cross_entropy")


def _head_verified(device: torch.device) -> bool:
    return selfcheck.verified("head_cross_entropy", device, lambda: head_self_check(device), CHECK_TOL,
                              "head cross-entropy", "F.linear and F.cross_entropy")


def self_check(device: torch.device) -> float:
    """Worst relative error of the Triton loss and gradient vs ``F.cross_entropy`` on a small problem with
    ignored labels and BF16 logits, at the launch a real vocabulary gets: blocks of ``BLOCK_V`` on a GPU (three,
    the last ragged), a width divisible by 16 as V3's 129,280 is."""
    return _check(device, triton_cross_entropy)


def head_self_check(device: torch.device) -> float:
    """``self_check`` of ``head_cross_entropy``'s kernels (their own verdict: a failure here leaves the fused
    head's kernels in use): the gradient-in-the-forward kernel through an identity head, and ``_scaled`` bit for
    bit against torch in FP32 (``inf`` if it differs)."""
    g = torch.Generator().manual_seed(1)
    t = torch.randn(67, 1000, generator=g).to(device=device, dtype=torch.bfloat16)
    scale = torch.tensor([0.7], device=device)
    if not torch.equal(_scaled(t, scale, copy=True), (t.float() * scale).to(t.dtype)):
        return float("inf")
    return _check(device, _as_linear)


def _check(device: torch.device, fn) -> float:
    g = torch.Generator().manual_seed(0)
    V = 2 * BLOCK_V + 816
    logits = (torch.randn(67, V, generator=g) * 4).to(device=device, dtype=torch.bfloat16)
    labels = torch.randint(0, V, (67,), generator=g).to(device)
    labels[::7] = IGNORE
    errs = []
    for f in (reference_cross_entropy, fn):
        with torch.enable_grad(), torch.autocast(device.type, enabled=False):   # first use may be in evaluation
            x = logits.clone().requires_grad_(True)
            loss = f(x, labels)
            loss.backward()
        errs.append((loss.detach().double(), x.grad.double()))
    (want, dwant), (got, dgot) = errs
    if not (torch.isfinite(got) and torch.isfinite(dgot).all()):
        return float("nan")
    return max(float((got - want).abs() / want.abs()), float((dgot - dwant).norm() / dwant.norm()))


def _as_linear(logits_NV: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    """``triton_head_cross_entropy`` on logits: an identity head (``x = logits``, ``w = I``), whose GEMMs are
    exact, so the kernel's loss and gradient reach the check unchanged."""
    eye = torch.eye(logits_NV.shape[1], dtype=logits_NV.dtype, device=logits_NV.device)
    return triton_head_cross_entropy(logits_NV, eye, labels_N)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV, labels_N, block_v):
        kern = _kernels()
        N, V = logits_NV.shape
        assert labels_N.shape == (N,), (labels_N.shape, N)
        logits_NV = logits_NV if logits_NV.stride(-1) == 1 else logits_NV.contiguous()
        labels_N = labels_N.contiguous()                            # the kernels read label n at labels_ptr + n
        block = block_v or _block(V)
        loss_N = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
        lse_N = torch.empty_like(loss_N)
        if N:
            kern._ce_fwd_kernel[(N,)](logits_NV, labels_N, loss_N, lse_N, V, logits_NV.stride(0), IGNORE=IGNORE,
                                      BLOCK_V=block, num_warps=8)
        n_valid = (labels_N != IGNORE).sum().clamp_min(1)          # a tensor: no host sync
        ctx.save_for_backward(logits_NV, labels_N, lse_N, n_valid)
        ctx.block = block
        return loss_N.sum() / n_valid

    @staticmethod
    def backward(ctx, grad_loss):
        kern = _kernels()
        logits_NV, labels_N, lse_N, n_valid = ctx.saved_tensors
        N, V = logits_NV.shape
        scale = (grad_loss.float() / n_valid).reshape(1)
        dlogits_NV = torch.empty_like(logits_NV)
        if N:
            kern._ce_bwd_kernel[(N,)](logits_NV, labels_N, lse_N, scale, dlogits_NV, V, logits_NV.stride(0),
                                      dlogits_NV.stride(0), IGNORE=IGNORE, BLOCK_V=ctx.block, num_warps=8)
        return dlogits_NV, None, None


class _HeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, w_VD, labels_N, block_v):
        kern = _kernels()
        dev = x_ND.device.type
        mm = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x_ND.dtype   # the head's GEMM dtype
        N, V = labels_N.shape[0], w_VD.shape[0]
        with torch.autocast(dev, enabled=False):   # the dtypes are explicit
            x_mm, w_mm = x_ND.to(mm), w_VD.to(mm)
            logits_NV = x_mm @ w_mm.t()
        labels_N = labels_N.contiguous()
        block = block_v or _block(V)
        loss_N = torch.empty(N, dtype=torch.float32, device=x_ND.device)
        n_valid = (labels_N != IGNORE).sum().clamp_min(1)          # a tensor: no host sync
        grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        if N and grad:
            scale = (1.0 / n_valid.float()).reshape(1)
            kern._ce_fwd_grad_kernel[(N,)](logits_NV, labels_N, loss_N, scale, V, logits_NV.stride(0),
                                           IGNORE=IGNORE, BLOCK_V=block, num_warps=8)
        elif N:
            kern._ce_fwd_kernel[(N,)](logits_NV, labels_N, loss_N, torch.empty_like(loss_N), V, logits_NV.stride(0),
                                      IGNORE=IGNORE, BLOCK_V=block, num_warps=8)
        if grad:   # the logits' buffer now holds d loss / d logits
            ctx.save_for_backward(x_mm, w_mm, logits_NV)
            ctx.dtypes = x_ND.dtype, w_VD.dtype
        return loss_N.sum() / n_valid

    @staticmethod
    def backward(ctx, grad_loss):
        x_mm, w_mm, d_NV = ctx.saved_tensors
        g = grad_loss.float().reshape(1)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _scaled(d_NV @ w_mm, g).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:
            dw = (d_NV.t() @ _scaled(x_mm, g, copy=True)).to(ctx.dtypes[1])
        return dx, dw, None, None


def _scaled(t: torch.Tensor, g: torch.Tensor, copy: bool = False) -> torch.Tensor:
    """``t * g`` (``g``: one FP32 value on the device) computed in FP32 and rounded once, in place or, with
    ``copy``, into a new tensor. torch's ``mul`` of a BF16 tensor would round ``g`` to BF16 first (a bias of up to
    0.4 % on every gradient), and ``t.float() * g`` then a cast makes three passes."""
    t = t.contiguous()
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device) if copy else t
    if t.numel():
        block = 1024
        _kernels()._scale_kernel[(-(-t.numel() // block),)](t, g, out, t.numel(), BLOCK=block, num_warps=4)
    return out


def _block(V: int) -> int:
    import triton
    cap = 1024 if interpreting() else BLOCK_V
    return min(cap, triton.next_power_of_2(max(V, 16)))


def _kernels():
    """The Triton kernels (imported on first use: ``configure()`` must run before triton decorates them)."""
    configure()
    from . import _cross_entropy_kernels
    return _cross_entropy_kernels
