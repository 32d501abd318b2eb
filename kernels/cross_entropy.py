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


def _verified(device: torch.device) -> bool:
    return selfcheck.verified("cross_entropy", device, lambda: self_check(device), CHECK_TOL, "cross-entropy",
                              "F.cross_entropy")


def self_check(device: torch.device) -> float:
    """Worst relative error of the Triton loss and gradient vs ``F.cross_entropy`` on a small problem with
    ignored labels and BF16 logits, at the launch a real vocabulary gets: blocks of ``BLOCK_V`` on a GPU (three,
    the last ragged), a width divisible by 16 as V3's 129,280 is."""
    g = torch.Generator().manual_seed(0)
    V = 2 * BLOCK_V + 816
    logits = (torch.randn(67, V, generator=g) * 4).to(device=device, dtype=torch.bfloat16)
    labels = torch.randint(0, V, (67,), generator=g).to(device)
    labels[::7] = IGNORE
    errs = []
    for fn in (reference_cross_entropy, triton_cross_entropy):
        with torch.enable_grad(), torch.autocast(device.type, enabled=False):   # first use may be in evaluation
            x = logits.clone().requires_grad_(True)
            loss = fn(x, labels)
            loss.backward()
        errs.append((loss.detach().double(), x.grad.double()))
    (want, dwant), (got, dgot) = errs
    if not (torch.isfinite(got) and torch.isfinite(dgot).all()):
        return float("nan")
    return max(float((got - want).abs() / want.abs()), float((dgot - dwant).norm() / dwant.norm()))


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


def _block(V: int) -> int:
    import triton
    cap = 1024 if interpreting() else BLOCK_V
    return min(cap, triton.next_power_of_2(max(V, 16)))


def _kernels():
    """The Triton kernels (imported on first use: ``configure()`` must run before triton decorates them)."""
    configure()
    from . import _cross_entropy_kernels
    return _cross_entropy_kernels
