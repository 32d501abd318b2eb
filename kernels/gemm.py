"""Triton blockwise-scaled FP8 GEMM (family: dense FP8 GEMM with FP32 promotion every 128 of K).

``c [M,N] = a [M,K] · b [N,K]ᵀ`` with E4M3 operands and FP32 per-tile scales (``x ≈ q * s``):
- ``a``: 1×128 tiles along K, ``sa [M, ⌈K/128⌉]``;
- ``b``: either 128×128 blocks, ``sb [⌈N/128⌉, ⌈K/128⌉]``, or 1×128 tiles per row, ``sb [N, ⌈K/128⌉]``.
BLOCK_K is the scaling tile (128): each K step computes ``dot(a_tile, b_tile)`` and promotes it into the
FP32 accumulator with both scales applied (``acc += dot · sa · sb``), so low-precision accumulation never
spans more than 128 products. Output FP32 or BF16.

Layouts: ``a``, ``b`` and the scales are logical views with arbitrary strides. The FP8 linear uses:
- Fprop ``y = x·Wᵀ``:   a = x (``quant_act``), b = W (``quant_weight``), 128×128 scales;
- Dgrad ``dx = dy·W``:  a = dy (``quant_act``), b = Wᵀ (``quant_weight(transpose=True)``), scales ``s.mT``;
- Wgrad ``dW = dyᵀ·x``: a = dyᵀ, b = xᵀ (both ``quant_act_t``: 128×1 tiles along tokens), per-row scales.
All three feed K-contiguous operands (Hopper's FP8 wgmma reads both operands K-major).

Two load paths, one kernel (constexpr ``TMA``), chosen per call by ``tma_ok``:
- TMA (``GPU_CONFIG``): when both operands are K-contiguous with 16-byte-aligned base and row strides (all
  production launches), the A/B tiles come in as bulk tensor copies from in-kernel tensor descriptors
  (zero fill past M, N, K: no masks) into a ``num_stages``-deep ring, two warp groups of 64 rows
  (``num_warps=8``). Device-side descriptors need a global scratch allocation: ``_set_scratch_allocator``
  registers a torch allocator before each launch.
- Pointers (``POINTER_CONFIG``): any other strides (transposed views, K not a multiple of 16). Masked
  loads; pipelined with cp.async when K-contiguous and 16-byte aligned, else plain loads.
Warp specialisation of the K loop (``tl.range(warp_specialize=True)``: a producer warp group issuing the TMA
copies, two consumer groups) is the opt-in variant ``tma+ws`` (``DSV3_WARP_SPECIALIZE=1``): Triton 3.6 compiles
it into a kernel that returns garbage on an H100. Without an explicit ``config``, ``gemm`` runs the first
variant of ``variant_chain`` that passed its self-check on the device (``selfcheck.py``).
Both paths run under the CPU interpreter (which checks the descriptor alignment rules like the GPU);
``kernels/hopper_gate.py`` compiles the production launches for sm_90a and checks what they became.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from . import interpreting, selfcheck, tuning
from .reference import FP8_DTYPE, TILE, b_group, cdiv

_TILE = tl.constexpr(TILE)
WS_ENV = "DSV3_WARP_SPECIALIZE"     # "1": try the warp-specialised TMA variant first (opt-in, self-checked)
# Launch variants (Hopper): the load path, warp specialisation, warps and pipeline depth; tiles in BASE.
BASE = {"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8}
VARIANTS = {
    "tma+ws": {"TMA": True, "WARP_SPECIALIZE": True, "num_warps": 4, "num_stages": 4},
    "tma": {"TMA": True, "WARP_SPECIALIZE": False, "num_warps": 8, "num_stages": 4},
    "pointers": {"TMA": False, "WARP_SPECIALIZE": False, "num_warps": 8, "num_stages": 4},
}
GPU_CONFIG = {**BASE, **VARIANTS["tma"]}
POINTER_CONFIG = {**BASE, **VARIANTS["pointers"]}

@triton.jit
def round_output(acc, c_ptr):
    """``acc`` in the dtype of ``*c_ptr``. For BF16, RNE onto the BF16 grid in integer ops first, so the
    final cast is exact (the interpreter's own FP32->BF16 cast drops mantissa carries). A NaN is kept as it is:
    its mantissa would carry into the sign (CUDA's NaN 0x7FFFFFFF became -0.0, hiding a diverged step)."""
    if c_ptr.dtype.element_ty == tl.bfloat16:
        bits = acc.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        acc = tl.where(acc != acc, acc, rounded)
    return acc.to(c_ptr.dtype.element_ty)


@triton.jit
def tile_order(pid, grid_m, grid_n, GROUP_M: tl.constexpr):
    """The output tile ``(pid_m, pid_n)`` of program ``pid`` in a ``grid_m × grid_n`` grid of tiles: ``GROUP_M``
    row tiles at a time run over every column tile, column by column, so that programs that run together share
    their A rows and B columns in L2."""
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    return first_m + (pid % width) % group_size, (pid % width) // group_size


@triton.jit
def _gemm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N, K,
                 stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
                 stride_sam, stride_sak, stride_sbn, stride_sbk,
                 SB_GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                 TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    pid_m, pid_n = tile_order(tl.program_id(0), (M + BLOCK_M - 1) // BLOCK_M, (N + BLOCK_N - 1) // BLOCK_N, GROUP_M)

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M      # wrap: loads stay in bounds, store masks
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, _TILE)
    sa_ptrs = sa_ptr + offs_m * stride_sam
    sb_ptrs = sb_ptr + (offs_n // SB_GROUP_N) * stride_sbn
    if TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, _TILE])
        b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [stride_bn, 1], [BLOCK_N, _TILE])
    else:
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for kt in tl.range(0, (K + _TILE - 1) // _TILE, warp_specialize=WARP_SPECIALIZE):
        if TMA:
            a = a_desc.load([pid_m * BLOCK_M, kt * _TILE])
            b = b_desc.load([pid_n * BLOCK_N, kt * _TILE]).T
        else:
            k_left = K - kt * _TILE
            a = tl.load(a_ptrs + kt * _TILE * stride_ak, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs + kt * _TILE * stride_bk, mask=offs_k[:, None] < k_left, other=0.0)
        sa = tl.load(sa_ptrs + kt * stride_sak)
        sb = tl.load(sb_ptrs + kt * stride_sbk)
        acc += tl.dot(a, b, out_dtype=tl.float32) * sa[:, None] * sb[None, :]   # FP32 promotion per 128 of K

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             round_output(acc, c_ptr), mask=mask)


def tma_ok(*operands: torch.Tensor) -> bool:
    """Whether TMA descriptors can address every operand: last dim contiguous, 16-byte-aligned base and
    strides (the hardware's rules; the interpreter checks them too)."""
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
               and all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1]) for t in operands)


def _scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _set_scratch_allocator(cfg: dict) -> None:
    """In-kernel tensor descriptors live in a global scratch buffer that Triton asks an allocator for at
    launch. Set per call: Triton keeps the allocator in a ContextVar, and autograd runs backward in
    another thread."""
    if cfg["TMA"] and not interpreting():
        triton.set_allocator(_scratch)


def pick_config(M: int, N: int, tma: bool, config: dict | None = None) -> dict:
    """Launch config: ``GPU_CONFIG`` when ``tma`` (the operands allow it) else ``POINTER_CONFIG``, updated by
    ``config`` (``{"TMA": False}`` forces the pointer path; TMA is never forced onto operands it can't read).
    The interpreter gets one or few big programs (~10-20 ms each)."""
    config = dict(config or {})
    tma = tma and config.pop("TMA", True)
    if interpreting():
        def block(n):
            return min(256, max(16, triton.next_power_of_2(n)))
        base = {"BLOCK_M": block(M), "BLOCK_N": block(N), "GROUP_M": 1, "num_warps": 4, "num_stages": 1,
                "WARP_SPECIALIZE": False}
    else:
        base = GPU_CONFIG if tma else POINTER_CONFIG
    return {**base, **config, "TMA": tma}


def variant_chain(tma: bool) -> list[tuple[str, dict]]:
    """The launch variants to try, best first: ``tma+ws`` (only with ``DSV3_WARP_SPECIALIZE=1``), ``tma``
    (only for operands TMA can read), ``pointers``."""
    names = (["tma+ws"] if tma and os.environ.get(WS_ENV) == "1" else []) + (["tma"] if tma else []) + ["pointers"]
    return [(n, VARIANTS[n]) for n in names]


def default_variant(kernel: str, tma: bool, device: torch.device, run) -> dict:
    """The first variant that passed ``run(variant, device)`` (``selfcheck``) on ``device``: the device's tuned
    config (``tuning.py``; TMA, no warp specialisation) when it has one and ``tma``, then ``variant_chain(tma)``.
    Meta tensors (the compile gate) take the first built-in variant, unchecked."""
    chain = variant_chain(tma)
    if device.type == "meta":
        return chain[0][1]
    best = tuning.tuned(kernel, device) if tma else None
    if best:
        tuned = {**VARIANTS["tma"], **best}
        chain = [("tuned " + ",".join(f"{k}={v}" for k, v in sorted(best.items())), tuned), *chain]
    return selfcheck.first_verified(kernel, chain, device, functools.partial(run, device=device))[1]


def _rand(*shape, seed: int, device) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def self_check(variant: dict, device: torch.device) -> float:
    """Worst relative error of ``variant`` vs the reference on two small TMA-readable problems: Fprop-like
    (128×128 weight scales, BF16 out, ragged M, N, K) and Wgrad-like (per-row scales, FP32 out)."""
    from . import reference as ref
    a, sa = ref.quant_act(_rand(200, 464, seed=1, device=device))
    b, sb = ref.quant_weight(_rand(272, 464, seed=2, device=device))
    errs = [selfcheck.rel_err(gemm(a, sa, b, sb, torch.bfloat16, config=variant), ref.gemm(a, sa, b, sb))]
    (a, sa), (b, sb) = (ref.quant_act_t(_rand(208, n, seed=n, device=device)) for n in (200, 272))
    errs.append(selfcheck.rel_err(gemm(a, sa, b, sb, torch.float32, config=variant),
                                  ref.gemm(a, sa, b, sb, torch.float32)))
    return selfcheck.worst(errs)


def check_operands(a, sa, b, sb, out_dtype) -> None:
    assert a.dtype == b.dtype == FP8_DTYPE, (a.dtype, b.dtype)
    assert sa.dtype == sb.dtype == torch.float32, (sa.dtype, sb.dtype)
    assert out_dtype in (torch.float32, torch.bfloat16), out_dtype
    assert a.device == b.device == sa.device == sb.device, (a.device, b.device, sa.device, sb.device)


def gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
         out_dtype: torch.dtype = torch.bfloat16, config: dict | None = None) -> torch.Tensor:
    """``a [M,K] · b [N,K]ᵀ`` -> ``[M,N]`` in ``out_dtype``; see the module docstring for scales/layouts.
    ``config``: an explicit launch config (runs as given); None: the self-checked default variant."""
    check_operands(a, sa, b, sb, out_dtype)
    assert a.dim() == b.dim() == 2 and a.shape[1] == b.shape[1], (a.shape, b.shape)
    M, K = a.shape
    N = b.shape[0]
    assert sa.shape == (M, cdiv(K, TILE)), f"sa {tuple(sa.shape)} must be [M, ceil(K/128)] = [{M}, {cdiv(K, TILE)}]"
    group = b_group(b, sb)
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0 or K == 0:
        return c.zero_()
    tma = tma_ok(a, b)
    if config is None:
        config = default_variant("gemm", tma, a.device, self_check)
    cfg = pick_config(M, N, tma, config)
    _set_scratch_allocator(cfg)
    grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]),)
    _gemm_kernel[grid](a, b, c, sa, sb, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                       c.stride(0), c.stride(1), sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1),
                       SB_GROUP_N=group, **cfg)
    return c
