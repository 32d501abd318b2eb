"""The native ZeRO optimizer's layout (``native.py``): which piece of every parameter each rank owns, and
the buckets that group the pieces for one reduce-scatter / all-gather each.

Every parameter is cut into ``torch.chunk``-style pieces along one dimension, so checkpoints are plain
DTensors that DCP reshards:

* dense: dim 0, over the (edp, ep) mesh of the stage, i.e. placements ``[Shard(0), Shard(0)]``
  (rank ``dp_rank = edp_index * ep + ep_index`` holds the ``dp_rank``-th nested chunk);
* experts (local shape ``[E/ep, a, b]``): dim 1 over edp, on top of EP's dim-0 split, i.e.
  ``[Shard(1), Shard(0)]`` on (edp, ep) — the expert dimension is often smaller than edp, the
  feature dimensions are not.

A bucket (same reduce group, weight decay and dtype; about ``bucket_mb`` of FP32 gradients) is one
``[k, S]`` buffer for a group of ``k`` ranks: row ``i`` holds rank ``i``'s pieces of all the bucket's
parameters (each padded to the largest piece).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..dims import ParallelDims
from ..ep import is_expert_param


def chunk_range(n: int, k: int, i: int) -> tuple[int, int]:
    """(start, length) of piece ``i`` of ``n`` elements cut into ``k`` (``torch.chunk`` / DTensor ``Shard``)."""
    size = -(-n // k) if n else 0
    start = min(i * size, n)
    return start, max(0, min(n, start + size) - start)


@dataclass
class Slot:
    """One parameter inside a bucket: its pieces (one per rank of the reduce group) and place in a row."""
    name: str
    param: nn.Parameter
    dim: int                                   # the dimension cut into pieces
    index: list[tuple]                         # per group rank: the piece's index into the local parameter
    shapes: list[tuple[int, ...]]              # per group rank: the piece's shape
    numels: list[int]
    offset: int = 0                            # start of this parameter's slot in each row
    weight: float = 1.0                        # 1 / pipeline holders (global norm)

    @property
    def slot(self) -> int:
        return max(self.numels)


@dataclass
class Bucket:
    kind: str                                  # "dense" | "expert"
    weight_decay: float
    group: object
    k: int                                     # ranks in the reduce group
    me: int                                    # this rank's index in it
    slots: list[Slot] = field(default_factory=list)
    size: int = 0                              # S: row length
    master: torch.Tensor | None = None
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    grad: torch.Tensor | None = None           # reduced gradient shard (fp32), accumulated
    ready: int = 0                             # stage-2 hooks: parameters accumulated this backward

    def mine(self, t: torch.Tensor, s: Slot) -> torch.Tensor:
        """This rank's piece of slot ``s`` inside a row-sized flat tensor, shaped like the piece."""
        return t[s.offset:s.offset + s.numels[self.me]].view(s.shapes[self.me])


def build_buckets(model: nn.Module, dims: ParallelDims, weight_decay: float, bucket_mb: float,
                  grad_weight) -> list[Bucket]:
    """The buckets of ``model``'s trainable parameters, in reverse registration order (roughly the order
    gradients become final in a backward); ``grad_weight(name)``: 1 / pipeline holders, or None."""
    d = dims
    expert = is_expert_param(model)
    groups = {"dense": (d.group("dp") if d.dp > 1 else None, d.dp, d.dp_rank),
              "expert": (d.group("edp") if d.edp > 1 else None, d.edp, d.dp_rank // d.ep)}
    limit = bucket_mb * 2**20
    open_: dict[tuple, Bucket] = {}
    buckets: list[Bucket] = []
    for name, p in reversed(list(model.named_parameters())):
        if not p.requires_grad:
            continue
        if p.dim() == 0:
            raise ValueError(f"ZeRO: parameter {name} is a scalar; shard-able parameters need >= 1 dim")
        kind = "expert" if expert[name] else "dense"
        wd = weight_decay if p.dim() >= 2 else 0.0
        group, k, me = groups[kind]
        dim = 1 if kind == "expert" and p.dim() >= 2 else 0
        slot = _slot(dims, name, p, dim, kind, k)
        slot.weight = grad_weight(name) if grad_weight else 1.0
        key = (kind, wd, p.dtype)
        b = open_.get(key)
        if b is None or (b.size and (b.size + slot.slot) * k * 4 > limit):
            b = open_[key] = Bucket(kind, wd, group, k, me)
            buckets.append(b)
        slot.offset = b.size
        b.size += slot.slot
        b.slots.append(slot)
    return buckets


def _slot(d: ParallelDims, name: str, p: torch.Tensor, dim: int, kind: str, k: int) -> Slot:
    index, shapes, numels = [], [], []
    n = p.shape[dim]
    for i in range(k):
        if kind == "dense":   # nested chunks: over edp first, then over ep (DTensor [Shard(0), Shard(0)])
            e, r = divmod(i, d.ep)
            s0, l0 = chunk_range(n, d.edp, e)
            s1, l1 = chunk_range(l0, d.ep, r)
            start, length = s0 + s1, l1
        else:
            start, length = chunk_range(n, k, i)
        idx = tuple([slice(None)] * dim + [slice(start, start + length)])
        shape = tuple(p.shape[:dim]) + (length,) + tuple(p.shape[dim + 1:])
        index.append(idx)
        shapes.append(shape)
        numels.append(math.prod(shape))
    return Slot(name, p, dim, index, shapes, numels)
