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

A split master (``optim.master=split``): ``master`` is an int16 tensor holding the low 16 bits of each FP32 master
value and ``out`` (required) the BF16 weight, its high 16 bits (``split_master``, ``join_master``). The kernel reads
both, updates the joined FP32 value as above, and writes both back: 8 bytes of master traffic per element instead
of 10 (FP32 master read and written, BF16 weight written), and 2 bytes less memory per parameter. The BF16 weight is
then the master rounded half toward zero: round to nearest even but for exact ties (low half 0x8000), which keep
the high half, so the low half alone says whether it was rounded up.

On CUDA the kernel runs once it passed its self-check (``selfcheck.py``); callers ask ``usable(device)``
(``usable(device, split=True)``: the split master's own verdict).
"""
from __future__ import annotations


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


def split_master(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 ``x`` as ``(high, low)``: the BF16 ``high`` (``x`` rounded half toward zero: ``join_master``) and the
    int16 ``low`` (the low 16 bits of ``x``), whose join is ``x`` bit for bit."""
    bits = x.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    low = bits & 0xFFFF
    high = (bits >> 16) + (low > 0x8000).to(torch.int64)
    return _int16(high).view(torch.bfloat16), _int16(low)


def join_master(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The FP32 tensor whose bits ``split_master`` gave as ``(high, low)``: the high half less one where the low
    half says it was rounded up (above 0x8000), then the low half."""
    low = low.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    high = (high.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF) - (low > 0x8000).to(torch.int64)
    bits = (high << 16) | low
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


def _int16(u: torch.Tensor) -> torch.Tensor:
    """Unsigned 16-bit values (int64) as the int16 with the same bits."""
    return torch.where(u >= 1 << 15, u - (1 << 16), u).to(torch.int16)


@torch.no_grad()
def reference_adamw_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                     lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                     coef: torch.Tensor | None = None, out: torch.Tensor | None = None) -> None:
    """The update of the module docstring in torch ops (moments in their dtype, maths in FP32, the order of
    ``torch.optim.AdamW``'s single-tensor path); ``grad`` is not modified. An int16 ``master``: the low half of a
    split master whose high half is ``out`` (module docstring)."""
    if master.dtype == torch.int16:
        full = join_master(out, master)
        reference_adamw_(full, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                         weight_decay=weight_decay, step=step, coef=coef)
        high, low = split_master(full)
        out.copy_(high.view(out.shape))
        master.copy_(low.view(master.shape))
        return
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
    split = master.dtype == torch.int16
    assert master.dtype == torch.float32 or (split and out is not None and out.dtype == torch.bfloat16), \
        (master.dtype, out)
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
        HAS_OUT=out is not None, SPLIT=split, BLOCK=block, num_warps=4)


def usable(device: torch.device | str, split: bool = False) -> bool:
    """Whether the kernel runs on ``device`` by default: a CUDA device where it passed its self-check
    (``verified``; ``split``: the split master's too); the caller takes its torch path where not."""
    device = torch.device(device)
    return device.type == "cuda" and verified(device) and (not split or verified_split(device))


def verified(device: torch.device) -> bool:
    """The self-check's verdict on ``device`` (run once per device; a failed check logs one warning)."""
    return selfcheck.verified("adamw", device, lambda: self_check(device), CHECK_TOL, "adamw", "torch's AdamW")


def verified_split(device: torch.device) -> bool:
    """``split_self_check``'s verdict, apart from ``verified``'s: a wrong split path leaves the plain one in use."""
    return selfcheck.verified("adamw_split", device, lambda: split_self_check(device), CHECK_TOL,
                              "adamw (split master)", "its torch reference")


def self_check(device: torch.device) -> float:
    """Worst relative error of master and moments after two steps of the kernel vs ``reference_adamw_`` on a
    small ragged problem (BF16 gradient, clip coefficient < 1, weight decay, FP32 and BF16 moments, BF16
    ``out``; BF16 moments' errors scaled by ``CHECK_TOL / BF16_MOMENT_TOL``); NaN when ``out`` is not the new
    master rounded to BF16 bit for bit."""
    n, start, grads = _check_problem(device)
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
    return selfcheck.worst(errs)


def split_self_check(device: torch.device) -> float:
    """Worst relative error of the joined master and the moments after two steps of the kernel vs
    ``reference_adamw_``, both on a split master (BF16 moments, scaled as in ``self_check``); NaN when the kernel's
    halves are not the split of their own join bit for bit."""
    n, start, grads = _check_problem(device)
    runs = []
    for fn in (reference_adamw_, triton_adamw_):
        out, low = split_master(start)
        m, v = torch.zeros(n, dtype=torch.bfloat16, device=device), torch.zeros(n, dtype=torch.bfloat16, device=device)
        for step, grad in enumerate(grads, 1):
            fn(low, grad, m, v, lr=1e-2 * step, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step,
               coef=torch.tensor(0.5, device=device), out=out)
        runs.append((join_master(out, low), m, v, out, low))
    (want, *wmom, _, _), (got, *gmom, gout, glow) = runs
    high, low = split_master(got)
    if selfcheck.mismatch(gout, high) or selfcheck.mismatch(glow, low):
        return float("nan")
    scale = CHECK_TOL / BF16_MOMENT_TOL
    return selfcheck.worst([selfcheck.rel_err(got, want)]
                           + [selfcheck.rel_err(a, b) * scale for a, b in zip(gmom, wmom)])


def _check_problem(device: torch.device) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
    """The self-checks' problem: a ragged length, an FP32 start and two BF16 gradients, seeded."""
    g = torch.Generator().manual_seed(0)
    n = 3 * BLOCK + 77
    start = torch.randn(n, generator=g).to(device)
    return n, start, [torch.randn(n, generator=g).to(device=device, dtype=torch.bfloat16) for _ in range(2)]


def _kernels():
    """The Triton kernel (imported on first use: ``configure()`` must run before triton decorates it)."""
    configure()
    from . import _adamw_kernels
    return _adamw_kernels
