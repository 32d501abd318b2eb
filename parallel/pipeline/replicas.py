"""Parameters held by more than one pipeline rank and the sums that keep them identical.

DualPipe holds every stage twice (rank r and rank pp-1-r); 1F1B/ZB1P with MTP hold a tied copy of
the embedding on the last stage. The gradient (and the MoE token counts) of such a tensor is the sum
over its holders; after that sum every holder applies the same update, so the copies never drift.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import models
from models.config import ModelConfig

from ..dims import ParallelDims
from .schedules import Schedule
from .stages import build_stages, prune_model


def holders(cfg: ModelConfig, schedule: Schedule, layout: list[int] | None = None) -> dict[str, tuple[int, ...]]:
    """Tensor name (parameters and buffers) -> the pipeline ranks that hold it."""
    held: dict[str, list[int]] = {}
    for r in range(schedule.pp):
        model = models.build(cfg, "meta")
        prune_model(model, build_stages(model, schedule, r, layout))
        names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
        for n in names:
            held.setdefault(n, []).append(r)
    return {n: tuple(rs) for n, rs in held.items()}


def sum_dtype(n_holders: int, tensors: list[torch.Tensor]) -> torch.dtype:
    """The dtype a replica sum travels in. Two FP32 holders: FP32, as ``a + b`` rounded once to FP32 equals it
    summed in FP64 and rounded back (double rounding through binary64 is innocuous for one addition, 53 >= 2 x 24
    + 2): DualPipe's twin stages sync their gradients at half the bytes, bit for bit as before. More holders, or
    other dtypes: FP64, so that the order of the additions does not show."""
    if n_holders == 2 and all(t.dtype == torch.float32 for t in tensors):
        return torch.float32
    return torch.float64


class ReplicaSync:
    """Process groups for each holder set of this rank (built once, on every rank, same order)."""

    def __init__(self, cfg: ModelConfig, schedule: Schedule, dims: ParallelDims, layout: list[int] | None = None):
        self.holders = holders(cfg, schedule, layout)
        self.groups: dict[tuple[int, ...], object] = {}
        for hs in sorted({h for h in self.holders.values() if len(h) > 1}):
            for d in range(dims.dp):
                ranks = [p * dims.dp + d for p in hs]
                g = dims.new_group(ranks, f"replicas {list(hs)}")
                if dims.rank in ranks:
                    self.groups[hs] = g

    def sum_(self, named: dict[str, torch.Tensor]) -> None:
        """In place: each tensor becomes the sum over the ranks holding it."""
        by_group: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for name in sorted(named):
            hs = self.holders[name]
            if len(hs) > 1:
                by_group.setdefault(hs, []).append(named[name])
        for hs, tensors in by_group.items():
            flat = torch.cat([t.reshape(-1).to(sum_dtype(len(hs), tensors)) for t in tensors])
            dist.all_reduce(flat, group=self.groups[hs])
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def sum_grads(self, model: nn.Module) -> None:
        grads = {}
        for n, p in model.named_parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads[n] = p.grad
        self.sum_(grads)

    def weight(self, name: str) -> float:
        """1 / number of holders: counts a replicated tensor once in a sum over pipeline ranks."""
        return 1.0 / len(self.holders[name])
