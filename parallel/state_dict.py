"""Checkpoint views of a parallelised model: expert shards become DTensors, so DCP stores every tensor
under the single-device model's name and global shape (``layers.3.ffn.experts.w13`` is ``[E, 2F, D]``),
whatever the layout that wrote it. Loading into another layout reshards (DCP reads the overlapping
chunks). A checkpoint written before two parameters became one stacked parameter (``STACKED``: ``w13``, the gate
and up projections) loads through ``stacked_from_older``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Collection, Iterator

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


# A parameter that stacks two older ones along dim -2 -> their names in checkpoints written before it existed.
STACKED = {"w13": ("w1", "w3")}   # models.layers.MLP, models.moe.GroupedExperts: gate and up projections


def _older_names(key: str) -> tuple[str, str] | None:
    parts = key.split(".")
    hit = next((i for i, p in enumerate(parts) if p in STACKED), None)
    if hit is None:
        return None
    return tuple(".".join(parts[:hit] + [old] + parts[hit + 1:]) for old in STACKED[parts[hit]])


def _half(v: Any, i: int, where: str) -> Any:
    """Half ``i`` of ``v`` along dim -2 as a view (a DTensor's of its local piece), recursively through a dict;
    a scalar (an optimizer's step) as itself for the first half, a copy for the second."""
    if isinstance(v, dict):
        return {k: _half(t, i, f"{where}.{k}") for k, t in v.items()}
    if not isinstance(v, torch.Tensor) or v.dim() < 2:
        return v if i == 0 or not isinstance(v, torch.Tensor) else v.clone()
    if not isinstance(v, DTensor):
        return v.chunk(2, dim=-2)[i]
    if any(p.is_shard(v.dim() - 2) or p.is_shard(-2) for p in v.placements):
        raise ValueError(f"{where}: the checkpoint holds it as two tensors (written before they were stacked), and "
                         f"this layout shards the stacked one along the stacking dimension; resume once with "
                         f"another layout (e.g. parallel.zero=0) and save")
    shape = (*v.shape[:-2], v.shape[-2] // 2, v.shape[-1])
    return DTensor.from_local(v.to_local().chunk(2, dim=-2)[i], v.device_mesh, v.placements, run_check=False,
                              shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())


@contextlib.contextmanager
def stacked_from_older(state: dict, saved: Collection[str]) -> Iterator[None]:
    """Inside it, ``state`` (a nested dict of what a DCP load fills) names every stacked parameter (``STACKED``)
    that the checkpoint holds only under its older names (``saved``: the checkpoint's flattened keys) by those
    names, each a view of its half of the stacked tensor: loading fills the stacked tensors in place. On exit
    ``state`` has its own keys again."""
    saved = set(saved)
    undo = []

    def holds(key: str) -> bool:
        return key in saved or any(k.startswith(key + ".") for k in saved)

    def walk(d: dict, prefix: str) -> None:
        for k in list(d):
            old = _older_names(k)
            if old is not None and not holds(prefix + k) and all(holds(prefix + o) for o in old):
                v = d.pop(k)
                d.update({o: _half(v, i, prefix + k) for i, o in enumerate(old)})
                undo.append((d, k, v, old))
            elif isinstance(d[k], dict):
                walk(d[k], f"{prefix}{k}.")
    walk(state, "")
    try:
        yield
    finally:
        for d, k, v, old in reversed(undo):
            for o in old:
                d.pop(o, None)
            d[k] = v
