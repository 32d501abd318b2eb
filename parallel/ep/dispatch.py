"""Expert-parallel dispatchers. The same interface as ``models.moe.LocalDispatcher`` (the reference):

    route(x_TD, topk_idx_TK, topk_weight_TK, experts) -> steps (models/steps.py) returning y_TD

``route`` plans where the token copies go, then yields a ``Cut`` at every all-to-all: its link exchanges
the rows at once with autograd when the forward is driven straight through (``MoE.forward``), or is
launched asynchronously, with a reverse for the gradients, when a pipeline drives it piecewise
(``parallel.pipeline.overlap``). The experts compute between the cuts; the code is the same either way.

* ``AllToAllDispatcher``: one flat uneven all-to-all over the EP group (one copy per (token, expert)).
* ``HierarchicalDispatcher`` (node-limited): a token crosses to each target node **once** — to the
  rank with its own local index there — which forwards one copy per chosen expert to the ranks of its
  node; on the way back that rank sums its node's weighted expert outputs, so the return trip is also
  one row per (token, node). With node-limited routing a token reaches at most the nodes
  ``parallel.dims.routing_reach`` gives (M groups: at most M nodes, M x nodes / G when a group spans nodes).

``fp8=True`` (DeepSeek-V3's FP8 dispatch): the dispatched token rows travel as E4M3 bytes (sent as
``uint8``) plus one power-of-2 FP32 scale per 1x128 tile (``comm.fp8_route``), and are dequantised to the
input dtype where the experts run. The hierarchical dispatcher quantises once, before the inter-node hop,
and the forwarding rank passes the bytes and scales on unchanged: one route across both hops, so it has no
cut (its ``dispatch`` / ``combine`` run synchronously with autograd, nothing hidden). Combine stays in the
activation dtype (BF16 under autocast). Backward is straight-through: the dispatch gradient goes back
unquantised. Needs D % 128 == 0. Gate weights, expert ids and counts are not quantised.

Shape legend: T tokens, K experts per token, D hidden, E experts (global), R received copies, N nodes.
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from models.moe import expert_counts, gate_weighted_sum, inverse_permutation, unsort_and_weight
from models.steps import Cut, Steps

from ..compile import GATHER_ENV
from .comm import Hop, Pending, all_to_all, exchange_counts, fp8_route, named_errors, start_all_to_all
from .links import FlatLink, Handle, HopLink


@dataclass
class DispatchStats:
    """Accumulated since the last ``reset()`` (the trainer reads and resets them every step)."""
    calls: int = 0
    cross_node_copies: int = 0     # token rows this rank sent over a node boundary (dispatch direction)
    max_nodes_per_token: int | torch.Tensor = 0   # a device tensor once counted: no host sync per layer
    dispatch_s: float = 0.0
    combine_s: float = 0.0
    dispatch_bytes: int = 0        # bytes of token rows (+ FP8 scales) this rank handed to the dispatch all-to-alls
    combine_bytes: int = 0         # the same for the combine all-to-alls (rows kept on this rank included)

    def reset(self) -> None:
        self.calls = self.cross_node_copies = self.max_nodes_per_token = 0
        self.dispatch_s = self.combine_s = 0.0
        self.dispatch_bytes = self.combine_bytes = 0

    def note_nodes_per_token(self, nodes_T: torch.Tensor) -> None:
        """Running max of distinct nodes per token, kept on the device (read once per step by the trainer)."""
        m = nodes_T.max()
        prev = self.max_nodes_per_token
        self.max_nodes_per_token = torch.maximum(prev, m) if isinstance(prev, torch.Tensor) else m

    def count_dispatch(self, t: torch.Tensor) -> None:
        self.dispatch_bytes += t.numel() * t.element_size()

    def count_combine(self, t: torch.Tensor) -> None:
        self.combine_bytes += t.numel() * t.element_size()

    def add_time(self, kind: str, seconds: float) -> None:
        """``kind``: ``dispatch_s`` or ``combine_s``. The host's time in the transfers: planning, launching
        and blocking on them (forward and backward); what overlapped with other work is not counted."""
        setattr(self, kind, getattr(self, kind) + seconds)


class _DispatcherBase:
    """Shared by the dispatchers: a layer name for error messages (``apply_ep`` sets it); the combine's un-sort
    and weighted sum (``parallel/compile.py`` may compile it)."""
    name = "moe"
    weigh = staticmethod(unsort_and_weight)

    def _handle(self, finish, pending) -> Handle:
        return Handle(finish, pending, self.name, dist.get_rank())


@dataclass
class RoutePlan:
    """Where the T*K token copies of one MoE call go (``AllToAllDispatcher.plan``)."""
    order: torch.Tensor              # [T*K] copies sorted by global expert (row r: token order[r] // K)
    K: int
    in_splits: list[int]             # copies this rank sends to each EP rank
    out_splits: list[int]            # copies this rank receives from each EP rank
    perm: torch.Tensor               # received rows (grouped by source) -> grouped by local expert
    tokens_per_expert: torch.Tensor  # [E_local] copies each local expert receives


@dataclass
class NodePlan:
    """Stage 1 of the hierarchical route (``HierarchicalDispatcher.plan_nodes``): P (token, node) pairs."""
    T: int
    pair_tok: torch.Tensor     # [P] token of each pair (pairs sorted by node, then token)
    pair_node: torch.Tensor    # [P] target node
    on_node_PK: torch.Tensor   # [P, K] which of the token's K experts live on that node
    ids_PK: torch.Tensor       # [P, K] those experts' global ids, -1 elsewhere
    in1: list[int]             # pairs sent to each node
    out1: list[int]            # pairs received from each node


@dataclass
class ForwardPlan:
    """Stage 2, on the forwarding rank (``HierarchicalDispatcher.plan_forward``)."""
    copy_row: torch.Tensor     # [C] received pair of each expert copy
    copy_k: torch.Tensor       # [C] its slot k
    order2: torch.Tensor       # copies sorted by expert within the node
    in2: list[int]
    out2: list[int]
    perm: torch.Tensor         # received copies (grouped by source) -> grouped by local expert
    tokens_per_expert: torch.Tensor


def _sort_source_major_to_expert_major(recv_counts_SE: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Rows arrive grouped by (source, local expert); return the permutation grouping them by (expert, source).
    ``n_rows`` = ``recv_counts_SE.sum()``, already known on the host (the split sizes): no sync for it."""
    S, E = recv_counts_SE.shape
    key = torch.arange(S * E, device=recv_counts_SE.device).view(S, E).t().flatten()  # expert-major rank of (s, e)
    rank_of_row = torch.repeat_interleave(torch.argsort(key).view(S, E).flatten(), recv_counts_SE.flatten(),
                                          output_size=n_rows)
    return torch.argsort(rank_of_row, stable=True)


class AllToAllDispatcher(_DispatcherBase):
    def __init__(self, n_experts: int, group, ranks_per_node: int = 1, fp8: bool = False):
        self.group, self.fp8 = group, fp8
        self.ep = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        self.n_experts, self.n_local = n_experts, n_experts // self.ep
        self.rpn = min(ranks_per_node, self.ep)
        self.stats = DispatchStats()

    # ---- routing plan, shared by the autograd path and the piecewise (overlapped) pipeline path ----
    def plan(self, topk_idx_TK) -> RoutePlan:
        """Exchange the per-expert counts (a small blocking all-to-all) and compute where every token copy
        goes: ``order`` sorts the T*K copies by global expert, ``perm`` sorts the received rows (grouped by
        source rank) by local expert."""
        t0 = time.perf_counter()
        with named_errors(self.name, dist.get_rank()):
            plan = self._plan(topk_idx_TK)
        self.stats.dispatch_s += time.perf_counter() - t0
        return plan

    def _plan(self, topk_idx_TK) -> RoutePlan:
        K = topk_idx_TK.shape[1]
        flat = topk_idx_TK.flatten()
        order = torch.argsort(flat, stable=True)
        send_counts = expert_counts(flat, self.n_experts).view(self.ep, self.n_local)
        recv_counts = exchange_counts(send_counts, self.group)
        in_splits, out_splits = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()   # one host sync
        self._count_crossings(topk_idx_TK, in_splits)
        perm = _sort_source_major_to_expert_major(recv_counts, sum(out_splits))
        return RoutePlan(order, K, in_splits, out_splits, perm, recv_counts.sum(0))

    def start(self, rows: torch.Tensor, plan: RoutePlan, direction: str) -> Handle:
        """Launch one all-to-all of the plan outside autograd; ``wait()`` on the handle gives ``[received]``.

        ``dispatch``: ``rows`` = the T token rows; one copy per (token, chosen expert) goes to its expert's
        rank (sent sorted by global expert; FP8 when ``fp8``, quantised once per token), received grouped by
        source. ``combine``: expert outputs in that received order -> back to the source ranks (sorted by
        global expert). ``dispatch_grad`` / ``combine_grad``: the gradients of the received rows, the reverse
        way (never quantised: the FP8 backward is straight-through); the dispatch gradients of a token's
        copies arrive summed per token (``[T, D]``)."""
        splits = {"dispatch": (plan.out_splits, plan.in_splits), "combine": (plan.in_splits, plan.out_splits),
                  "dispatch_grad": (plan.in_splits, plan.out_splits),
                  "combine_grad": (plan.out_splits, plan.in_splits)}[direction]
        fp8 = self.fp8 and direction == "dispatch"
        count = {"dispatch": self.stats.count_dispatch, "combine": self.stats.count_combine}.get(direction)
        t0 = time.perf_counter()
        tokens = plan.order // plan.K   # token of each copy, in send order
        pending = Pending()
        with named_errors(f"{self.name} ({direction})", dist.get_rank()):
            out = start_all_to_all(rows, *splits, self.group, pending, fp8, count,
                                   rows=tokens if direction == "dispatch" else None)
        kind = "combine_s" if direction.startswith("combine") else "dispatch_s"
        self.stats.add_time(kind, time.perf_counter() - t0)

        def finish():
            if direction == "dispatch_grad" and os.environ.get(GATHER_ENV) == "1":   # un-sorted, summed per token
                return [out[inverse_permutation(plan.order)].view(-1, plan.K, *out.shape[1:]).sum(1, dtype=out.dtype)]
            if direction == "dispatch_grad":   # the gather's backward: sum the copies per token
                summed = out.new_zeros((tokens.numel() // plan.K, *out.shape[1:]))
                return [summed.index_put_((tokens,), out, accumulate=True)]
            return [out]

        waited = functools.partial(self.stats.add_time, kind)   # the blocking part of the wait
        return Handle(finish, pending, f"{self.name} ({direction})", dist.get_rank(), waited)

    def route(self, x_TD, topk_idx_TK, topk_weight_TK, experts) -> Steps:
        """Plan (a blocking count exchange) | dispatch all-to-all | experts | combine all-to-all | un-sort and
        weight, as steps: one cut per all-to-all. Returns ``y_TD``."""
        plan = self.plan(topk_idx_TK)
        (w_TK,), (x_recv,) = yield Cut((topk_weight_TK,), [x_TD], FlatLink(self, plan, "dispatch"))
        y_RD = experts(x_recv[plan.perm], plan.tokens_per_expert)
        y_send = y_RD[inverse_permutation(plan.perm)]
        (w_TK,), (y_sorted,) = yield Cut((w_TK,), [y_send], FlatLink(self, plan, "combine"))
        return self.weigh(y_sorted, plan.order, w_TK)

    def _count_crossings(self, topk_idx_TK, in_splits) -> None:
        my_node = self.ep_rank // self.rpn
        self.stats.calls += 1
        self.stats.cross_node_copies += sum(n for r, n in enumerate(in_splits) if r // self.rpn != my_node)
        nodes = topk_idx_TK // (self.n_local * self.rpn)
        if nodes.numel():
            per_token = (nodes.sort(-1)[0].diff(dim=-1) != 0).sum(-1) + 1
            self.stats.note_nodes_per_token(per_token)


class HierarchicalDispatcher(_DispatcherBase):
    """Node-limited two-stage dispatch: inter-node (same local index) then intra-node."""

    def __init__(self, n_experts: int, ep_group, inter_group, intra_group, fp8: bool = False):
        self.fp8 = fp8
        self.ep = dist.get_world_size(ep_group)
        self.ep_rank = dist.get_rank(ep_group)
        self.inter, self.intra = inter_group, intra_group
        self.n_nodes, self.rpn = dist.get_world_size(inter_group), dist.get_world_size(intra_group)
        assert self.n_nodes * self.rpn == self.ep, (self.n_nodes, self.rpn, self.ep)
        self.node = self.ep_rank // self.rpn
        self.n_experts, self.n_local = n_experts, n_experts // self.ep
        self.per_node = self.n_local * self.rpn
        self.stats = DispatchStats()

    # ---- the route's steps, shared by the autograd path and the piecewise (overlapped) pipeline path ----
    def plan_nodes(self, topk_idx_TK) -> NodePlan:
        """Stage 1: one row per (token, target node), to the same local index on that node; exchanges the
        row counts over the inter-node group (a small blocking all-to-all)."""
        T, K = topk_idx_TK.shape
        dev = topk_idx_TK.device
        node_TK = topk_idx_TK // self.per_node
        goes_NT = torch.zeros(self.n_nodes, T, dtype=torch.bool, device=dev)
        goes_NT[node_TK.t().flatten(), torch.arange(T, device=dev).repeat(K)] = True
        pair_node, pair_tok = goes_NT.nonzero(as_tuple=True)             # sorted by node, then token
        on_node_PK = node_TK[pair_tok] == pair_node.unsqueeze(1)
        ids_PK = torch.where(on_node_PK, topk_idx_TK[pair_tok], -1)
        in1 = goes_NT.sum(1)
        out1 = exchange_counts(in1, self.inter)
        in1, out1 = torch.stack([in1, out1]).tolist()   # one host sync for both
        self.stats.calls += 1
        self.stats.cross_node_copies += sum(n for i, n in enumerate(in1) if i != self.node)
        if T:
            self.stats.note_nodes_per_token(goes_NT.sum(0))
        return NodePlan(T, pair_tok, pair_node, on_node_PK, ids_PK, in1, out1)

    def plan_forward(self, ids1) -> ForwardPlan:
        """Stage 2, on the forwarding rank: one copy per chosen expert to the rank of its node that hosts
        it; exchanges the counts over the intra-node group."""
        copy_row, copy_k = (ids1 >= 0).nonzero(as_tuple=True)
        expert = ids1[copy_row, copy_k] - self.node * self.per_node        # expert index within this node
        order2 = torch.argsort(expert, stable=True)
        send2 = expert_counts(expert, self.per_node).view(self.rpn, self.n_local)
        recv2 = exchange_counts(send2, self.intra)
        in2, out2 = torch.stack([send2.sum(1), recv2.sum(1)]).tolist()   # one host sync for both
        return ForwardPlan(copy_row, copy_k, order2, in2, out2, _sort_source_major_to_expert_major(recv2, sum(out2)),
                           recv2.sum(0))

    @staticmethod
    def forwarder_sum(y2, w1, fplan: ForwardPlan):
        """On the forwarder: weight its node's expert outputs and sum them per received row (no
        index_add: deterministic)."""
        R1, K = w1.shape
        idx = fplan.copy_row[fplan.order2] * K + fplan.copy_k[fplan.order2]
        y_RKD = y2.new_zeros(R1 * K, y2.shape[-1]).index_put((idx,), y2)
        return gate_weighted_sum(y_RKD.view(R1, K, y2.shape[-1]), w1)

    def node_sum(self, y1, nplan: NodePlan):
        """Back at the source: sum the per-node partial outputs of each token -> ``[T, D]``."""
        T, D = nplan.T, y1.shape[-1]
        y_NTD = y1.new_zeros(self.n_nodes * T, D).index_put((nplan.pair_node * T + nplan.pair_tok,), y1)
        return y_NTD.view(self.n_nodes, T, D).sum(0, dtype=y1.dtype)   # explicit: see gate_weighted_sum

    def start(self, rows: list, out_splits: list[int], in_splits: list[int], hop: str, count=None,
              stat: str = "dispatch_s") -> Handle:
        """Launch the all-to-alls of ``rows`` (same splits) over the ``inter`` or ``intra`` group outside
        autograd; ``wait()`` gives the received tensors, in order. ``count``: byte counter for ``rows[0]``
        (the token rows; gate weights and ids are not counted, as in the autograd path)."""
        t0 = time.perf_counter()
        group = self.inter if hop == "inter" else self.intra
        pending = Pending()
        outs = []
        with named_errors(self.name, dist.get_rank()):
            for i, t in enumerate(rows):
                outs.append(start_all_to_all(t, out_splits, in_splits, group, pending, False,
                                             count if i == 0 else None))
        self.stats.add_time(stat, time.perf_counter() - t0)
        return Handle(lambda: outs, pending, self.name, dist.get_rank(), functools.partial(self.stats.add_time, stat))

    def route(self, x_TD, topk_idx_TK, topk_weight_TK, experts) -> Steps:
        """The two-hop route as steps, one cut per hop: inter-node (token rows, gate weights, expert ids),
        intra-node to the experts, experts, intra-node back, the forwarder's weighted sum, inter-node back,
        the per-token sum. With FP8 (one quantised route across both hops): no cut, synchronous."""
        if self.fp8:
            x_RD, tokens_per_expert, handle = self.dispatch(x_TD, topk_idx_TK, topk_weight_TK)
            return self.combine(experts(x_RD, tokens_per_expert), handle)
        st = self.stats
        np_ = self._timed(self.plan_nodes, topk_idx_TK)
        sends = [x_TD[np_.pair_tok], topk_weight_TK[np_.pair_tok] * np_.on_node_PK, np_.ids_PK]
        inter = HopLink(self, np_.out1, np_.in1, "inter", st.count_dispatch, "dispatch_s")
        _, (x1, w1, ids1) = yield Cut((), sends, inter)
        fp = self._timed(self.plan_forward, ids1)
        intra = HopLink(self, fp.out2, fp.in2, "intra", st.count_dispatch, "dispatch_s")
        (w1,), (x2,) = yield Cut((w1,), [x1[fp.copy_row[fp.order2]]], intra)
        y_RD = experts(x2[fp.perm], fp.tokens_per_expert)
        back = HopLink(self, fp.in2, fp.out2, "intra", st.count_combine, "combine_s")
        (w1,), (y2,) = yield Cut((w1,), [y_RD[inverse_permutation(fp.perm)]], back)
        partial = self.forwarder_sum(y2, w1, fp)
        _, (y1,) = yield Cut((), [partial], HopLink(self, np_.in1, np_.out1, "inter", st.count_combine, "combine_s"))
        return self.node_sum(y1, np_)

    def _timed(self, plan_step, *args):
        """A planning step of the route (a blocking count exchange included): errors name the layer, its
        time counts as dispatch time."""
        t0 = time.perf_counter()
        with named_errors(self.name, dist.get_rank()):
            out = plan_step(*args)
        self.stats.add_time("dispatch_s", time.perf_counter() - t0)
        return out

    # ---- FP8: both hops in one quantised route, synchronous, with autograd -----------------------------
    def dispatch(self, x_TD, topk_idx_TK, topk_weight_TK):
        """``(x_RD sorted by local expert, tokens_per_expert, handle)``."""
        with named_errors(self.name, dist.get_rank()):
            handle = self._dispatch(x_TD, topk_idx_TK, topk_weight_TK)
        return handle.wait()

    def combine(self, y_RD, handle):
        with named_errors(self.name, dist.get_rank()):
            handle = self._combine(y_RD, handle)
        return handle.wait()

    def _dispatch(self, x_TD, topk_idx_TK, topk_weight_TK) -> Handle:
        t0 = time.perf_counter()
        np_ = self.plan_nodes(topk_idx_TK)
        in1, out1, pair_tok = np_.in1, np_.out1, np_.pair_tok
        w1 = all_to_all(topk_weight_TK[pair_tok] * np_.on_node_PK, out1, in1, self.inter, None, self.name)
        ids1 = exchange_rows(np_.ids_PK, out1, in1, self.inter)
        fp = self.plan_forward(ids1)
        pending = Pending()
        # quantised here, bytes forwarded as they are, dequantised at the expert
        hops = [Hop(out1, in1, self.inter, rows=pair_tok),
                Hop(fp.out2, fp.in2, self.intra, rows=fp.copy_row[fp.order2])]
        x2 = fp8_route(x_TD, hops, pending, self.name, on_send=self.stats.count_dispatch)

        def finish():
            self.stats.dispatch_s += time.perf_counter() - t0
            return x2[fp.perm], fp.tokens_per_expert, (np_, w1, fp)
        return self._handle(finish, pending)

    def _combine(self, y_RD, handle) -> Handle:
        t0 = time.perf_counter()
        np_, w1, fp = handle
        y_send = y_RD[inverse_permutation(fp.perm)]
        self.stats.count_combine(y_send)
        y2 = all_to_all(y_send, fp.in2, fp.out2, self.intra, None, self.name)
        partial = self.forwarder_sum(y2, w1, fp)
        pending = Pending()
        self.stats.count_combine(partial)
        y1 = all_to_all(partial, np_.in1, np_.out1, self.inter, pending, self.name)

        def finish():
            out = self.node_sum(y1, np_)
            self.stats.combine_s += time.perf_counter() - t0
            return out
        return self._handle(finish, pending)


def exchange_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Non-differentiable uneven all-to-all (for integer metadata)."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out
