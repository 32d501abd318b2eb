"""Injected expert all-to-all latency, for overlap measurements on CPU processes (``bench/pipeline_overlap.py``,
``bench/moe_ep.py``, ``tests/test_pipeline_overlap.py``).

``add_latency(model, latency_s)`` replaces every MoE layer's dispatcher by a twin (same state) whose
token-row transfers take ``latency_s`` on the wire: every one over the flat EP group
(``AllToAllDispatcher``), the inter-node hops of ``HierarchicalDispatcher``, and the two cuts (dispatch,
combine) of the single-device ``LocalDispatcher``, where nothing is copied and no communication thread runs:
the host computes alone. Count and id exchanges are not delayed. The latency is a deadline: a transfer
launched at t arrives at t + latency, and waiting for it sleeps only what is left (``Deadline``), so compute
done in between hides it. A forward driven straight through (each cut's link exchanged at once, forward and
backward) pays it all; so does the FP8 hierarchical route, whose ``dispatch`` / ``combine`` run synchronously
with autograd.
"""
from __future__ import annotations

import time
from functools import partial

import torch

from models.moe import LocalDispatcher, MoE
from models.steps import Done, LocalLink
from parallel.ep.dispatch import AllToAllDispatcher, HierarchicalDispatcher
from parallel.ep.links import exchange


class Deadline:
    """A transfer handle that arrives ``latency_s`` after it was wrapped (right after its launch).
    ``injected_s``: read by ``parallel.pipeline.overlap.run_pair``'s timings. ``on_sleep`` gets the seconds
    ``wait()`` slept (the dispatcher's stats count them as time blocked on the transfer)."""

    def __init__(self, handle, latency_s: float, on_sleep=None):
        self.handle, self.injected_s, self.on_sleep = handle, latency_s, on_sleep
        self.due = time.perf_counter() + latency_s

    def wait(self):
        out = self.handle.wait()
        left = self.due - time.perf_counter()
        if left > 0:
            time.sleep(left)
            if self.on_sleep is not None:
                self.on_sleep(left)
        return out


class _Latency:
    """Over the hierarchical dispatcher: its synchronous FP8 route's calls pay the latency once per call,
    forward (counted in the dispatcher's stats, as the time of a blocking transfer) and backward."""
    latency_s = 0.0

    def dispatch(self, x_TD, topk_idx_TK, topk_weight_TK):
        x_RD, tokens_per_expert, handle = super().dispatch(x_TD, topk_idx_TK, topk_weight_TK)
        return self._pay(x_RD, "dispatch_s"), tokens_per_expert, handle

    def combine(self, y_RD, handle):
        return self._pay(super().combine(y_RD, handle), "combine_s")

    def _pay(self, t: torch.Tensor, stat: str) -> torch.Tensor:
        t0 = time.perf_counter()
        time.sleep(self.latency_s)
        setattr(self.stats, stat, getattr(self.stats, stat) + time.perf_counter() - t0)
        if t.requires_grad:   # the gradient's transfer back: synchronous too
            t.register_hook(lambda g: time.sleep(self.latency_s))
        return t


class AllToAllWithLatency(AllToAllDispatcher):
    latency_s = 0.0

    def start(self, rows, plan, direction):
        kind = "combine_s" if direction.startswith("combine") else "dispatch_s"
        return Deadline(super().start(rows, plan, direction), self.latency_s, partial(self.stats.add_time, kind))


class HierarchicalWithLatency(_Latency, HierarchicalDispatcher):
    def start(self, rows, out_splits, in_splits, hop, count=None, stat: str = "dispatch_s"):
        handle = super().start(rows, out_splits, in_splits, hop, count, stat)
        return Deadline(handle, self.latency_s, partial(self.stats.add_time, stat)) if hop == "inter" else handle


class LocalLinkWithLatency(LocalLink):
    """``LocalLink`` whose rows arrive ``latency_s`` after the launch, both ways; called straight through it
    waits for them at once, forward and backward (``exchange``), as an all-to-all's link does."""

    def __init__(self, latency_s: float):
        self.latency_s = latency_s

    def __call__(self, sends):
        return exchange(self, sends)

    def start(self, sends):
        return Deadline(Done([t.detach() for t in sends]), self.latency_s)

    def reverse(self, grads):
        return Deadline(Done(list(grads)), self.latency_s)


class LocalWithLatency(LocalDispatcher):
    latency_s = 0.0

    def link(self):
        return LocalLinkWithLatency(self.latency_s)


def with_latency(dispatcher, latency_s: float):
    """The latency twin of ``dispatcher``, sharing its state (groups, stats, name)."""
    twin_cls = {AllToAllDispatcher: AllToAllWithLatency, HierarchicalDispatcher: HierarchicalWithLatency,
                LocalDispatcher: LocalWithLatency}
    twin = object.__new__(twin_cls[type(dispatcher)])
    twin.__dict__.update(vars(dispatcher))
    twin.latency_s = latency_s
    return twin


def add_latency(model: torch.nn.Module, latency_s: float) -> torch.nn.Module:
    """Give every MoE layer ``latency_s`` per token-row transfer (none when 0)."""
    if latency_s:
        for moe in model.modules():
            if isinstance(moe, MoE) and type(moe.dispatcher) in (AllToAllDispatcher, HierarchicalDispatcher,
                                                                 LocalDispatcher):
                moe.dispatcher = with_latency(moe.dispatcher, latency_s)
    return model
