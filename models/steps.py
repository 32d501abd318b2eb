"""Forwards written once, as *steps*: generators that stop wherever tokens must travel.

A MoE layer's dispatcher moves token rows to the experts and back. The forwards of ``MoE``, ``Block``,
``MTPModule`` and the loss (``models/transformer.py``) are generators that, at each such boundary,
yield a ``Cut``: the rows to send, the ``link`` that moves them, and the ``carry`` (live tensors the code
needs after the cut). They receive ``(carry, received)`` back and compute on.

``drive(steps)`` runs a generator straight through: every link exchanges its rows at once, with autograd,
and the carry comes back unchanged. That is the single-device forward (``LocalLink`` moves nothing) and
expert parallelism without a pipeline. A pipeline (``parallel/pipeline/overlap.py``) drives the same
generators piecewise instead: it ends an autograd piece at each cut, launches the link asynchronously,
hands back detached leaves, and computes another micro-batch meanwhile.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator, Protocol

import torch

Steps = Generator["Cut", Any, Any]   # yields cuts, receives (carry, received), returns the forward's result


class Handle(Protocol):
    def wait(self) -> list[torch.Tensor]: ...


class Link(Protocol):
    """How a cut's rows travel (a dispatcher hop; ``LocalLink`` on one device)."""

    def __call__(self, sends: list[torch.Tensor]) -> list[torch.Tensor]:
        """Exchange at once, differentiably (the straight-through path)."""

    def start(self, sends: list[torch.Tensor]) -> Handle:
        """Launch outside autograd; ``wait()`` gives the received tensors, one per send."""

    def reverse(self, grads: list[torch.Tensor]) -> Handle:
        """Launch the way back of the gradients of the received floating tensors that need one;
        ``wait()`` gives the gradients of the matching sends."""


@dataclass
class Cut:
    carry: tuple                 # tensors (or None) the code needs after the cut
    sends: list[torch.Tensor]    # what travels
    link: Link


class Done:
    """A handle with nothing in flight."""

    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


class LocalLink:
    """Nothing travels: the received rows are the sent ones. Keeps the single-device forward cut where
    expert parallelism cuts it, so the piecewise pipeline path runs (and is tested) without EP."""

    def __call__(self, sends):
        return list(sends)

    def start(self, sends):
        return Done([t.detach() for t in sends])

    def reverse(self, grads):
        return Done(list(grads))


def pump(steps: Steps, answer: Callable[[Any], Any]) -> Any:
    """Run a generator to its end, sending back ``answer(what it yielded)`` each time; returns its result."""
    value = None
    while True:
        try:
            value = answer(steps.send(value))
        except StopIteration as stop:
            return stop.value


def drive(steps: Steps) -> Any:
    """Run ``steps`` straight through: each cut's link exchanges at once; returns the result."""
    return pump(steps, lambda cut: (cut.carry, cut.link(cut.sends)))


def carrying(steps: Steps, carry: tuple) -> Steps:
    """``steps`` with ``carry`` (the caller's live tensors) added to each of its cuts, so that a piecewise
    driver can replace them too. Returns ``(result, carry after the last cut)``."""
    value = None
    while True:
        try:
            cut = steps.send(value)
        except StopIteration as stop:
            return stop.value, carry
        n = len(cut.carry)
        new, received = yield Cut((*cut.carry, *carry), cut.sends, cut.link)
        value, carry = (tuple(new[:n]), received), tuple(new[n:])


__all__ = ["Steps", "Cut", "Link", "LocalLink", "Done", "pump", "drive", "carrying"]
