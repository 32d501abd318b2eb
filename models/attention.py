"""Multi-head Latent Attention (MLA), DeepSeek-V2/V3 style, causal, single device.

Queries: optionally low-rank (``q_lora_rank``): D -> q_lora (RMSNorm) -> H*(nope+rope).
Keys/values: D -> kv_lora (RMSNorm) -> H*(nope+v), plus one shared rope key of R dims per token.
The two projections of the layer input (the query latent, or without ``q_lora_rank`` the queries, and the key/value
latent with the rope key) are one weight, ``wqkv_a`` (``[wq_a or wq; wkv_a]``, the query rows first): one GEMM reads
the input once, and the backward gives its gradient in one GEMM instead of two and an add.
The two up-projection paths are methods (``q_up``, ``kv_up``: latent -> the attention core's inputs), and
``core`` runs them and the attention from the latents to wo's input, so that a transform can recompute them
in backward (``parallel/recompute.py``). What runs between an up-projection's GEMM and the attention (the heads'
layout, the rotation, the concatenation) is one function each (``query_heads``, ``key_value_heads``), so that a
transform can run the rotation (``rope_heads``) or the whole of it as one compiled region (``parallel/compile.py``);
whole, its backward writes the GEMM's output gradient in one pass.
Shape legend: B batch, T sequence, D hidden, H heads, R rope dim, N nope dim, V value dim, L latent rank,
C a projection's output (latent, or latent + rope).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import RMSNorm, normal_in_order_, rope_heads, yarn_mscale


def query_heads(q_BTC: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, nope: int,
                rotate=rope_heads) -> torch.Tensor:
    """Queries ``[B,H,T,N+R]`` from the query up-projection's output ``[B,T,H*(N+R)]``: each head's last R dims
    rotated and concatenated by ``rotate`` (``rope_heads``, or a compiled region of it)."""
    B, T, _ = q_BTC.shape
    q = q_BTC.view(B, T, n_heads, -1).transpose(1, 2)
    q_nope, q_pe = q.split([nope, q.shape[-1] - nope], dim=-1)
    return rotate(q_nope, q_pe, cos, sin)


def key_value_heads(kv_BTC: torch.Tensor, k_pe_BTR: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
                    nope: int, rotate=rope_heads) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[B,H,T,N+R]`` and values ``[B,H,T,V]`` from the key/value up-projection's output ``[B,T,H*(N+V)]``
    and the one shared rope key ``[B,T,R]`` (rotated by ``rotate``, appended to every head). The values are a copy,
    not a view of the input: compiled as one region, its backward then writes both gradients into the input's in
    one pass."""
    B, T, _ = kv_BTC.shape
    k_nope, v = kv_BTC.view(B, T, n_heads, -1).transpose(1, 2).split([nope, kv_BTC.shape[-1] // n_heads - nope], -1)
    return rotate(k_nope, k_pe_BTR.unsqueeze(1), cos, sin), v.contiguous()


def query_heads_bthd(q_BTC: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, nope: int,
                     rotate=rope_heads) -> torch.Tensor:
    """``query_heads``' values, laid out ``[B,T,H,N+R]`` in memory and returned as their ``[B,H,T,N+R]`` view: an
    attention kernel that lays its output out like its query (cuDNN's) then gives one that ``MLA.core`` flattens
    into wo's input as a view, without a copy."""
    B, T, _ = q_BTC.shape
    q = q_BTC.view(B, T, n_heads, -1)
    q_nope, q_pe = q.split([nope, q.shape[-1] - nope], dim=-1)
    return rotate(q_nope, q_pe, cos.unsqueeze(-2), sin.unsqueeze(-2)).transpose(1, 2)


def key_value_heads_bthd(kv_BTC: torch.Tensor, k_pe_BTR: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         n_heads: int, nope: int, rotate=rope_heads) -> tuple[torch.Tensor, torch.Tensor]:
    """``key_value_heads``' values, laid out ``[B,T,H,.]`` in memory like ``query_heads_bthd``'s."""
    B, T, _ = kv_BTC.shape
    k_nope, v = kv_BTC.view(B, T, n_heads, -1).split([nope, kv_BTC.shape[-1] // n_heads - nope], -1)
    k = rotate(k_nope, k_pe_BTR.unsqueeze(2), cos.unsqueeze(-2), sin.unsqueeze(-2))
    return k.transpose(1, 2), v.contiguous().transpose(1, 2)


class MLA(nn.Module):
    # What runs between each up-projection and the attention, and the rotation inside it (a transform may
    # compile either the rotation or the whole of each).
    query_heads = staticmethod(query_heads)
    kv_heads = staticmethod(key_value_heads)
    rope_heads = staticmethod(rope_heads)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        qk_head_dim = cfg.qk_head_dim
        self.q_rows = cfg.q_rows
        self.wqkv_a = nn.Linear(cfg.dim, self.q_rows + cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        if cfg.q_lora_rank:
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.n_heads * qk_head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.v_head_dim, cfg.dim, bias=False)
        self.softmax_scale = qk_head_dim ** -0.5
        if cfg.rope_factor > 1.0 and cfg.mscale_all_dim:
            self.softmax_scale *= yarn_mscale(cfg.rope_factor, cfg.mscale_all_dim) ** 2

    def init_weights(self, std: float) -> None:
        """The linears, in the order and shapes of the separate weights before ``wqkv_a`` (``normal_in_order_``);
        the norms are their own."""
        q, kv = self.wqkv_a.weight.split([self.q_rows, self.wqkv_a.out_features - self.q_rows], dim=-2)
        wq_b = [self.wq_b.weight] if hasattr(self, "wq_b") else []
        normal_in_order_([q, *wq_b, kv, self.wkv_b.weight, self.wo.weight], std)

    def forward(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # one split in three: its backward is one concatenation of the three gradients, not two
        q_BTC, kv_BTL, k_pe_BTR = self.wqkv_a(x_BTD).split([self.q_rows, self.kv_lora_rank, self.rope], dim=-1)
        return self.wo(self.core(q_BTC, kv_BTL, k_pe_BTR, rope))

    def core(self, q_BTC: torch.Tensor, kv_BTL: torch.Tensor, k_pe_BTR: torch.Tensor,
             rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Attention from the latents (``wqkv_a``'s output: the query latent or, without ``q_lora_rank``, the
        queries; the key/value latent; the rope key): the up-projections, rope and causal scaled-dot-product
        attention; returns wo's input ``[B, T, H*V]``."""
        B, T, _ = q_BTC.shape
        q_BHTQ = self.q_up(q_BTC, rope)
        k_BHTQ, v_BHTV = self.kv_up(kv_BTL, k_pe_BTR, rope)
        o = F.scaled_dot_product_attention(q_BHTQ, k_BHTQ, v_BHTV, is_causal=True, scale=self.softmax_scale)
        return o.transpose(1, 2).reshape(B, T, self.n_heads * self.v_dim)

    def q_up(self, q_BTC: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Queries ``[B,H,T,N+R]`` for the attention core from the query latent (q_norm, then the wq_b
        up-projection) or, without ``q_lora_rank``, from the queries themselves; rope on the last R dims of each
        head."""
        q = self.wq_b(self.q_norm(q_BTC)) if hasattr(self, "wq_b") else q_BTC
        return self.query_heads(q, *rope, self.n_heads, self.nope, self.rope_heads)

    def kv_up(self, kv_BTL: torch.Tensor, k_pe_BTR: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[B,H,T,N+R]`` and values ``[B,H,T,V]`` from the key/value latent ``[B,T,L]`` through kv_norm and
        the wkv_b up-projection, and the one shared rope key ``[B,T,R]`` (rotated) appended to every head."""
        return self.kv_heads(self.wkv_b(self.kv_norm(kv_BTL)), k_pe_BTR, *rope, self.n_heads, self.nope,
                             self.rope_heads)
