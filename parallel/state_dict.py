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


# A parameter that stacks older ones along dim -2 -> their names in checkpoints written before it existed, the first
# held one of each alternative (models.layers.MLP and models.moe.GroupedExperts: gate and up projections;
# models.attention.MLA: the query projection, wq_a or without q_lora_rank wq, and the key/value one).
STACKED = {"w13": [("w1", "w3")], "wqkv_a": [("wq_a", "wkv_a"), ("wq", "wkv_a")]}


def _alternatives(key: str) -> list[tuple[str, ...]]:
    parts = key.split(".")
    hit = next((i for i, p in enumerate(parts) if p in STACKED), None)
    if hit is None:
        return []
    return [tuple(".".join(parts[:hit] + [old] + parts[hit + 1:]) for old in olds) for olds in STACKED[parts[hit]]]


def _part(v: Any, start: int, rows: int, where: str) -> Any:
    """Rows ``[start, start + rows)`` of ``v`` along dim -2 as a view (a DTensor's of its local piece), recursively
    through a dict; a scalar (an optimizer's step) as itself for the first part, a copy for the others."""
    if isinstance(v, dict):
        return {k: _part(t, start, rows, f"{where}.{k}") for k, t in v.items()}
    if not isinstance(v, torch.Tensor) or v.dim() < 2:
        return v if start == 0 or not isinstance(v, torch.Tensor) else v.clone()
    if not isinstance(v, DTensor):
        return v.narrow(-2, start, rows)
    if any(p.is_shard(v.dim() - 2) or p.is_shard(-2) for p in v.placements):
        raise ValueError(f"{where}: the checkpoint holds it as separate tensors (written before they were stacked), "
                         f"and this layout shards the stacked one along the stacking dimension; resume once with "
                         f"another layout (e.g. parallel.zero=0) and save")
    shape = (*v.shape[:-2], rows, v.shape[-1])
    return DTensor.from_local(v.to_local().narrow(-2, start, rows), v.device_mesh, v.placements, run_check=False,
                              shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())


@contextlib.contextmanager
def stacked_from_older(state: dict, saved: dict[str, tuple | None]) -> Iterator[None]:
    """Inside it, ``state`` (a nested dict of what a DCP load fills) names every stacked parameter (``STACKED``)
    that the checkpoint holds only under its older names by those names, each a view of its rows of the stacked
    tensor (as many as the checkpoint's tensor of that name has along dim -2), so that loading fills the stacked
    tensors in place. ``saved``: the checkpoint's flattened keys and their shapes (``checkpoint.state_keys``). On
    exit ``state`` has its own keys again."""
    undo = []
    rows: dict[str, int | None] = {}   # every key and dict name saved -> dim -2 of a 2-D+ tensor under it (or None)
    for k, shape in saved.items():
        parts = k.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if rows.get(name) is None:
                rows[name] = shape[-2] if shape is not None and len(shape) >= 2 else None

    def walk(d: dict, prefix: str) -> None:
        for k in list(d):
            olds = next((o for o in _alternatives(prefix + k) if all(n in rows for n in o)), None)
            if olds is not None and prefix + k not in rows:
                v, names = d.pop(k), [n[len(prefix):] for n in olds]
                sizes = [rows[n] for n in olds]   # each one's rows in the checkpoint
                starts = [sum(sizes[:i]) for i in range(len(sizes))]
                d.update({n: _part(v, a, r, prefix + k) for n, a, r in zip(names, starts, sizes)})
                undo.append((d, k, v, names))
            elif isinstance(d[k], dict):
                walk(d[k], f"{prefix}{k}.")
    walk(state, "")
    try:
        yield
    finally:
        for d, k, v, names in reversed(undo):
            for n in names:
                d.pop(n, None)
            d[k] = v
