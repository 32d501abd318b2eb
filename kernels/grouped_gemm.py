"""Triton grouped FP8 GEMMs for routed experts (family: grouped blockwise FP8 GEMM, contiguous layout).

Tokens arrive sorted by expert: rows ``[off_e, off_{e+1})`` of the activation belong to expert e
(``tokens_per_expert [E]``, empty experts allowed, no padding). E4M3 operands, FP32 scales, FP32
promotion every 128 of K exactly as in ``gemm.py``, with the same two load paths (constexpr ``TMA``:
in-kernel tensor descriptors when ``tma_ok``, masked pointer loads otherwise) and the same launch variants
(``gemm.VARIANTS``; the default is the first that passed its self-check on the device).

- ``grouped_gemm(a [R,K], sa [R,⌈K/128⌉], b [E,N,K], sb [E,⌈N/128⌉,⌈K/128⌉], tpe)`` -> ``[R,N]``:
  Fprop (b = W_e) and Dgrad (b = W_eᵀ, from ``quant_weight(transpose=True)``; scales ``s.mT``). Activations
  1×128, weights 128×128. Row tiles of BLOCK_M restart at each expert's first row, so a program never
  mixes experts; ``⌈R/BLOCK_M⌉ + E - 1`` row tiles are launched (an upper bound, no host sync) and
  the unused ones skip the K loop and store nothing. A BLOCK_M that divides 128 reads the 128-row tile table that
  the layer's 128×1 quantiser made (``reference.table_block``): each of its tiles is ``128 / BLOCK_M`` row tiles,
  and one table per layer is built instead of two (opt-in, ``reference.SHARED_TILES_ENV``). Program order with
  ``GROUP_M`` > 0: ``gemm.tile_order`` over (row tile, column tile), ``GROUP_M`` row tiles at a time (each
  expert's tiles are consecutive, so a group mostly shares one expert's weight columns in L2, and its A rows are
  read once instead of once per column tile); ``GROUP_M`` 0
  (the built-in) runs every row tile of a column tile before the next column tile. With TMA a tile's A box may
  run past its expert into the next one's rows: those output rows are never stored (rows are independent in
  Fprop/Dgrad).
- ``grouped_wgrad(aT [N,n·128], sa [N,n], bT [K,n·128], sb [K,n], tpe)`` -> ``[E,N,K]`` FP32: per expert,
  ``dW_e = dy_eᵀ·x_e`` contracting over the expert's own tokens, with both operands from
  ``quant_act_t(·, tpe)``: 128×1 tiles that restart at each expert, in *tile space* (tile t in columns
  ``[128t, 128t+128)``, zero-padded). Expert e's K loop runs over its tiles ``[tile_start_e, tile_end_e)``:
  every load is a whole, 128-byte-aligned, unmasked tile, so Triton can pipeline it (with cp.async or
  TMA). Experts without tokens get zeros.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import WGRAD_BF16_ENV, selfcheck
from .gemm import (_rand, _set_scratch_allocator, check_operands, default_variant, pick_config, round_output,
                   tile_order, tma_ok)
from .reference import TILE, b_group, cdiv, expert_tile_bounds, table_block, tile_table

_TILE = tl.constexpr(TILE)


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, row_start_ptr, row_end_ptr, expert_ptr, R, N, K,
                         row_tiles, stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                         stride_sam, stride_sak, stride_sbe, stride_sbn, stride_sbk,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, SUB: tl.constexpr,
                         TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    # Row tile t is part t % SUB of the table's tile t // SUB (SUB = table rows / BLOCK_M). GROUP_M 0: the grid's
    # two dimensions (row tiles fastest), else a 1-D grid in gemm.tile_order.
    if GROUP_M == 0:
        t = tl.program_id(0)
        pid_n = tl.program_id(1)
    else:
        t, pid_n = tile_order(tl.program_id(0), row_tiles, (N + BLOCK_N - 1) // BLOCK_N, GROUP_M)
    rs = tl.load(row_start_ptr + t // SUB) + (t % SUB) * BLOCK_M
    re = tl.load(row_end_ptr + t // SUB)
    # Unused tiles (rs == re) run no K steps and store nothing. Not an early `return`: a branch out of the
    # kernel breaks Triton's Hopper warp specialisation (task-id propagation asserts on it).
    k_tiles = tl.where(rs < re, (K + _TILE - 1) // _TILE, 0)
    e = tl.load(expert_ptr + t // SUB).to(tl.int64)
    offs_m = rs + tl.arange(0, BLOCK_M)
    rows = tl.minimum(offs_m, re - 1)                              # clamp: loads in bounds, store masks
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, _TILE)
    sa_ptrs = sa_ptr + rows * stride_sam
    sb_ptrs = sb_ptr + e * stride_sbe + (offs_n // _TILE) * stride_sbn
    if TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, [R, K], [stride_am, 1], [BLOCK_M, _TILE])
        b_desc = tl.make_tensor_descriptor(b_ptr + e * stride_be, [N, K], [stride_bn, 1], [BLOCK_N, _TILE])
    else:
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + e * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for kt in tl.range(0, k_tiles, warp_specialize=WARP_SPECIALIZE):
        if TMA:
            a = a_desc.load([rs, kt * _TILE])
            b = b_desc.load([pid_n * BLOCK_N, kt * _TILE]).T
        else:
            k_left = K - kt * _TILE
            a = tl.load(a_ptrs + kt * _TILE * stride_ak, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs + kt * _TILE * stride_bk, mask=offs_k[:, None] < k_left, other=0.0)
        sa = tl.load(sa_ptrs + kt * stride_sak)
        sb = tl.load(sb_ptrs + kt * stride_sbk)
        acc += tl.dot(a, b, out_dtype=tl.float32) * sa[:, None] * sb[None, :]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < re) & (offs_n[None, :] < N)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, round_output(acc, c_ptr), mask=mask)


@triton.jit
def _grouped_wgrad_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, tile_start_ptr, tile_end_ptr, N, K, COLS,
                          stride_an, stride_ar, stride_bk, stride_br, stride_ce, stride_cn, stride_ck,
                          stride_san, stride_sat, stride_sbk, stride_sbt,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
                          WARP_SPECIALIZE: tl.constexpr):
    grid_n = (K + BLOCK_N - 1) // BLOCK_N
    pid_m, pid_n = tl.program_id(0) // grid_n, tl.program_id(0) % grid_n
    e = tl.program_id(1)
    ts = tl.load(tile_start_ptr + e)                               # the expert's token tiles [ts, te)
    te = tl.load(tile_end_ptr + e)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % N        # rows of dW (out features)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % K        # cols of dW (in features)
    offs_r = tl.arange(0, _TILE)                                   # tokens of one tile: the contraction dim
    if TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, [N, COLS], [stride_an, 1], [BLOCK_M, _TILE])
        b_desc = tl.make_tensor_descriptor(b_ptr, [K, COLS], [stride_bk, 1], [BLOCK_N, _TILE])
    else:
        a_ptrs = a_ptr + offs_m[:, None] * stride_an + offs_r[None, :] * stride_ar
        b_ptrs = b_ptr + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bk
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for j in tl.range(ts, te, warp_specialize=WARP_SPECIALIZE):
        if TMA:
            a = a_desc.load([pid_m * BLOCK_M, j * _TILE])
            b = b_desc.load([pid_n * BLOCK_N, j * _TILE]).T
        else:
            a = tl.load(a_ptrs + j * _TILE * stride_ar)
            b = tl.load(b_ptrs + j * _TILE * stride_br)
        sa = tl.load(sa_ptr + offs_m * stride_san + j * stride_sat)
        sb = tl.load(sb_ptr + offs_n * stride_sbk + j * stride_sbt)
        acc += tl.dot(a, b, out_dtype=tl.float32) * sa[:, None] * sb[None, :]
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < N) & (offs_n[None, :] < K)
    tl.store(c_ptr + e.to(tl.int64) * stride_ce + offs_m[:, None] * stride_cn + offs_n[None, :] * stride_ck,
             round_output(acc, c_ptr), mask=mask)


def _config(rows: int, cols: int, tma: bool, config: dict | None, grouped_order: bool) -> dict:
    """``gemm.pick_config`` with ``GROUP_M`` as ``config`` says, 0 (every row tile of a column tile first) if it
    says nothing, when ``grouped_order``; without it otherwise. The interpreter gets 128-row tiles (one expert
    tile each)."""
    cfg = pick_config(rows, cols, tma, config)
    cfg.pop("GROUP_M")
    if grouped_order:
        cfg["GROUP_M"] = (config or {}).get("GROUP_M", 0)
    return cfg


def grouped_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                 tokens_per_expert: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                 config: dict | None = None) -> torch.Tensor:
    """Rows of expert e of ``a [R,K]`` times ``b[e]ᵀ`` (``b [E,N,K]``) -> ``[R,N]``.
    ``tokens_per_expert`` must sum to R (not checked: that would sync the host)."""
    check_operands(a, sa, b, sb, out_dtype)
    assert a.dim() == 2 and b.dim() == 3 and a.shape[1] == b.shape[2], (a.shape, b.shape)
    R, K = a.shape
    E, N = b.shape[:2]
    assert tokens_per_expert.shape == (E,), (tokens_per_expert.shape, E)
    assert sa.shape == (R, cdiv(K, TILE)), (sa.shape, a.shape)
    assert sb.dim() == 3 and sb.shape[0] == E and b_group(b, sb) == TILE, (sb.shape, b.shape)
    c = torch.empty((R, N), dtype=out_dtype, device=a.device)
    if R == 0 or N == 0 or K == 0:
        return c.zero_()
    tma = tma_ok(a, b)
    if config is None:
        config = default_variant("grouped_gemm", tma, a.device, self_check_gemm)
    cfg = _config(TILE, N, tma, config, grouped_order=True)
    _set_scratch_allocator(cfg)
    block = table_block(cfg["BLOCK_M"])
    tiles = tile_table(tokens_per_expert, R, block, a.device)
    sub = block // cfg["BLOCK_M"]
    row_tiles = tiles["row_start"].numel() * sub
    grid = (row_tiles, cdiv(N, cfg["BLOCK_N"])) if cfg["GROUP_M"] == 0 else (row_tiles * cdiv(N, cfg["BLOCK_N"]),)
    _grouped_gemm_kernel[grid](
        a, b, c, sa, sb, tiles["row_start"], tiles["row_end"], tiles["expert"], R, N, K, row_tiles,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1), sb.stride(2), SUB=sub, **cfg)
    return c


def grouped_wgrad(aT: torch.Tensor, sa: torch.Tensor, bT: torch.Tensor, sb: torch.Tensor,
                  tokens_per_expert: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                  config: dict | None = None) -> torch.Tensor:
    """``out[e] = Σ_{tiles t of e} aT_t · bT_tᵀ`` -> ``[E,N,K]``; ``aT [N,n·128]``, ``bT [K,n·128]`` in the
    tile space of ``quant_act_t(·, tokens_per_expert)``, ``sa [N,n]``, ``sb [K,n]``."""
    check_operands(aT, sa, bT, sb, out_dtype)
    assert aT.dim() == bT.dim() == 2 and aT.shape[1] == bT.shape[1], (aT.shape, bT.shape)
    (N, cols), K = aT.shape, bT.shape[0]
    E = tokens_per_expert.numel()
    assert tokens_per_expert.shape == (E,) and E >= 1, tokens_per_expert.shape
    n_tiles = cols // TILE
    assert cols == n_tiles * TILE, f"aT has {cols} columns: not tile space (a multiple of {TILE})"
    assert sa.shape == (N, n_tiles) and sb.shape == (K, n_tiles), (sa.shape, sb.shape, n_tiles)
    c = torch.empty((E, N, K), dtype=out_dtype, device=aT.device)
    if cols == 0 or N == 0 or K == 0:
        return c.zero_()
    tma = tma_ok(aT, bT)
    if config is None:
        config = default_variant("grouped_wgrad", tma, aT.device, self_check_wgrad)
    cfg = _config(N, K, tma, config, grouped_order=False)
    _set_scratch_allocator(cfg)
    tile_start, tile_end = expert_tile_bounds(tokens_per_expert, aT.device)
    grid = (cdiv(N, cfg["BLOCK_M"]) * cdiv(K, cfg["BLOCK_N"]), E)
    _grouped_wgrad_kernel[grid](
        aT, bT, c, sa, sb, tile_start, tile_end, N, K, cols,
        aT.stride(0), aT.stride(1), bT.stride(0), bT.stride(1), c.stride(0), c.stride(1), c.stride(2),
        sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1), **cfg)
    return c


# ----------------------------------------------------------------------------------------------- self-checks
CHECK_COUNTS = (0, 150, 61, 3)      # an empty expert, one over a tile, a ragged one, a tiny one


def self_check_gemm(variant: dict, device: torch.device) -> float:
    """Relative error of ``grouped_gemm`` with ``variant`` vs the reference on a small ragged problem."""
    from . import reference as ref
    tpe = torch.tensor(CHECK_COUNTS, device=device)
    a, sa = ref.quant_act(_rand(sum(CHECK_COUNTS), 464, seed=3, device=device))
    b, sb = ref.quant_weight(_rand(len(CHECK_COUNTS), 272, 464, seed=4, device=device))
    return selfcheck.rel_err(grouped_gemm(a, sa, b, sb, tpe, torch.bfloat16, config=variant),
                             ref.grouped_gemm(a, sa, b, sb, tpe))


def self_check_wgrad(variant: dict, device: torch.device) -> float:
    """Worst relative error of ``grouped_wgrad`` with ``variant`` vs the reference on a small ragged problem, FP32
    out, and BF16 out too where that opt-in is on (``kernels.WGRAD_BF16_ENV``)."""
    from . import reference as ref
    tpe = torch.tensor(CHECK_COUNTS, device=device)
    (a, sa), (b, sb) = (ref.quant_act_t(_rand(sum(CHECK_COUNTS), n, seed=n, device=device), tpe) for n in (200, 272))
    dtypes = (torch.float32, torch.bfloat16) if os.environ.get(WGRAD_BF16_ENV) == "1" else (torch.float32,)
    return selfcheck.worst([selfcheck.rel_err(grouped_wgrad(a, sa, b, sb, tpe, dtype, config=variant),
                                              ref.grouped_wgrad(a, sa, b, sb, tpe, dtype)) for dtype in dtypes])
