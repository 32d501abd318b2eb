"""Autograd-aware uneven all-to-all over a process group, with an optional async launch.

Shapes: rows are dim 0; ``out_splits[i]`` rows arrive from rank i, ``in_splits[i]`` rows go to rank i.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist


@contextlib.contextmanager
def named_errors(name: str, rank: int):
    """Re-raise communication failures (timeouts, dead peers) naming the rank and the MoE layer."""
    try:
        yield
    except RuntimeError as e:
        raise RuntimeError(f"expert all-to-all of {name} failed on rank {rank}: {str(e).splitlines()[0]} "
                           f"(a peer may have died, timed out, or skipped this layer)") from e


class Pending:
    """A launched collective; ``wait()`` blocks until its output tensor is valid."""

    def __init__(self, work=None):
        self.work = work

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, latency_s, pending, name, bwd_group):
        ctx.out_splits, ctx.in_splits, ctx.latency_s, ctx.name = out_splits, in_splits, latency_s, name
        ctx.group = bwd_group if bwd_group is not None else group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group,
                                      async_op=pending is not None)
        if latency_s:
            time.sleep(latency_s)   # injected link latency, for overlap measurements on CPU
        if pending is not None:
            pending.work = work
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        with named_errors(f"{ctx.name} (backward)", dist.get_rank()):
            dist.all_to_all_single(out, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        if ctx.latency_s:
            time.sleep(ctx.latency_s)
        return out, None, None, None, None, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, latency_s: float = 0.0,
               pending: Pending | None = None, name: str = "moe", bwd_group=None) -> torch.Tensor:
    """Differentiable ``all_to_all_single``. With ``pending``, returns at once; wait on it before use.

    ``bwd_group``: a twin of ``group`` used by the backward pass, so a backward running in another
    thread (DualPipe's overlapped F&B) never interleaves its collectives with the forward's."""
    return _AllToAll.apply(x, out_splits, in_splits, group, latency_s, pending, name, bwd_group)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """``counts [P, ...]`` (row i = what this rank sends to rank i) -> row i = what rank i sends here."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out
