"""Parameter counts of a (meta-device) model: total, per component, and activated per token; and the training
FLOPs per token built on them.

Counting rule for *activated* parameters: every parameter of the main model a token passes through —
embedding, attention, norms, dense FFNs, routers, shared experts, the output head — plus, in each MoE
layer, the parameters of ``n_activated_experts`` routed experts (K of E). MTP modules are reported
separately and excluded from both ``total`` and ``activated`` (they are dropped at inference).

FLOPs per token (training, forward + backward), the basis of MFU:
    6 * N + 3 * (L + D) * H * (d_qk + d_v) * T
N: parameters a token's matmuls touch, without the embedding (a lookup): the activated parameters minus the
embedding, plus per MTP depth the MTP module with K of E routed experts and another pass through the shared
output head. The second term is causal attention: QK^T and AV cost 2 * H * (d_qk + d_v) * c FLOPs forward for
a query with c keys, c averages T/2, and backward is twice forward; L layers, D MTP depths, T = data.seq_len.
"""
from __future__ import annotations

from dataclasses import dataclass

from .moe import GroupedExperts
from .transformer import DeepSeekV3, build

FLOPS_FORMULA = "6*N + 3*(L+D)*H*(d_qk+d_v)*T"


@dataclass
class ParamCounts:
    total: int            # main model (no MTP)
    activated: int        # per token, main model (no MTP)
    mtp: int              # unique parameters of the MTP modules (embedding/head are shared, not counted)
    embedding: int
    head: int
    routed_experts: int   # all routed experts of the main model

    @property
    def total_with_mtp(self) -> int:
        return self.total + self.mtp


def count_params(model: DeepSeekV3) -> ParamCounts:
    cfg = model.cfg
    mtp = sum(p.numel() for p in model.mtp.parameters())
    total = sum(p.numel() for p in model.parameters()) - mtp
    routed = sum(p.numel() for name, m in model.named_modules()
                 if isinstance(m, GroupedExperts) and not name.startswith("mtp.") for p in m.parameters())
    activated = total - routed + routed * cfg.n_activated_experts // cfg.n_routed_experts if routed else total
    return ParamCounts(total=total, activated=activated, mtp=mtp, embedding=model.embed.weight.numel(),
                       head=model.head.weight.numel(), routed_experts=routed)


@dataclass(frozen=True)
class Flops:
    matmul_params: int     # N in 6N: parameters a token's matmuls touch (no embedding; MTP included)
    attention: float       # the attention term per token (forward + backward)

    @property
    def per_token(self) -> float:
        return 6 * self.matmul_params + self.attention


def flops_per_token(model_cfg, seq_len: int, model: DeepSeekV3 | None = None) -> Flops:
    """Training FLOPs per token of ``model_cfg`` (a ``ModelConfig``) at ``seq_len``; formula in the module doc.
    ``model``: the single-device model of that config if already built (any device, meta is enough)."""
    model = model if model is not None else build(model_cfg, "meta")
    c = count_params(model)
    m = model_cfg
    mtp_routed = sum(p.numel() for name, mod in model.named_modules()
                     if name.startswith("mtp.") and isinstance(mod, GroupedExperts) for p in mod.parameters())
    mtp_activated = c.mtp - mtp_routed + mtp_routed * m.n_activated_experts // m.n_routed_experts
    n = c.activated - c.embedding + mtp_activated + m.mtp_depth * c.head
    attn = 3.0 * (m.n_layers + m.mtp_depth) * m.n_heads * (m.qk_head_dim + m.v_head_dim) * seq_len
    return Flops(n, attn)
