"""How a cut's rows travel (``models.steps.Link``) for the expert-parallel dispatchers (``dispatch.py``).

A link launches its all-to-alls outside autograd (``start``), sends the gradients back the reverse way
(``reverse``), or, called, does both around a differentiable exchange (``exchange``): the straight-through
forward. ``Handle`` is what ``start`` / ``reverse`` return.
"""
from __future__ import annotations

import time

import torch

from .comm import Pending, named_errors


class Handle:
    """Launched all-to-alls (``pending``); ``wait()`` blocks on them, then returns ``finish()``. Errors name the
    layer; ``on_wait`` gets the seconds it blocked (the dispatchers' timing stats)."""

    def __init__(self, finish, pending: Pending, name: str = "moe", rank: int = 0, on_wait=None):
        self._finish, self._pending, self._name, self._rank = finish, pending, name, rank
        self._on_wait = on_wait   # called with the seconds ``wait()`` blocked

    def wait(self):
        t0 = time.perf_counter()
        with named_errors(self._name, self._rank):
            self._pending.wait()
            out = self._finish()
        if self._on_wait is not None:
            self._on_wait(time.perf_counter() - t0)
        return out


class _Exchange(torch.autograd.Function):
    """A cut link's transfer with autograd (``models.steps.Link``): forward launches it and waits, backward
    launches the gradients' way back (``link.reverse``) and waits. Floating sends that need a gradient get
    one; a received row nobody used gets a zero gradient, so every rank issues the same collectives."""

    @staticmethod
    def forward(ctx, link, *sends):
        ctx.link = link
        ctx.diff = [need and t.is_floating_point() for need, t in zip(ctx.needs_input_grad[1:], sends)]
        received = link.start(list(sends)).wait()
        ctx.mark_non_differentiable(*(r for r, d in zip(received, ctx.diff) if not d))
        return tuple(received)

    @staticmethod
    def backward(ctx, *grads):
        back = iter(ctx.link.reverse([g for g, d in zip(grads, ctx.diff) if d]).wait())
        return (None, *(next(back) if d else None for d in ctx.diff))


def exchange(link, sends: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run ``link``'s transfer of ``sends`` now, differentiably: what a straight-through cut does."""
    return list(_Exchange.apply(link, *sends))


class FlatLink:
    """One all-to-all of the flat route (``AllToAllDispatcher.start``), ``direction`` dispatch or combine."""

    def __init__(self, d, plan, direction: str):
        self.d, self.plan, self.direction = d, plan, direction

    def __call__(self, sends):
        return exchange(self, sends)

    def start(self, sends):
        return self.d.start(sends[0], self.plan, self.direction)

    def reverse(self, grads):
        return self.d.start(grads[0], self.plan, self.direction + "_grad")


class HopLink:
    """One hop of the hierarchical route (``HierarchicalDispatcher.start``): ``sends`` over ``hop``'s group."""

    def __init__(self, d, out_splits, in_splits, hop: str, count, stat: str):
        self.d, self.splits, self.hop, self.count, self.stat = d, (out_splits, in_splits), hop, count, stat

    def __call__(self, sends):
        return exchange(self, sends)

    def start(self, sends):
        return self.d.start(sends, *self.splits, self.hop, self.count, self.stat)

    def reverse(self, grads):
        return self.d.start(grads, *reversed(self.splits), self.hop, None, self.stat)
