"""Plain-torch FP8 reference — the ``emulation`` backend and the oracle the Triton kernels are tested against.

Format: E4M3 (``torch.float8_e4m3fn``, max 448), saturating, round-to-nearest-even. A quantised tensor is
``(q, s)`` with ``x ≈ q.float() * s`` per tile; ``s = max(amax, 2^-100) / 448`` in FP32 (or that value
rounded *up* to a power of two with ``pow2=True``) and ``q = e4m3(clamp(x / s, ±448))`` — the same FP32
operations, in the same order, as the kernels, so FP8 bytes and scales are bit-identical.

Scaling granularity (T = 128 elements):
- ``quant_act``    activations / activation gradients, 1×T tiles along the last dim: ``x [M,K]`` ->
  ``q [M,K]``, ``s [M, ⌈K/T⌉]``.
- ``quant_act_t``  the same values tiled T×1 (T tokens × 1 channel) for Wgrad, written transposed so the
  contraction dim (tokens) is contiguous: ``x [R,C]`` -> ``qT [C,R]``, ``sT [C, n_tiles]``. With
  ``tokens_per_expert`` the tiles restart at every expert's first row (a tile never spans two experts),
  ``n_tiles = ⌈R/T⌉ + E - 1`` (an upper bound, unused tiles get the all-zero scale), and ``qT`` is in
  *tile space*: ``[C, n_tiles·T]``, tile t in columns ``[t·T, t·T + T)``, zero past its expert's last token
  (``act_t_columns`` maps tokens to columns). Every tile then starts 128-byte aligned, so the grouped Wgrad
  loads whole tiles (TMA boxes) with no masks.
- ``quant_act_both`` both of the above of one tensor: ``(q, s, qT, sT)``.
- ``quant_weight`` weights, T×T blocks over the last two dims: ``w [...,N,K]`` -> ``q``, ``s [...,⌈N/T⌉,⌈K/T⌉]``.

GEMMs (FP32 accumulation; output BF16/FP32), operands are logical views, any strides:
- ``gemm(a [M,K], sa [M,⌈K/T⌉], b [N,K], sb, out_dtype) = a·bᵀ`` with ``sb`` either T×T blocks
  ``[⌈N/T⌉,⌈K/T⌉]`` (Fprop: b = W; Dgrad: b = Wᵀ) or per-row ``[N,⌈K/T⌉]`` (Wgrad: b = xᵀ from ``quant_act_t``).
- ``grouped_gemm(a [R,K], sa, b [E,N,K], sb [E,⌈N/T⌉,⌈K/T⌉], tokens_per_expert, out_dtype)``: rows of
  expert e (rows sorted by expert) times ``b[e]ᵀ`` (routed-expert Fprop and Dgrad).
- ``grouped_wgrad(aT [N,n_tiles·T], sa [N,n_tiles], bT [K,n_tiles·T], sb [K,n_tiles], tokens_per_expert)
  -> [E,N,K]``: per expert, the sum over its tiles of ``aT_tile · bT_tileᵀ`` with the T×1 scales, operands in
  the tile space of ``quant_act_t(x, tokens_per_expert)``.
"""
from __future__ import annotations

import os
from collections import OrderedDict

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
TILE = 128
AMAX_FLOOR = 2.0 ** -100   # all-zero tiles get s = 2^-100/448: never 0/NaN, and every scale is a normal FP32


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------- format
def ceil_pow2(s: torch.Tensor) -> torch.Tensor:
    """Round positive normal FP32 values up to a power of two (exact, by exponent bits)."""
    bits = s.float().contiguous().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


def scale_from_amax(amax: torch.Tensor, pow2: bool = False) -> torch.Tensor:
    # Divide by a tensor, not by the Python number: CUDA's ``tensor / scalar`` multiplies by the rounded
    # reciprocal (1/448), which is one ulp off the IEEE quotient the kernels compute for some amax.
    amax = amax.float().clamp_min(AMAX_FLOOR)
    s = amax / torch.full_like(amax, FP8_MAX)
    return ceil_pow2(s) if pow2 else s


def cast_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Saturating round-to-nearest-even cast of FP32 values to E4M3."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _to_e4m3_(x: torch.Tensor) -> torch.Tensor:
    """``cast_to_e4m3`` of an FP32 temporary, clamped in place."""
    return x.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _blocked(x: torch.Tensor, group_rows: int) -> torch.Tensor:
    """View the last two dims ``[R, C]`` as tiles ``[⌈R/g⌉, g, ⌈C/128⌉, 128]``, zero-padded only if needed: a
    dim shorter than its tile is one tile of its own length (``[1, R, ...]``, ``[..., 1, C]``), since padding
    adds only zeros, which change neither a tile's amax nor its other elements."""
    R, C = x.shape[-2:]
    rows = R if 0 < R < group_rows else group_rows
    cols = C if 0 < C < TILE else TILE
    pad_r, pad_c = -R % rows, -C % cols
    if pad_r or pad_c:
        x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))
    return x.unflatten(-1, (-1, cols)).unflatten(-3, (-1, rows))


def _unblocked(xb: torch.Tensor, R: int, C: int) -> torch.Tensor:
    x = xb.flatten(-2).flatten(-3, -2)
    return x if x.shape[-2:] == (R, C) else x[..., :R, :C]


def e4m3_to_float(q: torch.Tensor) -> torch.Tensor:
    """``q.float()`` bit for bit. On CPU torch converts E4M3 one element at a time (~5 ns each, 5-10× a
    vectorised cast); there the bytes are widened instead: E4M3's sign, exponent and mantissa moved into the
    FP16 fields (``int8 -> int16``, ``<< 7``, sign bit 14 cleared) are the FP16 bits of ``q / 2^8`` — subnormals
    included, since both formats' subnormals are the mantissa times their smallest exponent — which converts
    to FP32 and is scaled back exactly. NaN bytes (±0x7F) become ±480 there; if any is present the plain cast
    runs instead."""
    if q.device.type != "cpu" or q.numel() == 0:
        return q.float()
    h = q.view(torch.int8).to(torch.int16).mul_(128).bitwise_and_(~0x4000)
    v = h.view(torch.float16).float().mul_(256.0)
    lo, hi = torch.stack(torch.aminmax(v)).tolist()
    return q.float() if hi > FP8_MAX or lo < -FP8_MAX else v


def dequant(q: torch.Tensor, s: torch.Tensor, group_rows: int = 1) -> torch.Tensor:
    """FP32 values of ``q`` with scales over (group_rows × 128) tiles of its last two dims."""
    R, C = q.shape[-2:]
    return _unblocked(_blocked(e4m3_to_float(q), group_rows) * s.float()[..., :, None, :, None], R, C)


def _quant_tiles(x: torch.Tensor, group_rows: int, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., R, C]`` per (group_rows × 128) tile: ``(q [..., R, C], s [..., ⌈R/g⌉, ⌈C/128⌉])``."""
    R, C = x.shape[-2:]
    xb = _blocked(x.float(), group_rows)
    s = scale_from_amax(xb.abs().amax(dim=(-3, -1)), pow2)
    q = _to_e4m3_(xb / s[..., :, None, :, None])
    return _unblocked(q, R, C).contiguous(), s


# ------------------------------------------------------------------------------------------ quantisers
def quant_act(x: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """1×128 tiles along the last dim: ``x [M,K]`` -> ``(q [M,K] e4m3, s [M,⌈K/128⌉] fp32)``."""
    assert x.dim() == 2, x.shape
    return _quant_tiles(x, 1, pow2)


def quant_weight(w: torch.Tensor, pow2: bool = False, transpose: bool = False):
    """128×128 blocks over the last two dims: ``w [...,N,K]`` -> ``(q, s [...,⌈N/128⌉,⌈K/128⌉])``,
    plus ``q_t = q.mT`` contiguous (the K-major operand of Dgrad; its scales are ``s.mT``) if ``transpose``."""
    assert w.dim() in (2, 3), w.shape
    q, s = _quant_tiles(w, TILE, pow2)
    return (q, s, q.mT.contiguous()) if transpose else (q, s)


def segments(tokens_per_expert: torch.Tensor | None, rows: int, device: torch.device | str) -> torch.Tensor:
    """Per-expert row counts as int64 on ``device`` (one segment of ``rows`` when None)."""
    if tokens_per_expert is None:
        return torch.tensor([rows], dtype=torch.int64, device=device)
    assert tokens_per_expert.dim() == 1 and tokens_per_expert.numel() >= 1, tokens_per_expert.shape
    return tokens_per_expert.to(device=device, dtype=torch.int64)


def segment_tiles(counts: torch.Tensor, rows: int, block: int) -> dict[str, torch.Tensor]:
    """Tiles of ``block`` rows that restart at every segment (expert) start; no host sync.

    Returns int32 tensors: per tile ``row_start``, ``row_end`` (empty tiles: equal) and ``expert``
    (``n = ⌈rows/block⌉ + E - 1`` tiles, an upper bound); per expert ``seg_start``, ``seg_end``,
    ``tile_start``, ``tile_end`` (its tiles are ``[tile_start, tile_end)``).
    """
    E = counts.numel()
    counts = counts.to(torch.int32)          # int32 throughout: one conversion, not one per result
    seg_end = counts.cumsum(0, dtype=torch.int32)
    seg_start = seg_end - counts
    tile_start, tile_end = _tile_bounds(counts, block)
    n = max(cdiv(rows, block) + E - 1, 0)
    t = torch.arange(n, device=counts.device, dtype=torch.int32)
    e = torch.searchsorted(tile_end, t, right=True, out_int32=True).clamp_(max=E - 1)
    row_start = seg_start[e] + (t - tile_start[e]) * block
    row_end = torch.where(t < tile_end[-1], torch.minimum(row_start + block, seg_end[e]), row_start)
    return {"row_start": row_start, "row_end": row_end, "expert": e, "seg_start": seg_start, "seg_end": seg_end,
            "tile_start": tile_start, "tile_end": tile_end}


def _tile_bounds(counts: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each segment's tiles of ``block`` rows, ``[tile_start, tile_end)`` (int32 counts in, int32 out)."""
    tiles = (counts + (block - 1)) // block
    tile_end = tiles.cumsum(0, dtype=torch.int32)
    return tile_end - tiles, tile_end


# "1": a grouped GEMM whose BLOCK_M divides 128 reads the layer's 128-row tile table in parts (table_block) instead
# of building its own. Opt-in until a GPU has run the kernel's parts path.
SHARED_TILES_ENV = "DSV3_FP8_SHARED_TILES"


def table_block(block_m: int) -> int:
    """The rows per tile of the table that a kernel with ``block_m``-row tiles reads: with ``SHARED_TILES_ENV``, 128
    (the 128×1 quantiser's, so one table serves a layer's quantiser and GEMMs) when ``block_m`` divides it, else
    ``block_m``."""
    return TILE if os.environ.get(SHARED_TILES_ENV) == "1" and TILE % block_m == 0 else block_m


_TILE_TABLES: OrderedDict[tuple, tuple[torch.Tensor, dict[str, torch.Tensor]]] = OrderedDict()


def tile_table(tokens_per_expert: torch.Tensor, rows: int, block: int, device: torch.device) -> dict[str, torch.Tensor]:
    """``segment_tiles`` of ``tokens_per_expert``, memoised for the Triton wrappers: the grouped GEMMs and the
    128×1 quantiser of one MoE layer, forward and backward, read the same counts tensor, and each table costs
    about 25 small kernel launches. Keyed by the tensor itself (held, so its id is not reused) and its version
    counter (an in-place change makes a new table); the last 32 tables are kept."""
    try:
        key = (id(tokens_per_expert), tokens_per_expert._version, rows, block, torch.device(device))
    except RuntimeError:      # inference tensors have no version counter
        return segment_tiles(segments(tokens_per_expert, rows, device), rows, block)
    hit = _TILE_TABLES.get(key)
    if hit is not None and hit[0] is tokens_per_expert:
        _TILE_TABLES.move_to_end(key)
        return hit[1]
    table = segment_tiles(segments(tokens_per_expert, rows, device), rows, block)
    _TILE_TABLES[key] = (tokens_per_expert, table)
    if len(_TILE_TABLES) > 32:
        _TILE_TABLES.popitem(last=False)
    return table


def expert_tile_bounds(tokens_per_expert: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's 128-row tiles ``[tile_start, tile_end)`` (int32): those of a memoised ``tile_table`` of the same
    counts tensor (any rows; the grouped Wgrad reads the table its layer's 128×1 quantiser made), else computed."""
    try:
        key = (id(tokens_per_expert), tokens_per_expert._version)
    except RuntimeError:      # inference tensors have no version counter
        key = None
    for (tid, version, _, block, dev), (held, table) in reversed(_TILE_TABLES.items()):
        if (tid, version) == key and block == TILE and dev == torch.device(device) and held is tokens_per_expert:
            return table["tile_start"], table["tile_end"]
    return _tile_bounds(segments(tokens_per_expert, 0, device).to(torch.int32), TILE)


def row_tiles(counts: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row: index of its segment-aligned 128-row tile, and its position inside the tile."""
    seg_end = counts.cumsum(0)
    seg_start = seg_end - counts
    tile_start = ((counts + TILE - 1) // TILE).cumsum(0) - (counts + TILE - 1) // TILE
    r = torch.arange(rows, device=counts.device)
    e = torch.searchsorted(seg_end, r, right=True)
    local = r - seg_start[e]
    return tile_start[e] + local // TILE, local % TILE


def act_t_columns(tokens_per_expert: torch.Tensor, rows: int) -> torch.Tensor:
    """Column of each token (row of ``x``) in the tile-space ``qT`` of ``quant_act_t(x, tokens_per_expert)``."""
    tile, pos = row_tiles(segments(tokens_per_expert, rows, tokens_per_expert.device), rows)
    return tile * TILE + pos


def act_t_tiles(tokens_per_expert: torch.Tensor, rows: int) -> int:
    """Number of 128-token tiles of ``quant_act_t(x [rows, C], tokens_per_expert)``: ``⌈rows/128⌉ + E - 1``."""
    return max(cdiv(rows, TILE) + tokens_per_expert.numel() - 1, 0)


def quant_act_t(x: torch.Tensor, tokens_per_expert: torch.Tensor | None = None, pow2: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """128×1 tiles (128 rows × 1 column), transposed output: ``x [R,C]`` -> ``(qT, sT)`` e4m3/fp32.
    Without ``tokens_per_expert``: ``qT [C,R]``, ``sT [C, ⌈R/128⌉]``. With it, tiles restart at each expert and
    ``qT [C, n·128]`` is in tile space (module docstring), ``sT [C, n]``, ``n = ⌈R/128⌉ + E - 1``."""
    assert x.dim() == 2, x.shape
    R, C = x.shape
    if tokens_per_expert is None:                                       # one segment: 1×128 tiles of xᵀ
        return quant_act(x.t(), pow2)
    n = act_t_tiles(tokens_per_expert, R)
    dest = act_t_columns(tokens_per_expert.to(x.device), R)
    xp = x.new_zeros(n * TILE, C, dtype=torch.float32).index_copy_(0, dest, x.float()).view(n, TILE, C)
    s = scale_from_amax(xp.abs().amax(1), pow2)                                 # [n, C]
    q = _to_e4m3_(xp.div_(s[:, None, :])).view(n * TILE, C)
    return q.t().contiguous(), s.t().contiguous()


def quant_act_both(x: torch.Tensor, tokens_per_expert: torch.Tensor | None = None, pow2: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both copies of ``x [R,C]``: ``(*quant_act(x), *quant_act_t(x, tokens_per_expert))`` (an FP8 linear's input
    when Fprop and Wgrad both read it, or its output gradient when Dgrad and Wgrad do)."""
    return (*quant_act(x, pow2), *quant_act_t(x, tokens_per_expert, pow2))


# ------------------------------------------------------------------------------------------------ GEMMs
def b_group(b: torch.Tensor, sb: torch.Tensor) -> int:
    """128 when ``sb`` holds 128×128 blocks of ``b``, 1 when it holds per-row 1×128 tiles."""
    N, K = b.shape[-2:]
    assert sb.shape[-1] == cdiv(K, TILE), (sb.shape, b.shape)
    if sb.shape[-2] == N:
        return 1
    assert sb.shape[-2] == cdiv(N, TILE), (sb.shape, b.shape)
    return TILE


def gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``a [M,K] · b [N,K]ᵀ`` from FP8 operands: dequantise, matmul in FP32."""
    assert a.dtype == b.dtype == FP8_DTYPE and a.shape[1] == b.shape[1], (a.dtype, b.dtype, a.shape, b.shape)
    assert sa.shape == (a.shape[0], cdiv(a.shape[1], TILE)), (sa.shape, a.shape)
    with torch.autocast(a.device.type, enabled=False):
        return (dequant(a, sa) @ dequant(b, sb, b_group(b, sb)).t()).to(out_dtype)


def grouped_gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                 tokens_per_expert: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows of expert e of ``a [R,K]`` times ``b[e]ᵀ`` (``b [E,N,K]``, 128×128 block scales)."""
    assert a.dtype == b.dtype == FP8_DTYPE and b.dim() == 3 and a.shape[1] == b.shape[2]
    assert b.shape[0] == tokens_per_expert.numel() and b_group(b, sb) == TILE
    with torch.autocast(a.device.type, enabled=False):
        xa, wb = dequant(a, sa), dequant(b, sb, TILE)
        outs = [xe @ wb[e].t() for e, xe in enumerate(xa.split(tokens_per_expert.tolist()))]
        out = torch.cat(outs) if outs else xa.new_zeros(0, b.shape[1])
    return out.to(out_dtype)


def grouped_wgrad(aT: torch.Tensor, sa: torch.Tensor, bT: torch.Tensor, sb: torch.Tensor,
                  tokens_per_expert: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``out[e] = Σ_{tiles t of e} aT_t · bT_tᵀ`` -> ``[E,N,K]``; tile-space operands from ``quant_act_t``."""
    assert aT.dtype == bT.dtype == FP8_DTYPE and aT.shape[1] == bT.shape[1] == sa.shape[1] * TILE
    (N, width), K, n = aT.shape, bT.shape[0], sa.shape[1]
    tiles = (tokens_per_expert.to(aT.device, torch.int64) + TILE - 1) // TILE
    with torch.autocast(aT.device.type, enabled=False):
        xa = (e4m3_to_float(aT).view(N, n, TILE) * sa.float()[:, :, None]).view(N, width)
        xb = (e4m3_to_float(bT).view(K, n, TILE) * sb.float()[:, :, None]).view(K, width)
        cols = (tiles * TILE).tolist()
        used = sum(cols)
        outs = [pa @ pb.t() for pa, pb in zip(xa[:, :used].split(cols, 1), xb[:, :used].split(cols, 1))]
    return torch.stack(outs).to(out_dtype)
