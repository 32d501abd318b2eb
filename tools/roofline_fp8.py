"""The FP8 step in the roofline (``tools/roofline.py``): the kernels of ``train.precision=fp8`` as CUDA runs them.

On fake tensors no Triton kernel runs, and ``kernels.get_ops`` would answer with the CPU's emulation. Under
``fp8_kernels(recorder)`` it answers with ``CudaFP8Ops`` instead: each op makes outputs of the right shapes and
dtypes (no data) and records the kernels that the ``auto`` backend launches for it on an H100 (``kernels/auto.py``,
``docs/fp8.md``):

- quantisers: the Triton kernels, one launch each (``quant_act_both``, fused on CUDA only as an opt-in: the two
  separate ones); ``quant_weight(transpose=True)``: the 128×128 quantiser, then the transpose kernel;
- dense GEMMs: torch's blockwise ``scaled_mm`` (cuBLASLt), which ``auto`` measured fastest at every shape it
  timed; Wgrad (per-row scales on both operands) at its own rate;
- grouped GEMMs: the Triton kernels; each layer's tile tables (``kernels.reference.tile_table``,
  ``expert_tile_bounds``: small torch ops, memoised per counts tensor) run through the recorder as the kernels'
  wrappers run them.

Bytes: each kernel's tensors once (inputs read, outputs written); FLOPs: ``2·M·N·K`` of a GEMM, with the grouped
Wgrad's contraction over its tile-space columns (its padding included: the kernel multiplies it). The rates are in
``roofline.H100`` (classes ``fp8 ...``), each with its source.
"""
from __future__ import annotations

import contextlib

import torch

from kernels.reference import (FP8_DTYPE, TILE, act_t_tiles, b_group, cdiv, expert_tile_bounds, table_block,
                               tile_table)

GROUPED_BLOCK_M = 64     # the H100 tuning table's BLOCK_M for the grouped Fprop/Dgrad (kernels/tuning/)


class CudaFP8Ops:
    """``kernels.get_ops("auto", cuda)``'s namespace (``reference.py`` signatures) on fake tensors, recorded."""

    def __init__(self, record):
        self._record = record      # (name, reads, writes, flops) -> None

    @staticmethod
    def _q(shape, device) -> torch.Tensor:
        return torch.empty(shape, dtype=FP8_DTYPE, device=device)

    @staticmethod
    def _s(shape, device) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32, device=device)

    def quant_act(self, x, pow2=False):
        M, K = x.shape
        q, s = self._q((M, K), x.device), self._s((M, cdiv(K, TILE)), x.device)
        self._record("fp8 quantise 1x128", (x,), (q, s), 0.0)
        return q, s

    def quant_act_t(self, x, tokens_per_expert=None, pow2=False):
        R, C = x.shape
        if tokens_per_expert is None:
            n = cdiv(R, TILE)
            cols = R
        else:
            tile_table(tokens_per_expert, R, TILE, x.device)
            n = act_t_tiles(tokens_per_expert, R)
            cols = n * TILE
        q, s = self._q((C, cols), x.device), self._s((C, n), x.device)
        self._record("fp8 quantise 128x1", (x,), (q, s), 0.0)
        return q, s

    def quant_act_both(self, x, tokens_per_expert=None, pow2=False):
        return (*self.quant_act(x, pow2), *self.quant_act_t(x, tokens_per_expert, pow2))

    def quant_weight(self, w, pow2=False, transpose=False):
        *lead, N, K = w.shape
        q, s = self._q(w.shape, w.device), self._s((*lead, cdiv(N, TILE), cdiv(K, TILE)), w.device)
        self._record("fp8 quantise 128x128", (w,), (q, s), 0.0)
        if not transpose:
            return q, s
        q_t = self._q((*lead, K, N), w.device)
        self._record("fp8 transpose", (q,), (q_t,), 0.0)
        return q, s, q_t

    def gemm(self, a, sa, b, sb, out_dtype=torch.bfloat16):
        (M, K), N = a.shape, b.shape[0]
        c = torch.empty((M, N), dtype=out_dtype, device=a.device)
        name = "fp8 gemm wgrad" if b_group(b, sb) == 1 else "fp8 gemm"
        self._record(name, (a, sa, b, sb), (c,), 2.0 * M * N * K)
        return c

    def grouped_gemm(self, a, sa, b, sb, tokens_per_expert, out_dtype=torch.bfloat16):
        (R, K), N = a.shape, b.shape[1]
        tile_table(tokens_per_expert, R, table_block(GROUPED_BLOCK_M), a.device)
        c = torch.empty((R, N), dtype=out_dtype, device=a.device)
        self._record("fp8 grouped gemm", (a, sa, b, sb, tokens_per_expert), (c,), 2.0 * R * N * K)
        return c

    def grouped_wgrad(self, aT, sa, bT, sb, tokens_per_expert, out_dtype=torch.float32):
        (N, cols), K, E = aT.shape, bT.shape[0], tokens_per_expert.numel()
        expert_tile_bounds(tokens_per_expert, aT.device)
        c = torch.empty((E, N, K), dtype=out_dtype, device=aT.device)
        self._record("fp8 grouped wgrad", (aT, sa, bT, sb, tokens_per_expert), (c,), 2.0 * N * K * cols)
        return c


@contextlib.contextmanager
def fp8_kernels(recorder):
    """``kernels.get_ops`` answers every FP8 module with ``CudaFP8Ops`` recording into ``recorder`` (the ops' output
    allocations launch nothing; the tile tables' torch ops are recorded like any other)."""
    import kernels

    def record(name, reads, writes, flops):
        recorder.record(name, None, reads, {}, writes, flops)

    ops = CudaFP8Ops(record)
    saved = kernels.get_ops

    def get_ops(backend, device="cpu"):
        return ops

    kernels.get_ops = get_ops
    try:
        yield ops
    finally:
        kernels.get_ops = saved
