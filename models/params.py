"""Parameter counts of a (meta-device) model: total, per component, and activated per token.

Counting rule for *activated* parameters: every parameter of the main model a token passes through —
embedding, attention, norms, dense FFNs, routers, shared experts, the output head — plus, in each MoE
layer, the parameters of ``n_activated_experts`` routed experts (K of E). MTP modules are reported
separately and excluded from both ``total`` and ``activated`` (they are dropped at inference).
"""
from __future__ import annotations

from dataclasses import dataclass

from .moe import GroupedExperts
from .transformer import DeepSeekV3


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
