"""torch's own blockwise FP8 GEMM behind the ``gemm`` API of ``reference.py``: cuBLASLt through
``torch.nn.functional.scaled_mm`` with the DeepSeek-V3 recipes (1×128 activation tiles, 128×128 weight blocks or
1×128 tiles for Wgrad), Hopper (sm_90) only.

Same operands as the Triton GEMM (``a [M,K]``, ``b [N,K]``, both K-contiguous; ``sa [M,⌈K/128⌉]``; ``sb``
128×128 blocks ``[⌈N/128⌉,⌈K/128⌉]`` or per-row ``[N,⌈K/128⌉]``) and the same numerics contract: the scales
differ per 128 of K, so cuBLASLt applies them (promotes into FP32) every 128 products.

cuBLASLt's scale layouts, converted here: 1×128 scales outer-dim major (``s.t().contiguous().t()``); 128×128
scales as ``[⌈K/128⌉ rounded up to 4, ⌈N/128⌉]`` (zero-padded, then transposed). It takes K in whole
128-element tiles only (``accepts``); ``auto`` uses the Triton kernel for other shapes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import selfcheck
from .reference import TILE, b_group, cdiv


def unavailable(device: torch.device | str) -> str | None:
    """Why this engine cannot run on ``device`` (one line), or None."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"torch's blockwise FP8 GEMM needs CUDA (cuBLASLt), not {dev.type}"
    if not (hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    major, minor = torch.cuda.get_device_capability(dev)
    if major != 9:
        return f"cuBLASLt's blockwise FP8 scaling is for sm_90; this device is sm_{major}{minor}"
    return None


def accepts(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, out_dtype=None) -> bool:
    """Whether cuBLASLt takes these operands as they are: K-contiguous, 16-byte-aligned rows, K a multiple of 128."""
    return a.shape[1] % TILE == 0 and all(
        t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (a, b))


def gemm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``a [M,K] · b [N,K]ᵀ`` -> ``[M,N]`` in ``out_dtype`` (FP32 or BF16) through ``F.scaled_mm``."""
    assert a.dim() == b.dim() == 2 and a.shape[1] == b.shape[1], (a.shape, b.shape)
    M, K = a.shape
    N = b.shape[0]
    assert sa.shape == (M, cdiv(K, TILE)), (sa.shape, a.shape)
    if M == 0 or N == 0 or K == 0:
        return torch.zeros((M, N), dtype=out_dtype, device=a.device)
    if not accepts(a, sa, b, sb):
        raise ValueError(f"torch blockwise scaled_mm: operands {tuple(a.shape)} x {tuple(b.shape)} with strides "
                         f"{a.stride()} / {b.stride()}: cuBLASLt needs K-contiguous, 16-byte-aligned rows and K a "
                         f"multiple of {TILE} (the triton backend takes any layout)")
    scale_a = sa.float().t().contiguous().t()
    if b_group(b, sb) == TILE:
        sbc = sb.float().contiguous()
        pad = -sbc.shape[1] % 4
        scale_b, recipe_b = (F.pad(sbc, (0, pad)) if pad else sbc).t(), F.ScalingType.BlockWise128x128
    else:
        scale_b, recipe_b = sb.float().t().contiguous().t(), F.ScalingType.BlockWise1x128
    return F.scaled_mm(a, b.t(), scale_a, F.ScalingType.BlockWise1x128, scale_b, recipe_b, output_dtype=out_dtype)


def self_check(device: torch.device) -> float:
    """Worst relative error vs the reference: Fprop-like (128×128 weight blocks, BF16 out, K/128 not a
    multiple of 4) and Wgrad-like (1×128 × 1×128, FP32 out)."""
    from . import reference as ref
    from .gemm import _rand
    a, sa = ref.quant_act(_rand(256, 640, seed=11, device=device))
    b, sb = ref.quant_weight(_rand(384, 640, seed=12, device=device))
    errs = [selfcheck.rel_err(gemm(a, sa, b, sb, torch.bfloat16), ref.gemm(a, sa, b, sb))]
    (a, sa), (b, sb) = (ref.quant_act_t(_rand(256, n, seed=n, device=device)) for n in (256, 384))
    errs.append(selfcheck.rel_err(gemm(a, sa, b, sb, torch.float32), ref.gemm(a, sa, b, sb, torch.float32)))
    return selfcheck.worst(errs)
