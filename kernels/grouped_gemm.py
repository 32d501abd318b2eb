"""Triton grouped FP8 GEMMs for routed experts (family: grouped blockwise FP8 GEMM, contiguous layout).

Tokens arrive sorted by expert: rows ``[off_e, off_{e+1})`` of the activation belong to expert e
(``tokens_per_expert [E]``, empty experts allowed, no padding). E4M3 operands, FP32 scales, FP32
promotion every 128 of K exactly as in ``gemm.py``.

- ``grouped_gemm(a [R,K], sa [R,⌈K/128⌉], b [E,N,K], sb [E,⌈N/128⌉,⌈K/128⌉], tpe)`` -> ``[R,N]``:
  Fprop (b = W_e) and Dgrad (b = W_eᵀ, from ``quant_weight(transpose=True)``; scales ``s.mT``). Activations
  1×128, weights 128×128. Row tiles of BLOCK_M restart at each expert's first row, so a program never
  mixes experts; ``⌈R/BLOCK_M⌉ + E - 1`` row tiles are launched (an upper bound, no host sync) and
  the unused ones exit at once.
- ``grouped_wgrad(aT [N,R], sa [N,nt], bT [K,R], sb [K,nt], tpe)`` -> ``[E,N,K]`` FP32: per expert,
  ``dW_e = dy_eᵀ·x_e`` contracting over the expert's own tokens, with both operands from
  ``quant_act_t`` (128×1 tiles along tokens that restart at each expert, transposed so tokens are
  contiguous). Experts without tokens get zeros.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting
from .gemm import GPU_CONFIG, check_operands, round_output
from .reference import TILE, _b_group, cdiv, segment_tiles, segments

_TILE = tl.constexpr(TILE)


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, row_start_ptr, row_end_ptr, expert_ptr, N, K,
                         stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                         stride_sam, stride_sak, stride_sbe, stride_sbn, stride_sbk,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    rs = tl.load(row_start_ptr + t)
    re = tl.load(row_end_ptr + t)
    if rs >= re:
        return
    e = tl.load(expert_ptr + t).to(tl.int64)
    offs_m = rs + tl.arange(0, BLOCK_M)
    rows = tl.minimum(offs_m, re - 1)                              # clamp: loads in bounds, store masks
    offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, _TILE)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + e * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    sa_ptrs = sa_ptr + rows * stride_sam
    sb_ptrs = sb_ptr + e * stride_sbe + (offs_n // _TILE) * stride_sbn
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for kt in range(0, (K + _TILE - 1) // _TILE):
        k_left = K - kt * _TILE
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        sa = tl.load(sa_ptrs + kt * stride_sak)
        sb = tl.load(sb_ptrs + kt * stride_sbk)
        acc += tl.dot(a, b, out_dtype=tl.float32) * sa[:, None] * sb[None, :]
        a_ptrs += _TILE * stride_ak
        b_ptrs += _TILE * stride_bk
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < re) & (offs_n[None, :] < N)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, round_output(acc, c_ptr), mask=mask)


@triton.jit
def _grouped_wgrad_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, seg_start_ptr, seg_end_ptr, tile_start_ptr, N, K,
                          stride_an, stride_ar, stride_bk, stride_br, stride_ce, stride_cn, stride_ck,
                          stride_san, stride_sat, stride_sbk, stride_sbt,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    grid_n = (K + BLOCK_N - 1) // BLOCK_N
    pid_m, pid_n = tl.program_id(0) // grid_n, tl.program_id(0) % grid_n
    e = tl.program_id(1).to(tl.int64)
    rs = tl.load(seg_start_ptr + e)
    re = tl.load(seg_end_ptr + e)
    ts = tl.load(tile_start_ptr + e)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % N        # rows of dW (out features)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % K        # cols of dW (in features)
    offs_r = tl.arange(0, _TILE)                                   # tokens: the contraction dim
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for j in range(0, (re - rs + _TILE - 1) // _TILE):
        r = rs + j * _TILE + offs_r
        a = tl.load(a_ptr + offs_m[:, None] * stride_an + r[None, :] * stride_ar, mask=r[None, :] < re, other=0.0)
        b = tl.load(b_ptr + r[:, None] * stride_br + offs_n[None, :] * stride_bk, mask=r[:, None] < re, other=0.0)
        sa = tl.load(sa_ptr + offs_m * stride_san + (ts + j) * stride_sat)
        sb = tl.load(sb_ptr + offs_n * stride_sbk + (ts + j) * stride_sbt)
        acc += tl.dot(a, b, out_dtype=tl.float32) * sa[:, None] * sb[None, :]
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < N) & (offs_n[None, :] < K)
    tl.store(c_ptr + e * stride_ce + offs_m[:, None] * stride_cn + offs_n[None, :] * stride_ck,
             round_output(acc, c_ptr), mask=mask)


def _config(n: int, config: dict | None) -> dict:
    if config is not None:
        return {**GPU_CONFIG, **config}
    if interpreting():
        return {"BLOCK_M": 128, "BLOCK_N": min(256, max(16, triton.next_power_of_2(n))), "num_warps": 4,
                "num_stages": 1}
    return {k: v for k, v in GPU_CONFIG.items() if k != "GROUP_M"}


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
    assert sb.dim() == 3 and sb.shape[0] == E and _b_group(b, sb) == TILE, (sb.shape, b.shape)
    c = torch.empty((R, N), dtype=out_dtype, device=a.device)
    if R == 0 or N == 0 or K == 0:
        return c.zero_()
    cfg = {k: v for k, v in _config(N, config).items() if k != "GROUP_M"}
    tiles = segment_tiles(segments(tokens_per_expert, R, a.device), R, cfg["BLOCK_M"])
    grid = (tiles["row_start"].numel(), cdiv(N, cfg["BLOCK_N"]))
    _grouped_gemm_kernel[grid](
        a, b, c, sa, sb, tiles["row_start"], tiles["row_end"], tiles["expert"], N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1), sb.stride(2), **cfg)
    return c


def grouped_wgrad(aT: torch.Tensor, sa: torch.Tensor, bT: torch.Tensor, sb: torch.Tensor,
                  tokens_per_expert: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                  config: dict | None = None) -> torch.Tensor:
    """``out[e] = aT[:, seg_e] · bT[:, seg_e]ᵀ`` -> ``[E,N,K]``; ``aT [N,R]``, ``bT [K,R]`` from ``quant_act_t``."""
    check_operands(aT, sa, bT, sb, out_dtype)
    assert aT.dim() == bT.dim() == 2 and aT.shape[1] == bT.shape[1], (aT.shape, bT.shape)
    (N, R), K = aT.shape, bT.shape[0]
    E = tokens_per_expert.numel()
    assert tokens_per_expert.shape == (E,) and E >= 1, tokens_per_expert.shape
    n_tiles = max(cdiv(R, TILE) + E - 1, 0)
    assert sa.shape == (N, n_tiles) and sb.shape == (K, n_tiles), (sa.shape, sb.shape, n_tiles)
    c = torch.empty((E, N, K), dtype=out_dtype, device=aT.device)
    if R == 0 or N == 0 or K == 0:
        return c.zero_()
    cfg = {k: v for k, v in _config(K, config).items() if k != "GROUP_M"}
    if interpreting():
        cfg["BLOCK_M"] = min(256, max(16, triton.next_power_of_2(N)))
    tiles = segment_tiles(segments(tokens_per_expert, R, aT.device), R, TILE)
    grid = (cdiv(N, cfg["BLOCK_M"]) * cdiv(K, cfg["BLOCK_N"]), E)
    _grouped_wgrad_kernel[grid](
        aT, bT, c, sa, sb, tiles["seg_start"], tiles["seg_end"], tiles["tile_start"], N, K,
        aT.stride(0), aT.stride(1), bT.stride(0), bT.stride(1), c.stride(0), c.stride(1), c.stride(2),
        sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1), **cfg)
    return c
