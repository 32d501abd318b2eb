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

``triton_adamw_many_(updates, ...)`` is the same update for many tensors in one launch per kind (``launches``:
the same step count and dtypes): ``_adamw_many_kernel`` reads each tensor's addresses from a table, its programs
each update ``CHUNK`` elements of one tensor (a map of chunks per tensor list, built once and kept on the device).
A replicated model's 200-odd parameters take two launches instead of one each. No GPU has run it (nor
``triton_sums_of_squares``) yet: opt-in (``MANY_ENV=1``, ``many_enabled``); by default ``triton_adamw_each_``
launches ``triton_adamw_`` per tensor.

On CUDA the kernels run once they passed their self-check (``selfcheck.py``); callers ask ``usable(device)``.
"""
from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import torch

from . import configure, selfcheck

BLOCK = 1024            # elements per program (GPU)
CHUNK = 16 * BLOCK      # elements per program of the many-tensor kernel (a loop over BLOCKs)
MANY_ENV = "DSV3_ADAMW_MANY"   # "1": the many-tensor AdamW and the norm's sums (no GPU has run them yet)
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


class Update(NamedTuple):
    """One tensor's share of ``triton_adamw_many_``: the arguments of ``triton_adamw_`` and its step count."""
    master: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    out: torch.Tensor | None
    step: int


def launches(updates: list[Update]) -> list[list[Update]]:
    """``updates`` split into the launches of ``triton_adamw_many_``: one per step count and dtypes, in order."""
    kinds: dict[tuple, list[Update]] = {}
    for u in updates:
        if u.master.numel():
            key = (u.step, u.grad.dtype, u.exp_avg.dtype, u.exp_avg_sq.dtype, None if u.out is None else u.out.dtype)
            kinds.setdefault(key, []).append(u)
    return list(kinds.values())


def many_enabled() -> bool:
    """Whether the optimizers take the many-tensor kernels on CUDA (``MANY_ENV=1``; module docstring)."""
    return os.environ.get(MANY_ENV) == "1"


def triton_adamw_each_(updates: list[Update], **hyper) -> None:
    """``triton_adamw_`` on each of ``updates``, a launch per tensor; ``hyper``: ``triton_adamw_many_``'s keywords."""
    for u in updates:
        triton_adamw_(u.master, u.grad, u.exp_avg, u.exp_avg_sq, out=u.out, step=u.step, **hyper)


def reference_adamw_many_(updates: list[Update], **hyper) -> None:
    """``reference_adamw_`` on each of ``updates``; ``hyper``: ``triton_adamw_many_``'s keywords."""
    for u in updates:
        reference_adamw_(u.master, u.grad, u.exp_avg, u.exp_avg_sq, out=u.out, step=u.step, **hyper)


@torch.no_grad()
def triton_adamw_many_(updates: list[Update], *, lr: float, beta1: float, beta2: float, eps: float,
                       weight_decay: float, coef: torch.Tensor | None = None, chunk: int | None = None) -> None:
    """``triton_adamw_`` on every one of ``updates`` (one launch per kind: ``launches``); the hyperparameters and
    ``coef`` are shared; ``chunk``: elements per program (a multiple of ``BLOCK``)."""
    kern = _kernels()
    chunk = chunk or CHUNK
    assert chunk % BLOCK == 0, chunk
    if coef is not None and coef.dtype != torch.float32:
        coef = coef.float()
    for group in launches(updates):
        device = group[0].master.device
        for u in group:
            assert u.master.dtype == torch.float32 and u.master.is_contiguous(), (u.master.dtype, u.master.shape)
            for t in (u.grad, u.exp_avg, u.exp_avg_sq) + ((u.out,) if u.out is not None else ()):
                assert t.numel() == u.master.numel() and t.is_contiguous() and t.device == device, (t.shape, t.device)
        chunk_tensor, chunk_start, numels = _chunk_map(tuple(u.master.numel() for u in group), chunk, str(device))
        ptrs = torch.tensor([[u.master.data_ptr(), u.grad.data_ptr(), u.exp_avg.data_ptr(), u.exp_avg_sq.data_ptr(),
                              (u.out if u.out is not None else u.master).data_ptr()] for u in group],
                            dtype=torch.int64).to(device)
        u = group[0]
        kern._adamw_many_kernel[(chunk_tensor.numel(),)](
            ptrs, chunk_tensor, chunk_start, numels, coef if coef is not None else u.master, eps=eps,
            **_hyper(lr, beta1, beta2, weight_decay, u.step), G_DTYPE=_tl(u.grad.dtype), M_DTYPE=_tl(u.exp_avg.dtype),
            V_DTYPE=_tl(u.exp_avg_sq.dtype), O_DTYPE=_tl((u.out if u.out is not None else u.master).dtype),
            HAS_COEF=coef is not None, HAS_OUT=u.out is not None, BLOCK=BLOCK, CHUNK=chunk, num_warps=4)


@torch.no_grad()
def triton_sums_of_squares(tensors: list[torch.Tensor], slots: list[int], weights: list[float], k: int,
                           chunk: int | None = None) -> torch.Tensor:
    """``out[j] = Σ_{i: slots[i] = j} weights[i] · ‖tensors[i]‖²`` in FP64 (``k`` values on the tensors' device):
    the gradient norm's sums (``parallel.data_parallel.grad_sq``) in one launch per dtype and a weighted sum
    (deterministic: no atomics),
    where torch's ``_foreach_norm`` takes a launch per few tensors. An inf or nan makes its slot's sum
    non-finite, and only its slot's. ``tensors``: contiguous, on one device."""
    kern = _kernels()
    chunk = chunk or CHUNK
    assert chunk % BLOCK == 0, chunk
    device = tensors[0].device
    out = torch.zeros(k, dtype=torch.float64, device=device)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        assert t.is_contiguous() and t.device == device, (t.shape, t.device)
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        numels = tuple(tensors[i].numel() for i in idx)
        chunk_tensor, chunk_start, numels_d = _chunk_map(numels, chunk, str(device))
        in_slot, weight = _chunk_weights(numels, tuple(slots[i] for i in idx), tuple(weights[i] for i in idx), k,
                                         chunk, str(device))
        ptrs = torch.tensor([tensors[i].data_ptr() for i in idx], dtype=torch.int64).to(device)
        partial = torch.empty(chunk_tensor.numel(), dtype=torch.float64, device=device)
        kern._sum_squares_many_kernel[(chunk_tensor.numel(),)](ptrs, chunk_tensor, chunk_start, numels_d, partial,
                                                               DTYPE=_tl(dtype), BLOCK=BLOCK, CHUNK=chunk, num_warps=4)
        out += torch.where(in_slot, partial * weight, 0.0).sum(1)   # no atomics: the same bits every run
    return out


@functools.lru_cache(maxsize=32)
def _chunk_weights(numels: tuple[int, ...], slots: tuple[int, ...], weights: tuple[float, ...], k: int, chunk: int,
                   device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``triton_sums_of_squares``, on ``device``: whether each program's tensor is in each slot ([k, programs]:
    a ``where`` then a sum, so an inf in one slot is no NaN in another) and its weight."""
    counts = torch.tensor([-(-n // chunk) for n in numels])
    slot = torch.tensor(slots).repeat_interleave(counts)
    return ((slot == torch.arange(k).unsqueeze(1)).to(device),
            torch.tensor(weights, dtype=torch.float64).repeat_interleave(counts).to(device))


@functools.lru_cache(maxsize=32)
def _chunk_map(numels: tuple[int, ...], chunk: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The programs of ``_adamw_many_kernel`` for tensors of ``numels``: each one's tensor index and first
    element, and the numels, on ``device`` (the same parameter list every step: built once)."""
    counts = torch.tensor([-(-n // chunk) for n in numels])
    tensor = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), counts)
    first = torch.cumsum(counts, 0) - counts
    start = (torch.arange(len(tensor)) - first.repeat_interleave(counts)) * chunk
    return tensor.to(device), start.to(device), torch.tensor(numels, dtype=torch.int64).to(device)


def _tl(dtype: torch.dtype):
    """The Triton dtype of a torch one (Triton imported on first use, after ``configure()``)."""
    import triton.language as tl
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


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
    return _worst(errs + [_check_many(device)])


def _check_many(device: torch.device) -> float:
    """``self_check``'s measure for ``triton_adamw_many_`` vs ``reference_adamw_many_``: ragged tensors across
    chunk boundaries (two elements per program's loop), FP32 and BF16 moments in one call (two launches); and for
    ``triton_sums_of_squares`` vs FP64 sums in torch over the same BF16 and FP32 tensors."""
    g = torch.Generator().manual_seed(1)
    sizes = (1, BLOCK - 3, 5 * BLOCK + 77, 2 * BLOCK)
    runs = []
    for fn in (reference_adamw_many_, functools.partial(triton_adamw_many_, chunk=2 * BLOCK)):
        g.manual_seed(1)
        ups = [Update(torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device, torch.bfloat16),
                      torch.zeros(n, dtype=md, device=device), torch.zeros(n, dtype=md, device=device),
                      torch.empty(n, dtype=torch.bfloat16, device=device), 1)
               for n in sizes for md in (torch.float32, torch.bfloat16)]
        fn(ups, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, coef=torch.tensor(0.5, device=device))
        runs.append(ups)
    errs = []
    for want, got in zip(*runs):
        if selfcheck.mismatch(got.out, got.master.to(torch.bfloat16)):
            return float("nan")
        scale = 1.0 if got.exp_avg.dtype == torch.float32 else CHECK_TOL / BF16_MOMENT_TOL
        moments = ((got.exp_avg, want.exp_avg), (got.exp_avg_sq, want.exp_avg_sq))
        errs += [selfcheck.rel_err(got.master, want.master)] + [selfcheck.rel_err(a, b) * scale for a, b in moments]
    tensors = [u.grad for u in runs[0]] + [u.master for u in runs[0]]
    sums = triton_sums_of_squares(tensors, [i % 2 for i in range(len(tensors))], [1.0 + i for i in range(len(tensors))],
                                  2, chunk=2 * BLOCK)
    want = torch.zeros(2, dtype=torch.float64, device=device)
    for i, t in enumerate(tensors):
        want[i % 2] += (1.0 + i) * t.double().square().sum()
    return _worst(errs + [selfcheck.rel_err(sums, want)])


def _worst(errs: list[float]) -> float:
    """The largest error; NaN if any is (``max`` would pass over a NaN that is not first)."""
    return math.nan if any(math.isnan(e) for e in errs) else max(errs)


def _kernels():
    """The Triton kernel (imported on first use: ``configure()`` must run before triton decorates it)."""
    configure()
    from . import _adamw_kernels
    return _adamw_kernels
