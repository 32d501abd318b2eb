"""Checkpoint views of a parallelised model: expert shards become DTensors, so DCP stores every tensor
under the single-device model's name and global shape (``layers.3.ffn.experts.w1`` is ``[E, F, D]``),
whatever the layout that wrote it. Loading into another layout reshards (DCP reads the overlapping
chunks).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from .dims import ParallelDims
from .ep import is_expert_param

_OPTIM_TENSORS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _expert_names(model: torch.nn.Module) -> set[str]:
    return {n for n, is_e in is_expert_param(model).items() if is_e}


def to_global(model_sd: dict, optim_sd: dict, model: torch.nn.Module, dims: ParallelDims) -> tuple[dict, dict]:
    """Wrap local expert shards (model and AdamW state) as DTensors sharded over the EP mesh dim."""
    if dims.ep == 1:
        return model_sd, optim_sd
    mesh = dims.expert_mesh()
    placements = [Replicate(), Shard(0)]
    wrap = lambda t: DTensor.from_local(t, mesh, placements, run_check=False)  # noqa: E731
    names = _expert_names(model)
    model_sd = {k: wrap(v) if k in names else v for k, v in model_sd.items()}
    state = {k: ({s: wrap(t) if s in _OPTIM_TENSORS else t for s, t in v.items()} if k in names else v)
             for k, v in optim_sd.get("state", {}).items()}
    return model_sd, {**optim_sd, "state": state}


def to_local(tree: Any) -> Any:
    """Inverse of ``to_global`` after a load: DTensors back to their local shards."""
    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, dict):
        return {k: to_local(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [to_local(v) for v in tree]
    return tree


def like(template: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor with ``template``'s mesh, placements and global shape when ``template`` is one
    (e.g. an EMA of a ZeRO master piece checkpointed like that piece), else ``local`` itself."""
    if not isinstance(template, DTensor):
        return local
    return DTensor.from_local(local, template.device_mesh, template.placements, run_check=False,
                              shape=template.shape, stride=template.stride())
