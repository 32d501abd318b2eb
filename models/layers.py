"""Building blocks shared by attention, MoE and the transformer: RMSNorm, SwiGLU MLP, rotary embedding.

``SwiGLU`` (the product ``silu(h1) * h3`` of the two halves of one up-projection, ``h13``) is a parameterless module
so that a transform can wrap it (``parallel/recompute.py`` recomputes it in backward from its input) without
touching parameter names.

Shape legend: B batch, T sequence, D hidden, H heads, R rope dim.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)``, the statistics in FP32, normalised back in ``x``'s dtype before the scale."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + y`` and ``rms_norm(h)``: a branch added to the residual stream and the norm after it, one chain of
    elementwise work (``RMSNorm.residual``)."""
    h = x + y
    return h, rms_norm(h, weight, eps)


def swiglu(h13: torch.Tensor) -> torch.Tensor:
    """The gated activation ``silu(h1) * h3`` of ``h13 = [h1 | h3]`` along the last dimension (the output of one
    GEMM with the gate and up weights stacked, ``w13``)."""
    h1, h3 = h13.chunk(2, dim=-1)
    return F.silu(h1) * h3


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def residual(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, self(h))`` for ``h = x + y``: the residual stream after a branch and its norm. Here an add and this
        module's forward (its hooks and a recomputed forward apply); a transform may run both as one region
        (``add_rms_norm``, ``parallel/compile.py``), whose backward sums ``h``'s two gradients as it goes."""
        h = x + y
        return h, self(h)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


class SwiGLU(nn.Module):
    """The gated activation ``silu(h1) * h3`` of ``h13 = [h1 | h3]`` (``swiglu``; no parameters)."""

    def forward(self, h13: torch.Tensor) -> torch.Tensor:
        return swiglu(h13)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``w2(silu(w1 x) * w3 x)``. Used for dense layers and shared experts.

    The gate and up projections are one linear, ``w13`` (``[w1; w3]``: the gate's rows first): one GEMM reads
    ``x`` once, and its backward gives ``x``'s gradient in one GEMM instead of two and an add (Megatron-Core's
    fused ``linear_fc1`` is the same layout). Hugging Face's ``gate_proj`` / ``up_proj`` are its halves
    (``models/hf.py``)."""

    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.w13 = nn.Linear(dim, 2 * inter_dim, bias=False)   # [gate; up]
        self.w2 = nn.Linear(inter_dim, dim, bias=False)        # down
        self.act = SwiGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w13(x)))

    def init_weights(self, std: float) -> None:
        gate, up = self.w13.weight.chunk(2, dim=-2)
        normal_in_order_([gate, self.w2.weight, up], std)


@torch.no_grad()
def normal_in_order_(parts: list[torch.Tensor], std: float) -> None:
    """Normal(0, std) into each of ``parts`` in turn, each drawn as a contiguous tensor of its own shape (a strided
    view draws other values) and copied in. A module whose stacked weight (``w13``, ``wqkv_a``) holds what were
    separate weights lists their parts in the old order and shapes, so that a seed initialises the values it did
    before they were stacked."""
    for w in parts:
        w.copy_(torch.empty(w.shape, dtype=w.dtype, device=w.device).normal_(std=std))


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(cfg: ModelConfig, device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """Inverse frequencies for the decoupled rope dims, with YaRN when ``rope_factor > 1``, computed on
    ``device`` (no copy from the host inside a step: a CUDA graph cannot capture one).

    Returns ``(inv_freq [R/2], cos_sin_scale)``.
    """
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    if cfg.rope_factor <= 1.0:
        return inv_freq, 1.0

    def correction_dim(n_rot: float) -> float:
        return dim * math.log(cfg.original_max_seq_len / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(cfg.beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp               # 1 keeps the original frequency, 0 interpolates by the factor
    inv_freq = inv_freq / cfg.rope_factor * (1 - extrapolation) + inv_freq * extrapolation
    if cfg.mscale and cfg.mscale_all_dim:
        scale = yarn_mscale(cfg.rope_factor, cfg.mscale) / yarn_mscale(cfg.rope_factor, cfg.mscale_all_dim)
    else:
        scale = yarn_mscale(cfg.rope_factor, 1.0)
    return inv_freq, scale


def rope_cos_sin(cfg: ModelConfig, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[T, R/2]`` (fp32) for positions 0..seq_len-1."""
    inv_freq, scale = rope_inv_freq(cfg, device)
    t = torch.arange(seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    return freqs.cos() * scale, freqs.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0,x1),(x2,x3),... of ``x [B,H,T,R]`` by the per-position angles.

    The output is laid out half-split (all first members, then all second members); q and k get the
    same layout, so attention scores equal the interleaved-complex formulation of DeepSeek's release.
    """
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_heads(x_nope: torch.Tensor, x_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Attention heads ``[B,H,T,N+R]``: ``x_nope [B,H,T,N]`` followed by ``x_pe [B,H|1,T,R]`` rotated
    (``apply_rope``), a single rope key broadcast to every head. One chain of elementwise work, so that a
    transform may run it as one compiled region (``parallel/compile.py``)."""
    pe = apply_rope(x_pe, cos, sin).expand(*x_nope.shape[:-1], x_pe.shape[-1])
    return torch.cat([x_nope, pe], dim=-1)
