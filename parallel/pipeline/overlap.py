"""Piecewise stage execution: the mechanics behind DualPipe's overlapped forward + backward (F&B).

The model's forward is written once, as steps that yield a ``Cut`` wherever a MoE dispatcher moves tokens
(``models/steps.py``; the cuts come from the dispatcher's ``route``). Here a stage's steps are driven
*piecewise*: each cut ends an autograd piece. Per MoE block with the flat dispatcher:

    piece A  (previous combine's result ->) attention + residual, FFN norm, gate, routing plan
             ----- dispatch all-to-all in flight ----->
    piece E  routed experts on the received token copies
             ----- combine all-to-all in flight ------>
    piece C  un-sort + gate weighting, shared experts, residual (-> the next block's piece A ...)

(the hierarchical dispatcher cuts at each of its four hops; the single-device ``LocalDispatcher`` cuts at
the same places with nothing in flight). The next piece starts from detached leaves (``requires_grad``)
of the cut's carried tensors and received rows (a carried tensor that already is such a leaf, passed on by a
piece that does not use it, stays that leaf), and the link runs outside autograd (``Link.start``). So
the backward runs piece by piece in reverse and issues the gradients' all-to-alls itself
(``Link.reverse``), asynchronously, like the forward's. A tape made with ``cuts=False`` records the same
steps as one piece (each link exchanged at once, with autograd): where nothing can overlap.

Forward (``record``) and backward (``backward_steps``) are *step generators* here too: each computes up to
the launch of its next all-to-all and yields the handle. ``run_pair`` alternates two of them (an F&B's
forward of micro-batch a and full backward of micro-batch b): while one generator's all-to-all is in flight
the other computes its next piece, then the handle is waited for. ``run`` drives one alone (launch, then
wait at once). The order of collectives depends only on the model's structure, so every rank of an EP
group issues them in the same order.

B / W split: ``backward_steps(..., inputs=...)`` differentiates, piece by piece, only each piece's input
leaves and the parameters ``inputs`` adds (the stage's non-deferred ones); the deferred weight GEMMs wait in
a ``WeightGradQueue`` (``parallel/wgrad.py``) that W runs later. Either way a piece's graph is freed by its
backward. The backward half of an F&B is a full backward (``Kind.FB``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator

import torch
from torch.autograd.graph import _engine_run_backward

from models.steps import Cut, Link, pump

Steps = Generator[Any, Any, Any]   # yields handles (``.wait()`` -> tensors), receives their results


@dataclass
class Piece:
    inputs: list[torch.Tensor]                     # leaves made at its start: carried tensors, then received rows
    n_recv: int = 0                                # how many of ``inputs`` came through the link
    outputs: list[torch.Tensor] = field(default_factory=list)   # aligned with the next piece's inputs
    link: Link | None = None                       # the transfer to the next piece


def _diff(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad


class Tape:
    """The pieces of one micro-batch's forward through one stage. ``x``: the stage input leaf (None on the
    first stage). ``cuts=False``: one piece, every link exchanged at once with autograd (as the forward
    straight through): nothing can overlap, and the backward is one autograd pass."""

    def __init__(self, x: torch.Tensor | None, cuts: bool = True):
        self.pieces = [Piece([x] if x is not None else [])]
        self.cuts = cuts
        self._leaves = {id(x)} if x is not None else set()   # every leaf the tape made (alive until backward)

    def cut(self, cut: Cut) -> Steps:
        """End the current piece and launch ``cut``'s link. Yields its handle; returns ``(carry,
        received)`` for the steps generator, as leaves of the next piece where differentiable."""
        if not self.cuts:
            return cut.carry, cut.link(cut.sends)
        cur = self.pieces[-1]
        # a carried leaf of this tape (a piece that only passes it on) stays that leaf: its gradient accumulates
        # in its .grad across the pieces that use it, without a root, a new leaf and a gradient copy per cut
        keep = [i for i, t in enumerate(cut.carry) if _diff(t) and id(t) not in self._leaves]
        sent = [j for j, t in enumerate(cut.sends) if _diff(t)]
        cur.outputs = [cut.carry[i] for i in keep] + [cut.sends[j] for j in sent]
        cur.link = cut.link
        received = list((yield cut.link.start(cut.sends)))
        carry = list(cut.carry)
        for i in keep:
            carry[i] = carry[i].detach().requires_grad_()
        for j in sent:
            received[j] = received[j].detach().requires_grad_()
        leaves = [carry[i] for i in keep] + [received[j] for j in sent]
        self._leaves.update(map(id, leaves))
        self.pieces.append(Piece(leaves, len(sent)))
        return tuple(carry), received

    def finish(self, outputs: list[torch.Tensor | None]) -> None:
        """The stage's results (its output, its balance losses), which the backward seeds."""
        self.pieces[-1].outputs = list(outputs)


def record(steps: Steps, tape: Tape) -> Steps:
    """Drive a model steps generator (``models.steps``) piecewise on ``tape``: yields the handles of the
    launched all-to-alls; returns the generator's result."""
    value = None
    while True:
        try:
            cut = steps.send(value)
        except StopIteration as stop:
            return stop.value
        value = yield from tape.cut(cut)


# ----------------------------------------------------------------------------------- backward pieces
def _roots(piece: Piece, grads: list[torch.Tensor | None]) -> tuple[list, list]:
    roots, gs = [], []
    for t, g in zip(piece.outputs, grads):
        if g is not None and t is not None and t.requires_grad:
            roots.append(t)
            gs.append(g)
    return roots, gs


def backward_steps(tape: Tape, out_grads: list[torch.Tensor | None],
                   inputs: Callable[[list], list] | None = None) -> Steps:
    """Backward of one stage forward, piece by piece from the last, as steps (yields the handles of the
    gradients' all-to-alls). ``out_grads``: the gradients of ``tape.finish``'s outputs (None: none).
    ``inputs`` None: every gradient (BW, the backward of an F&B). Else B of the zero-bubble split: each
    piece differentiates only ``inputs(piece input leaves)`` (``WeightGradQueue.b_inputs``: the leaves and
    the stage's non-deferred parameters). The stage input's gradient lands in ``.grad`` of the leaf the tape
    was made with. Each piece's graph is freed by its backward."""
    grads: list[torch.Tensor | None] = list(out_grads)
    for i in range(len(tape.pieces) - 1, -1, -1):
        p = tape.pieces[i]
        roots, gs = _roots(p, grads)
        if roots:
            # B: every leaf still alive (a piece also uses the leaves earlier cuts made and the cuts since passed on)
            wanted = None if inputs is None else inputs([t for q in tape.pieces[:i + 1] for t in q.inputs])
            if wanted is not None and not wanted:
                raise RuntimeError(f"B of piece {i}: no input leaf and no non-deferred parameter to differentiate "
                                   "(its deferred weight GEMMs would never be queued)")
            # torch.autograd.backward less its per-call argument massaging (``_make_grads``'s shape checks in
            # Python; the engine validates the shapes itself): a fixed cost paid once per piece
            _engine_run_backward(tuple(roots), tuple(gs), False, False, () if wanted is None else tuple(wanted),
                                 allow_unreachable=True, accumulate_grad=True)
        p.outputs = []
        if i == 0:
            break
        prev = tape.pieces[i - 1]
        in_grads = [t.grad for t in p.inputs]
        k = len(in_grads) - p.n_recv
        g_recv = [g if g is not None else torch.zeros_like(t) for g, t in zip(in_grads[k:], p.inputs[k:])]
        g_send = (yield prev.link.reverse(g_recv)) if g_recv else []   # nothing differentiable crossed: no transfer
        grads = in_grads[:k] + list(g_send)
        prev.link = None
        p.inputs = p.inputs[:0]


# --------------------------------------------------------------------------------------------- drivers
def run(steps: Steps) -> Any:
    """Drive one step generator alone: every all-to-all is waited for right after its launch."""
    return pump(steps, lambda handle: handle.wait())


def run_pair(a: Steps, b: Steps, timings: list | None = None) -> tuple[Any, Any]:
    """Drive two step generators interleaved: a computes up to its all-to-all launch, b computes (a's
    transfer in flight) up to its own launch, a waits for its transfer and computes on, and so on. When
    one finishes the other runs alone. Returns both generators' results.

    ``timings``: if given, gets ``(i, compute_s, wait_s, injected_s)`` per step of generator i (0 = a):
    the seconds spent computing its piece and, before it, waiting for its previous transfers, and the
    latency a benchmark injected into those (``handle.injected_s``, see ``bench/latency.py``; 0 for real
    transfers, None when the step waited for nothing)."""
    gens, handles, done, results = [a, b], [None, None], [False, False], [None, None]
    while not all(done):
        for i in (0, 1):
            if done[i]:
                continue
            t0 = time.perf_counter()
            h = handles[i]
            value = h.wait() if h is not None else None
            t1 = time.perf_counter()
            try:
                handles[i] = gens[i].send(value)
            except StopIteration as stop:
                done[i], results[i] = True, stop.value
            if timings is not None:
                timings.append((i, time.perf_counter() - t1, t1 - t0,
                                None if h is None else getattr(h, "injected_s", 0.0)))
    return results[0], results[1]


__all__ = ["Tape", "record", "backward_steps", "run", "run_pair"]
