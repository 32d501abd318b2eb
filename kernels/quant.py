"""Triton FP8 quantisation kernels (family: blockwise E4M3 quantisation).

Format: E4M3 (``torch.float8_e4m3fn``), saturating at ±448, round-to-nearest-even; per-tile FP32 scale
``s = max(amax, 2^-100) / 448`` (optionally rounded up to a power of two), ``q = e4m3(x / s)``, so
``x ≈ q * s``. Bit-identical to ``reference.py`` (tested under the interpreter).

Granularity and layout (T = 128):
- ``quant_act(x [M,K])``            1×T tiles along K (row-major in, row-major out), ``s [M, ⌈K/T⌉]``.
- ``quant_act_t(x [R,C], tpe)``     T×1 tiles (T rows of one column); output transposed (K-major for the
  Wgrad GEMM). Dense (``tpe=None``): ``qT [C,R]`` (rows 16-byte aligned: stride ``R`` rounded up to 16, so
  TMA can read it), ``sT [C, ⌈R/T⌉]``. Grouped: tiles restart at each expert's first row and ``qT`` is in
  tile space, ``[C, n·T]`` with tile t in columns ``[t·T, t·T+T)``, zero-padded; ``sT [C, n]``,
  ``n = ⌈R/T⌉+E-1`` (``reference.py``).
- ``quant_act_both(x [R,C], tpe)``  both of the above from one launch that reads ``x`` once (a T×T block per
  program: tile t's rows × one K-tile): ``(q, s, qT, sT)``, the FP8 linears' copies of an input whose Fprop
  (or Dgrad) and Wgrad both run.
- ``quant_weight(w [...,N,K])``     T×T blocks, ``s [...,⌈N/T⌉,⌈K/T⌉]``; optionally also ``q.mT`` contiguous
  (``transpose_fp8``: a T×T tile transpose of the bytes, self-checked on CUDA against torch's copy, which ran as
  a non-vectorised elementwise kernel on the H100: 13.1 ms for the 140 weights of a 12-layer step).
- ``cast_to_e4m3(x)``               the bare saturating RNE cast (tests the rounding exhaustively).

The FP32 -> E4M3 conversion (``_to_e4m3``) has two forms, chosen per launch (``HW``):
- compiled (GPU): clamp to ±448 and the hardware convert (``cvt.rn.satfinite.e4m3x2.f32``: round to nearest
  even, saturating, the sign kept, so a negative value that rounds to zero is -0 as in torch).
- interpreter: the interpreter's own downcast drops mantissa carries, rounds ties up and does not saturate,
  so the magnitude is first rounded onto the E4M3 grid in FP32 (magic-number add and subtract), making that
  downcast exact, and the sign is set as a bit. Compiled for Hopper (Triton 3.6) this form writes garbage
  bytes for values that round to zero, so it never runs there.
Divisions use ``div_rn`` (IEEE), as the reference's tensor divisions do on CUDA and CPU.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import interpreting
from .reference import AMAX_FLOOR, FP8_DTYPE, TILE, cdiv, tile_table

_FLOOR = tl.constexpr(AMAX_FLOOR)
_TILE = tl.constexpr(TILE)


@triton.jit
def _to_e4m3(x, HW: tl.constexpr):
    """Saturating RNE of FP32 ``x`` to E4M3 (module docstring). ``HW``: the hardware convert; otherwise the
    interpreter's form: the magnitude rounded onto the E4M3 grid in FP32 first, so the downcast of it is exact,
    and the sign put on as a bit (a value that rounds to zero keeps it: -0)."""
    if HW:
        return tl.minimum(tl.maximum(x, -448.0), 448.0).to(tl.float8e4nv)
    ax = tl.minimum(tl.abs(x), 448.0)
    e = tl.maximum(((ax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # subnormal step 2^-9
    magic = ((e + 147) << 23).to(tl.float32, bitcast=True)                    # grid step 2^(e-3), times 2^23
    r = (ax + magic) - magic                                                  # FP32 RNE onto the step
    mag = r.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    sign = ((x.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    return (mag | sign).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _amax(x, axis: tl.constexpr):
    # Not tl.max: triton.language's @jit helpers fail under the interpreter when triton was imported before
    # TRITON_INTERPRET was set. This is tl.max's combine function, which the interpreter maps onto numpy.
    return tl.reduce(tl.abs(x), axis, tl.standard._elementwise_max)


@triton.jit
def _scale_from_amax(amax, POW2: tl.constexpr):
    s = tl.math.div_rn(tl.maximum(amax, _FLOOR), 448.0)
    if POW2:
        bits = s.to(tl.int32, bitcast=True)
        exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        s = (exp << 23).to(tl.float32, bitcast=True)
    return s


@triton.jit
def _cast_kernel(x_ptr, q_ptr, n, BLOCK: tl.constexpr, HW: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(q_ptr + offs, _to_e4m3(x, HW), mask=offs < n)


@triton.jit
def _quant_act_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm,
                      BLOCK_M: tl.constexpr, POW2: tl.constexpr, HW: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.program_id(1) * _TILE + tl.arange(0, _TILE)
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    s = _scale_from_amax(_amax(x, 1), POW2)
    q = _to_e4m3(tl.math.div_rn(x, s[:, None]), HW)
    tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_k[None, :], q, mask=mask)
    tl.store(s_ptr + offs_m * stride_sm + tl.program_id(1), s, mask=offs_m < M)


@triton.jit
def _quant_act_t_kernel(x_ptr, q_ptr, s_ptr, row_start_ptr, row_end_ptr, C, Q_COLS, stride_xr, stride_qc, stride_sc,
                        BLOCK_C: tl.constexpr, POW2: tl.constexpr, HW: tl.constexpr, DENSE: tl.constexpr):
    # Tile t (rows [rs, re) of x) goes to columns [t·T, t·T + T) of qT: the tokens themselves when dense
    # (Q_COLS = R masks the last tile; the tile bounds follow from t, no tile table is read), the zero-padded
    # tile slot in tile space (Q_COLS = n·T, no mask; bounds from the table).
    t = tl.program_id(0)
    if DENSE:
        rs = t * _TILE
        re = Q_COLS
    else:
        rs = tl.load(row_start_ptr + t)
        re = tl.load(row_end_ptr + t)
    offs_r = rs + tl.arange(0, _TILE)
    cols = t * _TILE + tl.arange(0, _TILE)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_r[:, None] < re) & (offs_c[None, :] < C)
    x = tl.load(x_ptr + offs_r[:, None] * stride_xr + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
    s = _scale_from_amax(_amax(x, 0), POW2)                      # [BLOCK_C]
    q = _to_e4m3(tl.math.div_rn(x, s[None, :]), HW)
    tl.store(q_ptr + offs_c[None, :] * stride_qc + cols[:, None], q,
             mask=(cols[:, None] < Q_COLS) & (offs_c[None, :] < C))
    tl.store(s_ptr + offs_c * stride_sc + t, s, mask=offs_c < C)


@triton.jit
def _quant_act_both_kernel(x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, row_start_ptr, row_end_ptr, C, Q_COLS, stride_xr,
                           stride_qm, stride_sm, stride_qc, stride_sc, POW2: tl.constexpr, HW: tl.constexpr,
                           DENSE: tl.constexpr):
    # One T×T block of x (tile t's rows, as in _quant_act_t_kernel, × the K-tile program_id(1)) quantised both
    # ways: along the row (1×T, into q/s in token order) and along the column (T×1, into qT/sT). Every row of
    # x is in exactly one tile, so each row's 1×T tiles are quantised once.
    t, k = tl.program_id(0), tl.program_id(1)
    if DENSE:
        rs = t * _TILE
        re = Q_COLS
    else:
        rs = tl.load(row_start_ptr + t)
        re = tl.load(row_end_ptr + t)
    offs_r = rs + tl.arange(0, _TILE)
    cols = t * _TILE + tl.arange(0, _TILE)
    offs_c = k * _TILE + tl.arange(0, _TILE)
    rows_in, cols_in = offs_r < re, offs_c < C
    mask = rows_in[:, None] & cols_in[None, :]
    x = tl.load(x_ptr + offs_r[:, None] * stride_xr + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
    s = _scale_from_amax(_amax(x, 1), POW2)                      # [T] 1×T: one per row
    tl.store(q_ptr + offs_r[:, None] * stride_qm + offs_c[None, :], _to_e4m3(tl.math.div_rn(x, s[:, None]), HW),
             mask=mask)
    tl.store(s_ptr + offs_r * stride_sm + k, s, mask=rows_in)
    st = _scale_from_amax(_amax(x, 0), POW2)                     # [T] T×1: one per column
    tl.store(qt_ptr + offs_c[None, :] * stride_qc + cols[:, None], _to_e4m3(tl.math.div_rn(x, st[None, :]), HW),
             mask=(cols[:, None] < Q_COLS) & cols_in[None, :])
    tl.store(st_ptr + offs_c * stride_sc + t, st, mask=cols_in)


@triton.jit
def _quant_weight_kernel(w_ptr, q_ptr, s_ptr, N, K, stride_we, stride_wn, stride_qe, stride_qn, stride_se, stride_sn,
                         POW2: tl.constexpr, HW: tl.constexpr):
    pid_n, pid_k, e = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    offs_n = pid_n * _TILE + tl.arange(0, _TILE)
    offs_k = pid_k * _TILE + tl.arange(0, _TILE)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    w = tl.load(w_ptr + e * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0.0)
    w = w.to(tl.float32)
    s = _scale_from_amax(_amax(_amax(w, 1), 0), POW2)
    q = _to_e4m3(tl.math.div_rn(w, s), HW)
    tl.store(q_ptr + e * stride_qe + offs_n[:, None] * stride_qn + offs_k[None, :], q, mask=mask)
    tl.store(s_ptr + e * stride_se + pid_n * stride_sn + pid_k, s)


@triton.jit
def _transpose_kernel(q_ptr, t_ptr, N, K, stride_qe, stride_qn, stride_te, stride_tk):
    pid_n, pid_k, e = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    offs_n = pid_n * _TILE + tl.arange(0, _TILE)
    offs_k = pid_k * _TILE + tl.arange(0, _TILE)
    tile = tl.load(q_ptr + e * stride_qe + offs_n[:, None] * stride_qn + offs_k[None, :],
                   mask=(offs_n[:, None] < N) & (offs_k[None, :] < K))
    tl.store(t_ptr + e * stride_te + offs_k[:, None] * stride_tk + offs_n[None, :], tl.trans(tile),
             mask=(offs_k[:, None] < K) & (offs_n[None, :] < N))


# ----------------------------------------------------------------------------------------------- wrappers
def _check_input(x: torch.Tensor, dims: tuple[int, ...]) -> None:
    assert x.dim() in dims, f"expected {dims}-D input, got {tuple(x.shape)}"
    assert x.dtype in (torch.float32, torch.bfloat16, torch.float16), x.dtype
    assert x.stride(-1) == 1, f"last dim must be contiguous, strides {x.stride()}"


def _hw_cast() -> bool:
    """The hardware E4M3 convert when compiled; the interpreter's exact form under the interpreter."""
    return not interpreting()


def _rows_block(rows: int, cap: int) -> int:
    """Interpreter: as few programs as possible (~10-20 ms each); GPU: ``cap``."""
    return min(1024, triton.next_power_of_2(max(rows, 1))) if interpreting() else cap


def cast_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Saturating RNE cast of an FP32 tensor to E4M3 (no scaling)."""
    assert x.dtype == torch.float32 and x.is_contiguous()
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    block = 1 << 16 if interpreting() else 1024
    if x.numel():
        _cast_kernel[(cdiv(x.numel(), block),)](x, q, x.numel(), BLOCK=block, HW=_hw_cast())
    return q


def quant_act(x: torch.Tensor, pow2: bool = False, q: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M,K]`` (fp32/bf16/fp16, rows contiguous) -> ``q [M,K]`` e4m3, ``s [M,⌈K/128⌉]`` fp32 (into ``q``, an
    ``[M,K]`` view with contiguous rows, if given)."""
    _check_input(x, (2,))
    M, K = x.shape
    if q is None:
        q = torch.empty((M, K), dtype=FP8_DTYPE, device=x.device)
    assert q.shape == (M, K) and q.dtype == FP8_DTYPE and q.stride(1) == 1, (q.shape, q.dtype, q.stride())
    s = torch.empty((M, cdiv(K, TILE)), dtype=torch.float32, device=x.device)
    if M and K:
        block_m = _rows_block(M, 32)
        _quant_act_kernel[(cdiv(M, block_m), cdiv(K, TILE))](
            x, q, s, M, K, x.stride(0), q.stride(0), s.stride(0), BLOCK_M=block_m, POW2=pow2, HW=_hw_cast(),
            num_warps=4)
    return q, s


def _act_t_layout(x: torch.Tensor, tokens_per_expert: torch.Tensor | None):
    """The 128×1 copy's outputs ``(qT, sT)`` (unfilled), its tile table (``None`` when dense: the kernels derive
    the tiles from the program id), the number of tiles and ``qT``'s used width (``Q_COLS``)."""
    R, C = x.shape
    if tokens_per_expert is None:       # rows of qT 16-byte aligned (TMA's rule), whatever R is
        n, cols = cdiv(R, TILE), R
        q = torch.empty((C, -(-R // 16) * 16), dtype=FP8_DTYPE, device=x.device)[:, :R]
        table = None
    else:                               # the tile table (segment_tiles, memoised per counts tensor)
        tiles = tile_table(tokens_per_expert, R, TILE, x.device)
        table = (tiles["row_start"], tiles["row_end"])
        n = table[0].numel()
        cols = n * TILE
        q = torch.empty((C, cols), dtype=FP8_DTYPE, device=x.device)
    return q, torch.empty((C, n), dtype=torch.float32, device=x.device), table, n, cols


def quant_act_t(x: torch.Tensor, tokens_per_expert: torch.Tensor | None = None, pow2: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R,C]`` -> ``qT`` e4m3, ``sT`` fp32 in 128×1 tiles: ``qT [C,R]``, ``sT [C,⌈R/128⌉]`` without
    ``tokens_per_expert``; with it, tiles restart per expert and ``qT [C,n·128]`` is in tile space, ``sT [C,n]``."""
    _check_input(x, (2,))
    C = x.shape[1]
    q, s, table, n, cols = _act_t_layout(x, tokens_per_expert)
    if n and C:
        block_c = _rows_block(C, 64)
        _quant_act_t_kernel[(n, cdiv(C, block_c))](
            x, q, s, *(table or (s, s)), C, cols, x.stride(0), q.stride(0), s.stride(0), BLOCK_C=block_c, POW2=pow2,
            HW=_hw_cast(), DENSE=table is None, num_warps=4)
    return q, s


# A kernel that no GPU has shown faster is opt-in on CUDA ("1"; the GPU suite's kernel tests set it); elsewhere (the
# interpreter, meta tensors for the Hopper gate) it runs, so its tests cover it.
FUSED_ENV = "DSV3_FUSED_QUANT"        # quant_act_both: bit-exact on an H100; its FP8 step was slower (docs/fp8.md)
# The weights' transpose kernel is the default on CUDA (after its self-check): an H100's 12-layer FP8 step took
# 147 ms with it, 157-159 ms with torch's copy (docs/fp8.md). "0" runs torch's copy, the baseline.
TRANSPOSE_ENV = "DSV3_FP8_TRANSPOSE"


def _opt_in(env: str, device: torch.device | str) -> bool:
    return torch.device(device).type != "cuda" or os.environ.get(env) == "1"


def transpose_enabled(device: torch.device | str) -> bool:
    """Whether ``transpose_fp8`` may run ``_transpose_kernel`` on ``device`` (``TRANSPOSE_ENV``)."""
    return torch.device(device).type != "cuda" or os.environ.get(TRANSPOSE_ENV) != "0"


def fused_enabled(device: torch.device | str) -> bool:
    """Whether the op namespaces may run ``quant_act_both`` on ``device`` (``FUSED_ENV``)."""
    return _opt_in(FUSED_ENV, device)


def quant_act_both(x: torch.Tensor, tokens_per_expert: torch.Tensor | None = None, pow2: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(*quant_act(x), *quant_act_t(x, tokens_per_expert))`` bit for bit, in one launch that reads ``x`` once:
    ``q [R,C]``, ``s [R,⌈C/128⌉]``, ``qT``, ``sT`` (layouts of ``quant_act_t``). With ``tokens_per_expert`` its
    counts must sum to R (as the reference's): a row outside every expert's tiles is not quantised."""
    _check_input(x, (2,))
    R, C = x.shape
    q = torch.empty((R, C), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((R, cdiv(C, TILE)), dtype=torch.float32, device=x.device)
    qt, st, table, n, cols = _act_t_layout(x, tokens_per_expert)
    # 128×128 blocks: a row's 1×128 scale needs its K-tile's 128 columns. 16 warps: 94 registers a thread on
    # sm_90a (8 warps: 167, half the warps resident per SM), no spills (kernels/hopper_gate.py)
    if n and C:
        _quant_act_both_kernel[(n, cdiv(C, TILE))](
            x, q, s, qt, st, *(table or (s, s)), C, cols, x.stride(0), q.stride(0), s.stride(0), qt.stride(0),
            st.stride(0), POW2=pow2, HW=_hw_cast(), DENSE=table is None, num_warps=16)
    return q, s, qt, st


def quant_weight(w: torch.Tensor, pow2: bool = False, transpose: bool = False):
    """``w [...,N,K]`` (2-D or 3-D) -> ``q`` e4m3 same shape, ``s [...,⌈N/128⌉,⌈K/128⌉]`` fp32, and with
    ``transpose`` also ``q_t = q.mT`` contiguous (the K-major Dgrad operand; scales ``s.mT``). ``q_t`` is torch's
    copy of ``q``'s bytes (the kernel's own transposed store of a ragged 3-D weight is wrong on Hopper)."""
    _check_input(w, (2, 3))
    w3 = w if w.dim() == 3 else w.unsqueeze(0)
    E, N, K = w3.shape
    q = torch.empty((E, N, K), dtype=FP8_DTYPE, device=w.device)
    s = torch.empty((E, cdiv(N, TILE), cdiv(K, TILE)), dtype=torch.float32, device=w.device)
    if E and N and K:
        _quant_weight_kernel[(cdiv(N, TILE), cdiv(K, TILE), E)](
            w3, q, s, N, K, w3.stride(0), w3.stride(1), q.stride(0), q.stride(1), s.stride(0), s.stride(1),
            POW2=pow2, HW=_hw_cast(), num_warps=8)
    if w.dim() == 2:
        q, s = q[0], s[0]
    if not transpose:
        return q, s
    return q, s, transpose_fp8(q)


def transpose_fp8(q: torch.Tensor) -> torch.Tensor:
    """``q [...,N,K]`` (E4M3, 2-D or 3-D, contiguous) -> ``q.mT`` contiguous, by ``_transpose_kernel``; on CUDA
    unless ``TRANSPOSE_ENV`` is "0", and where it passed its self-check; else torch's copy."""
    q3 = (q if q.dim() == 3 else q.unsqueeze(0)).view(torch.uint8)
    assert q3.is_contiguous(), q.stride()
    t = torch.empty((q3.shape[0], q3.shape[2], q3.shape[1]), dtype=torch.uint8, device=q.device)
    if transpose_enabled(q.device) and (q.device.type != "cuda" or _transpose_verified(q.device)):
        _transpose(q3, t)
    else:
        t.copy_(q3.mT)
    t = t.view(FP8_DTYPE)
    return t if q.dim() == 3 else t[0]


def _transpose(q3: torch.Tensor, t: torch.Tensor) -> None:
    E, N, K = q3.shape
    if E and N and K:
        _transpose_kernel[(cdiv(N, TILE), cdiv(K, TILE), E)](q3, t, N, K, q3.stride(0), q3.stride(1), t.stride(0),
                                                             t.stride(1), num_warps=4)


def _transpose_verified(device: torch.device) -> bool:
    from . import selfcheck
    return selfcheck.verified("transpose_fp8", device, lambda: transpose_self_check(device), 0.0, "FP8 transpose",
                              "torch's copy")


def transpose_self_check(device: torch.device) -> float:
    """Fraction of bytes of ``_transpose_kernel``'s output that differ from torch's ``mT`` copy: a ragged 3-D
    weight (the case a transposed store in the quantiser got wrong on Hopper) and a 2-D one."""
    from .selfcheck import mismatch
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for shape in ((3, 200, 328), (1, 136, 264)):
        q3 = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).to(device)
        t = torch.empty((shape[0], shape[2], shape[1]), dtype=torch.uint8, device=device)
        _transpose(q3, t)
        worst = max(worst, mismatch(t, q3.mT.contiguous()))
    return worst


def quant_act_t_transposed(x: torch.Tensor, tokens_per_expert: torch.Tensor | None = None, pow2: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant_act_t`` as the reference computes it: the 128×1 tiles of ``x`` are the 1×128 tiles of ``xᵀ`` (in
    tile space with ``tokens_per_expert``), so torch writes that transposed copy and ``quant_act`` quantises it.
    Same outputs, bit for bit, with an extra pass over ``x``: the engine ``auto`` falls back to when the direct
    kernel fails its self-check on a device."""
    _check_input(x, (2,))
    R, C = x.shape
    if tokens_per_expert is None:
        cols = R
        xt = x.t()
    else:
        from .reference import act_t_columns, act_t_tiles
        cols = act_t_tiles(tokens_per_expert, R) * TILE
        xt = x.new_zeros(cols, C).index_copy_(0, act_t_columns(tokens_per_expert.to(x.device), R), x).t()
    width = -(-cols // 16) * 16                                  # rows of qT 16-byte aligned (TMA's rule)
    xt_c = torch.empty((C, width), dtype=x.dtype, device=x.device)[:, :cols].copy_(xt)
    q = torch.empty((C, width), dtype=FP8_DTYPE, device=x.device)[:, :cols]
    return quant_act(xt_c, pow2, q=q)


# ------------------------------------------------------------------------------------------------ self-check
def self_check_inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows spanning 1e-30..1e30 with an all-zero tile, E4M3 subnormals, ragged tiles and 16-divisible widths
    (``x [200, 320]``), and ragged expert counts summing to 200."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 320, generator=g) * torch.logspace(-30, 30, 200)[:, None]
    x[3, :128] = 0.0
    x[4, :128] = torch.randn(128, generator=g) * 1e-9
    x[4, 7] = 1.0
    return x.to(device), torch.tensor([0, 130, 5, 0, 64, 1], device=device)


def self_check(op: str, device: torch.device, fn=None) -> float:
    """Fraction of FP8 bytes and scales of ``op`` (``quant_act``, ``quant_act_t``, ``quant_act_both``,
    ``quant_weight``; ``fn``: the function to check, default this module's) that differ from ``reference.py``
    (0.0: bit-exact), both scale modes, on ``self_check_inputs``; the case that differs most is named in the
    raised error."""
    from . import reference as ref
    from .selfcheck import mismatch
    fn = fn or globals()[op]
    x, tpe = self_check_inputs(device)
    cases = {"quant_act": [("bf16", (x.bfloat16(),), {}), ("fp32 16-row-divisible", (x[:192],), {})],
             "quant_act_t": [("dense", (x, None), {}), ("experts", (x, tpe), {}),
                             ("dense, 300 rows", (torch.cat([x, x[:100]]), None), {})],
             "quant_act_both": [("dense", (x, None), {}), ("experts, bf16", (x.bfloat16(), tpe), {}),
                                ("dense, 300 rows", (torch.cat([x, x[:100]]), None), {})],
             "quant_weight": [("3-D, transposed copy", (x.view(2, 100, 320),), {"transpose": True}),
                              ("2-D", (x[:136],), {})]}[op]
    names = ("q", "s", "qT", "sT") if op == "quant_act_both" else ("q", "s", "q_t")
    worst, where = 0.0, ""
    for pow2 in (False, True):
        for label, args, kwargs in cases:
            got, want = fn(*args, pow2=pow2, **kwargs), getattr(ref, op)(*args, pow2=pow2, **kwargs)
            for name, g_, w_ in zip(names, got, want):
                m = mismatch(g_, w_)
                if m > worst:
                    worst, where = m, f"{op} {label}, pow2={pow2}: {name} {tuple(g_.shape)}"
    if worst:
        raise QuantMismatch(worst, where)
    return 0.0


class QuantMismatch(AssertionError):
    def __init__(self, fraction: float, where: str):
        super().__init__(f"{fraction:.2%} of the elements differ from the reference, worst at {where}")
        self.fraction = fraction
