"""Piecewise stage execution: DualPipe's overlapped forward + backward (F&B) in one thread.

A stage's forward is cut at its expert all-to-alls into *pieces*. Per MoE block:

    piece A  (previous combine's result ->) attention + residual, FFN norm, gate, routing plan, gather
             ----- dispatch all-to-all in flight ----->
    piece E  routed experts on the received token copies
             ----- combine all-to-all in flight ------>
    piece C  un-sort + gate weighting, shared experts, residual (-> the next block's piece A ...)

(the hierarchical dispatcher adds a forwarder piece on each side of E: four all-to-alls per block).

Pieces with no all-to-all between them run as one (dense blocks, the embedding, the head and the loss;
MTP blocks are cut like main blocks). Every piece boundary is an autograd boundary: the next piece starts
from detached leaves (``requires_grad``) of the previous piece's live tensors, and the all-to-all itself
runs outside autograd on detached rows (``AllToAllDispatcher.start``). So the backward runs piece by
piece in reverse and issues the all-to-alls of the gradients (reverse splits: combine's gradient, then
dispatch's) itself, asynchronously, like the forward's.

Forward and backward are *step generators*: each runs compute up to the launch of its next all-to-all
and yields the handle. ``run_pair`` alternates two of them (an F&B's forward of micro-batch a and full
backward of micro-batch b): while one generator's all-to-all is in flight the other computes its next
piece, then the handle is waited for. ``run`` drives one generator alone (launch, then wait at once),
which is what plain F / BW / B / W actions do. The order of collectives depends only on the model's
structure, so every rank of an EP group issues them in the same order.

Routing uses the MoE layer's dispatcher: ``AllToAllDispatcher`` (also FP8) through its ``plan`` / ``start``
split, the single-device ``LocalDispatcher`` (EP=1 without a dispatcher group) with the same cuts and no
transfer, and ``HierarchicalDispatcher`` cut at each of its four hops (``plan_nodes`` / ``plan_forward`` /
``start``). A hierarchical dispatcher with FP8 (one quantised route across both hops) or any other
dispatcher runs its whole MoE block inside one piece, with the autograd (synchronous) all-to-alls:
correct, nothing hidden. The code mirrors ``Block.forward``,
``MoE.forward``, ``MTPModule.forward`` and ``head_loss`` (``models/``); the pipeline parity tests, run with
overlap on and off, pin that they compute the same thing.

B / W split: ``backward_steps(..., mode="input")`` computes, piece by piece, only the gradients of each
piece's inputs (keeping the graphs); ``weight_backward`` later runs every piece's backward for the
parameters. The backward half of an F&B is a full backward (``Kind.FB``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator

import torch

from models.layers import rope_cos_sin
from models.moe import LocalDispatcher, MoE, expert_counts, sequence_balance_loss
from models.transformer import _ce

from ..ep.dispatch import AllToAllDispatcher, HierarchicalDispatcher, RoutePlan, unsort_and_weight
from .stages import Stage

Steps = Generator[Any, Any, Any]   # yields handles (``.wait()`` -> tensor), receives their results


# ---------------------------------------------------------------------------------------------- records
@dataclass
class Link:
    """All-to-alls between two pieces, left in flight: ``send`` (tensors of the earlier piece; the
    floating ones are differentiable, the others metadata), ``handle.wait()`` gives the received tensors
    in order, and ``reverse(grads of the received floating tensors)`` launches the gradients' way back
    and returns a handle whose ``wait()`` gives the gradients of the floating ``send`` tensors."""
    send: list[torch.Tensor]
    handle: Any
    reverse: Callable[[list[torch.Tensor]], Any]


@dataclass
class Piece:
    inputs: list[torch.Tensor]                     # leaves: carried tensors, then the received floating rows
    n_recv: int = 0                                # how many of ``inputs`` came through the link
    outputs: list[torch.Tensor] = field(default_factory=list)   # aligned with the next piece's inputs
    losses: list[tuple[torch.Tensor, float]] = field(default_factory=list)   # (scalar, its gradient)
    link: Link | None = None                       # the all-to-alls to the next piece
    targets: tuple | None = None                   # (roots, grads) kept by an input-only backward for W


def _diff(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad


class Tape:
    """The pieces of one micro-batch's forward through one stage."""

    def __init__(self, x: torch.Tensor | None):
        self.pieces = [Piece([x] if x is not None else [])]
        self.out: torch.Tensor | None = None

    def loss(self, t: torch.Tensor, grad: float) -> None:
        """A scalar of the current piece that the backward seeds with ``grad`` (balance losses)."""
        self.pieces[-1].losses.append((t, grad))

    def cut(self, carry: tuple, link: Link) -> Steps:
        """End the current piece; ``link``'s all-to-alls are in flight. Yields its handle; returns the
        carried tensors and the received ones, as leaves of the next piece where differentiable."""
        cur = self.pieces[-1]
        keep = [i for i, t in enumerate(carry) if _diff(t)]
        sends = [t for t in link.send if _diff(t)]
        cur.outputs = [carry[i] for i in keep] + sends
        cur.link = link
        recv = list((yield link.handle))
        new = list(carry)
        for i in keep:
            new[i] = carry[i].detach().requires_grad_()
        got = [j for j, t in enumerate(link.send) if _diff(t)]
        for j in got:
            recv[j] = recv[j].detach().requires_grad_()
        self.pieces.append(Piece([new[i] for i in keep] + [recv[j] for j in got], len(got)))
        return tuple(new), recv


# ------------------------------------------------------------------------------------------- routing
class _Done:
    """A handle with nothing in flight (the single-device dispatcher)."""

    def __init__(self, t):
        self.t = t

    def wait(self):
        return self.t


class _FlatRoute:
    """``AllToAllDispatcher`` (one all-to-all each way) or the single-device ``LocalDispatcher`` (the
    same cuts, nothing in flight)."""

    def __init__(self, dispatcher):
        self.d = dispatcher
        self.local = isinstance(dispatcher, LocalDispatcher)

    def _link(self, send: torch.Tensor, plan: RoutePlan, direction: str) -> Link:
        if self.local:
            return Link([send], _Done([send.detach()]), _Done)
        d = self.d
        return Link([send], _Listed(d.start(send, plan, direction)),
                    lambda g: _Listed(d.start(g[0], plan, direction + "_grad")))

    def steps(self, moe, u_TD, topk_idx_TK, w_TK, carry: tuple, tape: Tape) -> Steps:
        if self.local:
            flat = topk_idx_TK.flatten()
            R = flat.numel()
            plan = RoutePlan(torch.argsort(flat, stable=True), topk_idx_TK.shape[1], [R], [R], None,
                             expert_counts(flat, self.d.n_experts))
        else:
            plan = self.d.plan(topk_idx_TK)
        x_send = u_TD[plan.order // plan.K]
        (w_TK, *carry), (x_recv,) = yield from tape.cut((w_TK, *carry), self._link(x_send, plan, "dispatch"))
        x_RD = x_recv if plan.perm is None else x_recv[plan.perm]
        y_RD = moe.experts(x_RD, plan.tokens_per_expert)
        y_send = y_RD if plan.perm is None else y_RD[torch.argsort(plan.perm)]
        (w_TK, *carry), (y_sorted,) = yield from tape.cut((w_TK, *carry), self._link(y_send, plan, "combine"))
        return unsort_and_weight(y_sorted, plan.order, w_TK), tuple(carry)


class _Listed:
    """A handle whose result is wrapped in a one-element list."""

    def __init__(self, h):
        self.h = h
        self.injected_s = getattr(h, "injected_s", 0.0)   # see ``run_pair``

    def wait(self):
        return [self.h.wait()]


class _HierRoute:
    """``HierarchicalDispatcher``: inter-node hop (token rows, gate weights, expert ids), the forwarder's
    intra-node hop, the experts, the intra-node hop back, the forwarder's weighted sum, the inter-node
    hop back: four cuts."""

    def __init__(self, dispatcher):
        self.d = dispatcher

    def _link(self, sends: list, out_splits, in_splits, hop: str, count, stat: str) -> Link:
        d = self.d
        return Link(sends, d.start(sends, out_splits, in_splits, hop, count, stat),
                    lambda g: d.start(g, in_splits, out_splits, hop, None, stat))

    def steps(self, moe, u_TD, topk_idx_TK, w_TK, carry: tuple, tape: Tape) -> Steps:
        d, st = self.d, self.d.stats
        nplan = d.plan_nodes(topk_idx_TK)
        sends = [u_TD[nplan.pair_tok], w_TK[nplan.pair_tok] * nplan.on_node_PK, nplan.ids_PK]
        carry, (x1, w1, ids1) = yield from tape.cut(carry, self._link(sends, nplan.out1, nplan.in1, "inter",
                                                                     st.count_dispatch, "dispatch_s"))
        fplan = d.plan_forward(ids1)
        x_send = x1[fplan.copy_row[fplan.order2]]
        (w1, *carry), (x2,) = yield from tape.cut((w1, *carry), self._link([x_send], fplan.out2, fplan.in2, "intra",
                                                                           st.count_dispatch, "dispatch_s"))
        y_RD = moe.experts(x2[fplan.perm], fplan.tokens_per_expert)
        y_send = y_RD[torch.argsort(fplan.perm)]
        (w1, *carry), (y2,) = yield from tape.cut((w1, *carry), self._link([y_send], fplan.in2, fplan.out2, "intra",
                                                                           st.count_combine, "combine_s"))
        partial = d.forwarder_sum(y2, w1, fplan)
        carry, (y1,) = yield from tape.cut(tuple(carry), self._link([partial], nplan.in1, nplan.out1, "inter",
                                                                    st.count_combine, "combine_s"))
        return d.node_sum(y1, nplan), tuple(carry)


def _route_of(ffn):
    if not isinstance(ffn, MoE):
        return None
    d = ffn.dispatcher
    if isinstance(d, (LocalDispatcher, AllToAllDispatcher)):
        return _FlatRoute(d)
    if isinstance(d, HierarchicalDispatcher) and not d.fp8:
        return _HierRoute(d)
    return None


# ------------------------------------------------------------------------------------ forward pieces
def _block_steps(blk, x: torch.Tensor, rope, carry: tuple, tape: Tape, aux_grad: float) -> Steps:
    """``Block.forward`` (with ``MoE.forward`` inlined), cut at the MoE layer's all-to-alls.
    ``carry``: the caller's live tensors, passed through the cuts. Returns ``(out, carry)``."""
    moe, route = blk.ffn, _route_of(blk.ffn)
    if route is None:   # dense FFN, or a dispatcher without a piecewise route: one piece
        out = blk(x, rope)
        if isinstance(moe, MoE) and moe.training and aux_grad:
            tape.loss(moe.aux_loss, aux_grad)
        return out, carry
    h = x + blk.attn(blk.attn_norm(x), rope)
    u = blk.ffn_norm(h)
    B, T, D = u.shape
    u_TD = u.reshape(B * T, D)
    topk_idx_TK, w_TK, scores_TE = moe.gate(u_TD)
    if moe.training:
        moe.aux_loss = sequence_balance_loss(scores_TE.view(B, T, -1), topk_idx_TK.view(B, T, -1))
        if aux_grad:
            tape.loss(moe.aux_loss, aux_grad)
        with torch.no_grad():
            moe.tokens_per_expert += expert_counts(topk_idx_TK, moe.n_experts)
    y_TD, (h, u_TD, *carry) = yield from route.steps(moe, u_TD, topk_idx_TK, w_TK, (h, u_TD, *carry), tape)
    if moe.shared_experts is not None:
        y_TD = y_TD + moe.shared_experts(u_TD)
    return h + y_TD.view(B, T, D), tuple(carry)


def _stage_steps(st, tape: Tape, x, ids: torch.Tensor, labels: torch.Tensor, mtp_weight: float,
                 aux_grad: float) -> Steps:
    """``Stage.forward`` (and, on the last stage, ``head_loss``). Returns ``(out, parts)`` like it.
    Another stage module (duck-typed, e.g. in tests) runs as one piece."""
    if not isinstance(st, Stage):
        out, parts = st(x, ids, labels, mtp_weight)
        for m in st.modules():
            if isinstance(m, MoE) and m.training and m.aux_loss is not None and aux_grad:
                tape.loss(m.aux_loss, aux_grad)
        return out, parts
    h = st.embed(ids) if st.is_first else x
    rope = rope_cos_sin(st.cfg, ids.shape[1], ids.device)
    for layer in st.layers.values():
        h, _ = yield from _block_steps(layer, h, rope, (), tape, aux_grad)
    if not st.is_last:
        return h, None
    lm = _ce(st.head(st.norm(h)), labels)
    T = ids.shape[1]
    mtp: list[torch.Tensor] = []
    for k, module in enumerate(st.mtp, start=1):
        if T - k <= 0:
            break
        rope_k = rope_cos_sin(st.cfg, T - k, h.device)
        xk = module.eh_proj(torch.cat([module.enorm(st.mtp_embed(ids[:, k:])), module.hnorm(h[:, :T - k])], dim=-1))
        h, (lm, *mtp) = yield from _block_steps(module.block, xk, rope_k, (lm, *mtp), tape, aux_grad)
        mtp.append(_ce(st.head(module.norm(h)), labels[:, k:]))
    if not mtp:
        return lm, (lm.detach(), lm.new_zeros(()))
    mtp_loss = torch.stack(mtp).mean()
    return lm + mtp_weight * mtp_loss, (lm.detach(), mtp_loss.detach())


def forward_steps(st, x: torch.Tensor | None, ids: torch.Tensor, labels: torch.Tensor, mtp_weight: float,
                  aux_grad: float) -> Steps:
    """One stage forward, as steps. ``x``: the stage input leaf (None on the first stage); ``aux_grad``:
    the gradient each MoE balance loss gets in the backward (0: none). Returns ``(tape, parts)``;
    ``tape.out`` is the stage output (the loss on the last stage)."""
    tape = Tape(x)
    tape.out, parts = yield from _stage_steps(st, tape, x, ids, labels, mtp_weight, aux_grad)
    tape.pieces[-1].outputs = [tape.out]
    return tape, parts


# ----------------------------------------------------------------------------------- backward pieces
def _roots(piece: Piece, grads: list[torch.Tensor | None]) -> tuple[list, list]:
    roots, gs = [], []
    for t, g in zip(piece.outputs, grads):
        if g is not None and t.requires_grad:
            roots.append(t)
            gs.append(g)
    for t, g in piece.losses:
        roots.append(t)
        gs.append(torch.full_like(t, g))
    return roots, gs


def backward_steps(tape: Tape, out_grad: torch.Tensor, mode: str = "full") -> Steps:
    """Backward of one stage forward, piece by piece from the last, as steps (yields the handles of the
    gradients' all-to-alls). ``mode="full"``: parameters and inputs (BW, the backward of an F&B);
    ``"input"``: only each piece's input gradients, keeping graphs and seeds for ``weight_backward`` (B).
    The stage input's gradient lands in ``.grad`` of the leaf passed to ``forward_steps``."""
    grads: list[torch.Tensor | None] = [out_grad]
    for i in range(len(tape.pieces) - 1, -1, -1):
        p = tape.pieces[i]
        roots, gs = _roots(p, grads)
        if mode == "full":
            if roots:
                torch.autograd.backward(roots, gs)
            p.outputs, p.losses = [], []
        else:
            p.targets = (roots, gs)
            if roots and p.inputs:
                torch.autograd.backward(roots, gs, inputs=p.inputs, retain_graph=True)
        if i == 0:
            break
        prev = tape.pieces[i - 1]
        in_grads = [t.grad for t in p.inputs]
        k = len(in_grads) - p.n_recv
        g_recv = [g if g is not None else torch.zeros_like(t) for g, t in zip(in_grads[k:], p.inputs[k:])]
        g_send = (yield prev.link.reverse(g_recv)) if g_recv else []   # nothing differentiable crossed: no transfer
        grads = in_grads[:k] + list(g_send)
        prev.link = None
        if mode == "full":
            p.inputs = p.inputs[:0]


def weight_backward(tape: Tape, params: list[torch.Tensor]) -> None:
    """W after an input-only backward: every piece's parameter gradients."""
    if params:
        for p in tape.pieces:
            roots, gs = p.targets
            if roots:
                torch.autograd.backward(roots, gs, inputs=params)
    tape.pieces.clear()


# --------------------------------------------------------------------------------------------- drivers
def run(steps: Steps) -> Any:
    """Drive one step generator alone: every all-to-all is waited for right after its launch."""
    value = None
    while True:
        try:
            handle = steps.send(value)
        except StopIteration as stop:
            return stop.value
        value = handle.wait()


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


__all__ = ["Tape", "forward_steps", "backward_steps", "weight_backward", "run", "run_pair"]
