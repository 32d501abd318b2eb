"""``apply_ep``: shard every MoE layer's routed experts over the EP group and install a dispatcher.

Shared experts, attention, dense layers, router and balancing bias stay replicated. The model code is
unchanged: only ``moe.experts`` (now ``E / ep`` local experts) and ``moe.dispatcher`` are replaced.

``fp8_dispatch=True``: the dispatch all-to-alls carry the token rows as FP8 (E4M3 + power-of-2 scales
per 1x128 tile; straight-through backward; see ``dispatch.py``). Needs ``model.dim % 128 == 0``, checked
here even when ``ep == 1`` (no dispatch then), so a config fails on one device as it would at scale.
"""
from __future__ import annotations

from torch import nn

from kernels.reference import TILE
from models.moe import GroupedExperts, MoE

from ..dims import ParallelDims
from .dispatch import AllToAllDispatcher, HierarchicalDispatcher


def _alltoall(n_experts: int, dims: ParallelDims, fp8: bool) -> AllToAllDispatcher:
    return AllToAllDispatcher(n_experts, dims.group("ep"), dims.ep_ranks_per_node, fp8=fp8)


def _hierarchical(n_experts: int, dims: ParallelDims, fp8: bool):
    """Node-limited two-hop routing when the EP group spans nodes; within one node it is the flat all-to-all."""
    if dims.ep_nodes == 1:
        return _alltoall(n_experts, dims, fp8)
    return HierarchicalDispatcher(n_experts, dims.group("ep"), dims.group("ep_inter"), dims.group("ep_intra"),
                                  fp8=fp8)


# ``parallel.ep_dispatcher``: name -> builder(n_experts, dims, fp8). The config's allowed values come from here.
DISPATCHERS = {"hierarchical": _hierarchical, "alltoall": _alltoall}


def apply_ep(model: nn.Module, dims: ParallelDims, dispatcher: str = "hierarchical",
             fp8_dispatch: bool = False) -> nn.Module:
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"unknown dispatcher {dispatcher!r} ({' | '.join(DISPATCHERS)})")
    if fp8_dispatch:
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            dim = moe.gate.weight.shape[1]
            if dim % TILE:
                raise ValueError(f"parallel.fp8_dispatch needs model.dim to be a multiple of {TILE} "
                                 f"(1x{TILE} FP8 scaling tiles), got model.dim={dim}")
    if dims.ep == 1:
        return model
    for name, moe in ((n, m) for n, m in model.named_modules() if isinstance(m, MoE)):
        experts = moe.experts
        n_local = moe.n_experts // dims.ep
        start = dims.ep_rank * n_local
        for w in ("w13", "w2"):
            full = getattr(experts, w)
            setattr(experts, w, nn.Parameter(full.detach()[start:start + n_local].clone(),
                                                requires_grad=full.requires_grad))
        experts.expert_offset = start   # global index of local expert 0
        moe.dispatcher = DISPATCHERS[dispatcher](moe.n_experts, dims, fp8_dispatch)
        # used in error messages, e.g. "layers.3.ffn (EP group [0, 1, 2, 3])"
        moe.dispatcher.name = f"{name} (EP group {dims.group('ep_ranks')})"
    return model


def is_expert_param(model: nn.Module) -> dict[str, bool]:
    """name -> True for routed-expert parameters (sharded over EP, reduced over expert-dp)."""
    expert_ids = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    return {n: id(p) in expert_ids for n, p in model.named_parameters()}
