"""AdamW in one pass over a flat tensor (family: fused optimizer update).

``triton_adamw_(master, grad, exp_avg, exp_avg_sq, ..., coef, out)`` updates, in place and in one pass, the FP32
``master`` and the two moments (FP32 or BF16, each its own dtype) from ``grad`` (BF16 or FP32), optionally
writing the updated master rounded into ``out`` (the BF16 model weight) in the same pass. All tensors hold the
same number of elements and are contiguous (any shape: they are read flat). Per element, in FP32, in
``torch.optim.AdamW``'s order (``reference_adamw_`` is the same maths in torch, the CPU path and the oracle)::

    g  = grad · coef                          (coef: the clip coefficient, a device scalar: no host sync)
    p *= 1 - lr·wd                            (decoupled weight decay)
    m  = m.lerp(g, 1 - β1)
    v  = v·β2 + (1 - β2)·g²
    p -= lr / (1 - β1^step) · m / (sqrt(v) / sqrt(1 - β2^step) + eps)

``lr`` and ``step`` are kernel arguments, not constexprs: the LR schedule changes ``lr`` every step without
recompiling. Bytes per element: the gradient read once, master and moments read and written once, ``out``
written once (28 B with a BF16 gradient, FP32 moments and a BF16 ``out``), against ~20 passes for torch's
foreach AdamW and 4 more ops (clip, cast of the gradient, cast of the master) around torch's fused one.

On CUDA the kernel runs once it passed its self-check (``selfcheck.py``); callers ask ``usable(device)``.
"""
from __future__ import annotations

import math

import torch

from . import configure, selfcheck

BLOCK = 1024            # elements per program (GPU)
CHECK_TOL = 1e-5        # relative error vs the reference; FP32 reordering (fused multiply-adds) gives ~1e-7
# BF16 moments: a fused multiply-add can flip an element's BF16 rounding (one flip in the check's 3,149 elements:
# 6e-5); a wrong kernel is >= 1e-2 off.
BF16_MOMENT_TOL = 1e-3


def _hyper(lr: float, beta1: float, beta2: float, weight_decay: float, step: int) -> dict:
    """The per-call scalars, computed on the host in double as ``torch.optim.AdamW`` does."""
    return {"decay": 1 - lr * weight_decay, "lerp_w": 1 - beta1, "beta2": beta2, "one_minus_beta2": 1 - beta2,
            "step_size": lr / (1 - beta1 ** step), "bc2_sqrt": (1 - beta2 ** step) ** 0.5}


@torch.no_grad()
def reference_adamw_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                     lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                     coef: torch.Tensor | None = None, out: torch.Tensor | None = None) -> None:
    """The update of the module docstring in torch ops (moments in their dtype, maths in FP32, the order of
    ``torch.optim.AdamW``'s single-tensor path); ``grad`` is not modified."""
    h = _hyper(lr, beta1, beta2, weight_decay, step)
    g = grad.float() if grad.dtype != torch.float32 else grad
    if coef is not None:
        g = g * coef
    m = exp_avg.float() if exp_avg.dtype != torch.float32 else exp_avg
    v = exp_avg_sq.float() if exp_avg_sq.dtype != torch.float32 else exp_avg_sq
    if weight_decay:
        master.mul_(h["decay"])
    m.lerp_(g, h["lerp_w"])
    v.mul_(beta2).addcmul_(g, g, value=h["one_minus_beta2"])
    denom = (v.sqrt() / h["bc2_sqrt"]).add_(eps)
    master.addcdiv_(m, denom, value=-h["step_size"])
    if m is not exp_avg:
        exp_avg.copy_(m)
    if v is not exp_avg_sq:
        exp_avg_sq.copy_(v)
    if out is not None:
        out.copy_(master)


@torch.no_grad()
def triton_adamw_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                  lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                  coef: torch.Tensor | None = None, out: torch.Tensor | None = None, block: int | None = None) -> None:
    """The Triton kernel, unconditionally (the interpreter on CPU: tests). Arguments as ``reference_adamw_``;
    ``coef``: an FP32 (or FP64) scalar tensor on the device; ``block``: elements per program."""
    kern = _kernels()
    n = master.numel()
    assert master.dtype == torch.float32, master.dtype
    for t in (grad, exp_avg, exp_avg_sq) + ((out,) if out is not None else ()):
        assert t.numel() == n and t.is_contiguous() and t.device == master.device, (t.shape, t.device, master.shape)
    assert master.is_contiguous()
    if coef is not None and coef.dtype != torch.float32:
        coef = coef.float()
    if not n:
        return
    block = block or BLOCK
    kern._adamw_kernel[(-(-n // block),)](
        master, grad, exp_avg, exp_avg_sq, out if out is not None else master, coef if coef is not None else master,
        n, eps=eps, **_hyper(lr, beta1, beta2, weight_decay, step), HAS_COEF=coef is not None,
        HAS_OUT=out is not None, BLOCK=block, num_warps=4)


def usable(device: torch.device | str) -> bool:
    """Whether the kernel runs on ``device`` by default: a CUDA device where it passed its self-check
    (``verified``); the caller takes its torch path where not."""
    device = torch.device(device)
    return device.type == "cuda" and verified(device)


def verified(device: torch.device) -> bool:
    """The self-check's verdict on ``device`` (run once per device; a failed check logs one warning)."""
    return selfcheck.verified("adamw", device, lambda: self_check(device), CHECK_TOL, "adamw", "torch's AdamW")


def self_check(device: torch.device) -> float:
    """Worst relative error of master and moments after two steps of the kernel vs ``reference_adamw_`` on a
    small ragged problem (BF16 gradient, clip coefficient < 1, weight decay, FP32 and BF16 moments, BF16
    ``out``; BF16 moments' errors scaled by ``CHECK_TOL / BF16_MOMENT_TOL``); NaN when ``out`` is not the new
    master rounded to BF16 bit for bit."""
    g = torch.Generator().manual_seed(0)
    n = 3 * BLOCK + 77
    start = torch.randn(n, generator=g).to(device)
    grads = [torch.randn(n, generator=g).to(device=device, dtype=torch.bfloat16) for _ in range(2)]
    errs = []
    for moments in (torch.float32, torch.bfloat16):
        runs = []
        for fn in (reference_adamw_, triton_adamw_):
            master = start.clone()
            m, v = torch.zeros(n, dtype=moments, device=device), torch.zeros(n, dtype=moments, device=device)
            out = torch.empty(n, dtype=torch.bfloat16, device=device)
            for step, grad in enumerate(grads, 1):
                fn(master, grad, m, v, lr=1e-2 * step, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                   step=step, coef=torch.tensor(0.5, device=device), out=out)
            runs.append((master, m, v, out))
        (want, *wmom, _), (got, *gmom, gout) = runs
        if selfcheck.mismatch(gout, got.to(torch.bfloat16)):
            return float("nan")
        scale = 1.0 if moments == torch.float32 else CHECK_TOL / BF16_MOMENT_TOL
        errs += [selfcheck.rel_err(got, want)] + [selfcheck.rel_err(a, b) * scale for a, b in zip(gmom, wmom)]
    return _worst(errs)


def _worst(errs: list[float]) -> float:
    """The largest error; NaN if any is (``max`` would pass over a NaN that is not first)."""
    return math.nan if any(math.isnan(e) for e in errs) else max(errs)


def _kernels():
    """The Triton kernel (imported on first use: ``configure()`` must run before triton decorates it)."""
    configure()
    from . import _adamw_kernels
    return _adamw_kernels
