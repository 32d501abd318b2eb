"""Expert-parallel dispatchers. Same interface as ``models.moe.LocalDispatcher`` (the reference):

    dispatch(x_TD, topk_idx_TK, topk_weight_TK) -> (x_RD, tokens_per_local_expert [E_local], handle)
    combine(y_RD, handle) -> y_TD

``x_RD`` holds the token copies this rank's experts must process, sorted by local expert. Both calls
are autograd-correct (gradients flow to x and to the gate weights). ``dispatch_async`` /
``combine_async`` launch the last all-to-all and return a handle whose ``wait()`` gives the result, so
a pipeline schedule can compute while the tokens travel.

* ``AllToAllDispatcher``: one flat uneven all-to-all over the EP group (one copy per (token, expert)).
* ``HierarchicalDispatcher`` (node-limited): a token crosses to each target node **once** — to the
  rank with its own local index there — which forwards one copy per chosen expert to the ranks of its
  node; on the way back that rank sums its node's weighted expert outputs, so the return trip is also
  one row per (token, node). With node-limited routing (M nodes) a token crosses at most M-1... M links.

``fp8=True`` (DeepSeek-V3's FP8 dispatch): the dispatched token rows travel as E4M3 bytes (sent as
``uint8``) plus one power-of-2 FP32 scale per 1x128 tile (``comm.fp8_route``), and are dequantised to the
input dtype where the experts run. The hierarchical dispatcher quantises once, before the inter-node hop,
and the forwarding rank passes the bytes and scales on unchanged. Combine stays in the activation dtype
(BF16 under autocast). Backward is straight-through: the dispatch gradient goes back unquantised. Needs
D % 128 == 0. Gate weights, expert ids and counts are sent as before.

Shape legend: T tokens, K experts per token, D hidden, E experts (global), R received copies, N nodes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .comm import Hop, Pending, all_to_all, all_to_all_fp8, exchange_counts, fp8_route, named_errors


@dataclass
class DispatchStats:
    """Accumulated since the last ``reset()`` (the trainer reads and resets them every step)."""
    calls: int = 0
    cross_node_copies: int = 0     # token rows this rank sent over a node boundary (dispatch direction)
    max_nodes_per_token: int = 0
    dispatch_s: float = 0.0
    combine_s: float = 0.0
    dispatch_bytes: int = 0        # bytes of token rows (+ FP8 scales) this rank handed to the dispatch all-to-alls
    combine_bytes: int = 0         # the same for the combine all-to-alls (rows kept on this rank included)
    extra: dict = field(default_factory=dict)

    def reset(self) -> None:
        self.calls = self.cross_node_copies = self.max_nodes_per_token = 0
        self.dispatch_s = self.combine_s = 0.0
        self.dispatch_bytes = self.combine_bytes = 0

    def count_dispatch(self, t: torch.Tensor) -> None:
        self.dispatch_bytes += t.numel() * t.element_size()

    def count_combine(self, t: torch.Tensor) -> None:
        self.combine_bytes += t.numel() * t.element_size()


class _Handle:
    def __init__(self, finish, pending: Pending, name: str = "moe", rank: int = 0):
        self._finish, self._pending, self._name, self._rank = finish, pending, name, rank

    def wait(self):
        with named_errors(self._name, self._rank):
            self._pending.wait()
            return self._finish()


class _DispatcherBase:
    """Shared by the dispatchers: a layer name for error messages and the error wrapping of each call."""
    name = "moe"

    def dispatch(self, x_TD, topk_idx_TK, topk_weight_TK):
        return self.dispatch_async(x_TD, topk_idx_TK, topk_weight_TK).wait()

    def combine(self, y_RD, handle):
        return self.combine_async(y_RD, handle).wait()

    def dispatch_async(self, x_TD, topk_idx_TK, topk_weight_TK) -> _Handle:
        with named_errors(self.name, dist.get_rank()):
            return self._dispatch(x_TD, topk_idx_TK, topk_weight_TK)

    def combine_async(self, y_RD, handle) -> _Handle:
        with named_errors(self.name, dist.get_rank()):
            return self._combine(y_RD, handle)

    def _handle(self, finish, pending) -> _Handle:
        return _Handle(finish, pending, self.name, dist.get_rank())


def _sort_source_major_to_expert_major(recv_counts_SE: torch.Tensor) -> torch.Tensor:
    """Rows arrive grouped by (source, local expert); return the permutation grouping them by (expert, source)."""
    S, E = recv_counts_SE.shape
    key = torch.arange(S * E, device=recv_counts_SE.device).view(S, E).t().flatten()  # expert-major rank of (s, e)
    rank_of_row = torch.repeat_interleave(torch.argsort(key).view(S, E).flatten(), recv_counts_SE.flatten())
    return torch.argsort(rank_of_row, stable=True)


class AllToAllDispatcher(_DispatcherBase):
    def __init__(self, n_experts: int, group, ranks_per_node: int = 1, latency_s: float = 0.0, bwd_group=None,
                 fp8: bool = False):
        self.group, self.bwd_group, self.fp8 = group, bwd_group, fp8
        self.ep = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        self.n_experts, self.n_local = n_experts, n_experts // self.ep
        self.rpn = min(ranks_per_node, self.ep)
        self.latency_s = latency_s
        self.stats = DispatchStats()

    def _dispatch(self, x_TD, topk_idx_TK, topk_weight_TK) -> _Handle:
        t0 = time.perf_counter()
        T, K = topk_idx_TK.shape
        flat = topk_idx_TK.flatten()
        order = torch.argsort(flat, stable=True)
        send_counts = torch.bincount(flat, minlength=self.n_experts).view(self.ep, self.n_local)
        recv_counts = exchange_counts(send_counts, self.group)
        in_splits, out_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        self._count_crossings(topk_idx_TK, in_splits)
        pending = Pending()
        if self.fp8:   # quantise the T source rows once, then send their K copies as bytes + scales
            x_recv = all_to_all_fp8(x_TD, out_splits, in_splits, self.group, self.latency_s, pending, self.name,
                                    self.bwd_group, rows=order // K, on_send=self.stats.count_dispatch)
        else:
            x_send = x_TD[order // K]
            self.stats.count_dispatch(x_send)
            x_recv = all_to_all(x_send, out_splits, in_splits, self.group, self.latency_s, pending, self.name,
                                self.bwd_group)

        def finish():
            perm = _sort_source_major_to_expert_major(recv_counts)
            handle = (order, topk_weight_TK, in_splits, out_splits, perm)
            self.stats.dispatch_s += time.perf_counter() - t0
            return x_recv[perm], recv_counts.sum(0), handle
        return self._handle(finish, pending)

    def _combine(self, y_RD, handle) -> _Handle:
        t0 = time.perf_counter()
        order, w_TK, in_splits, out_splits, perm = handle
        pending = Pending()
        y_send = y_RD[torch.argsort(perm)]
        self.stats.count_combine(y_send)
        y_sorted = all_to_all(y_send, in_splits, out_splits, self.group, self.latency_s, pending, self.name,
                              self.bwd_group)

        def finish():
            T, K = w_TK.shape
            y_TKD = y_sorted[torch.argsort(order)].view(T, K, y_sorted.shape[-1])
            out = (y_TKD * w_TK.unsqueeze(-1).to(y_TKD.dtype)).sum(1)
            self.stats.combine_s += time.perf_counter() - t0
            return out
        return self._handle(finish, pending)

    def _count_crossings(self, topk_idx_TK, in_splits) -> None:
        my_node = self.ep_rank // self.rpn
        self.stats.calls += 1
        self.stats.cross_node_copies += sum(n for r, n in enumerate(in_splits) if r // self.rpn != my_node)
        nodes = topk_idx_TK // (self.n_local * self.rpn)
        if nodes.numel():
            per_token = (nodes.sort(-1)[0].diff(dim=-1) != 0).sum(-1) + 1
            self.stats.max_nodes_per_token = max(self.stats.max_nodes_per_token, int(per_token.max()))


class HierarchicalDispatcher(_DispatcherBase):
    """Node-limited two-stage dispatch: inter-node (same local index) then intra-node."""

    def __init__(self, n_experts: int, ep_group, inter_group, intra_group, latency_s: float = 0.0,
                 bwd_groups: tuple | None = None, fp8: bool = False):
        self.fp8 = fp8
        self.ep = dist.get_world_size(ep_group)
        self.ep_rank = dist.get_rank(ep_group)
        self.inter, self.intra = inter_group, intra_group
        self.inter_b, self.intra_b = bwd_groups if bwd_groups else (None, None)
        self.n_nodes, self.rpn = dist.get_world_size(inter_group), dist.get_world_size(intra_group)
        assert self.n_nodes * self.rpn == self.ep, (self.n_nodes, self.rpn, self.ep)
        self.node = self.ep_rank // self.rpn
        self.n_experts, self.n_local = n_experts, n_experts // self.ep
        self.per_node = self.n_local * self.rpn
        self.latency_s = latency_s
        self.stats = DispatchStats()

    def _dispatch(self, x_TD, topk_idx_TK, topk_weight_TK) -> _Handle:
        t0 = time.perf_counter()
        T, K = topk_idx_TK.shape
        N = self.n_nodes
        # Stage 1: one row per (token, target node), to the same local index on that node.
        node_TK = topk_idx_TK // self.per_node
        goes_NT = torch.zeros(N, T, dtype=torch.bool, device=x_TD.device)
        goes_NT[node_TK.t().flatten(), torch.arange(T, device=x_TD.device).repeat(K)] = True
        pair_node, pair_tok = goes_NT.nonzero(as_tuple=True)             # sorted by node, then token
        on_node_PK = node_TK[pair_tok] == pair_node.unsqueeze(1)
        ids_PK = torch.where(on_node_PK, topk_idx_TK[pair_tok], -1)
        w_PK = topk_weight_TK[pair_tok] * on_node_PK
        in1 = goes_NT.sum(1)
        out1 = exchange_counts(in1, self.inter)
        in1, out1 = in1.tolist(), out1.tolist()
        self.stats.calls += 1
        self.stats.cross_node_copies += sum(n for i, n in enumerate(in1) if i != self.node)
        if T:
            self.stats.max_nodes_per_token = max(self.stats.max_nodes_per_token, int(goes_NT.sum(0).max()))
        if not self.fp8:
            x_send = x_TD[pair_tok]
            self.stats.count_dispatch(x_send)
            x1 = all_to_all(x_send, out1, in1, self.inter, self.latency_s, None, self.name, self.inter_b)
        w1 = all_to_all(w_PK, out1, in1, self.inter, 0.0, None, self.name, self.inter_b)
        ids1 = exchange_rows(ids_PK, out1, in1, self.inter)
        # Stage 2: the forwarding rank sends one copy per chosen expert to the rank of its node that hosts it.
        copy_row, copy_k = (ids1 >= 0).nonzero(as_tuple=True)
        expert = ids1[copy_row, copy_k] - self.node * self.per_node        # expert index within this node
        order2 = torch.argsort(expert, stable=True)
        send2 = torch.bincount(expert, minlength=self.per_node).view(self.rpn, self.n_local)
        recv2 = exchange_counts(send2, self.intra)
        in2, out2 = send2.sum(1).tolist(), recv2.sum(1).tolist()
        pending = Pending()
        if self.fp8:   # both hops in one route: quantised here, bytes forwarded as they are, dequantised at the expert
            hops = [Hop(out1, in1, self.inter, self.inter_b, self.latency_s, rows=pair_tok),
                    Hop(out2, in2, self.intra, self.intra_b, 0.0, rows=copy_row[order2])]
            x2 = fp8_route(x_TD, hops, pending, self.name, on_send=self.stats.count_dispatch)
        else:
            x_send = x1[copy_row[order2]]
            self.stats.count_dispatch(x_send)
            x2 = all_to_all(x_send, out2, in2, self.intra, 0.0, pending, self.name, self.intra_b)

        def finish():
            perm = _sort_source_major_to_expert_major(recv2)
            handle = (T, pair_tok, pair_node, in1, out1, w1, copy_row, copy_k, order2, in2, out2, perm)
            self.stats.dispatch_s += time.perf_counter() - t0
            return x2[perm], recv2.sum(0), handle
        return self._handle(finish, pending)

    def _combine(self, y_RD, handle) -> _Handle:
        t0 = time.perf_counter()
        T, pair_tok, pair_node, in1, out1, w1, copy_row, copy_k, order2, in2, out2, perm = handle
        y_send = y_RD[torch.argsort(perm)]
        self.stats.count_combine(y_send)
        y2 = all_to_all(y_send, in2, out2, self.intra, 0.0, None, self.name, self.intra_b)
        # Forwarder: weight its node's expert outputs and sum them per received row (no index_add: deterministic).
        R1, K = w1.shape
        y_RKD = y2.new_zeros(R1 * K, y2.shape[-1]).index_put((copy_row[order2] * K + copy_k[order2],), y2)
        partial = (y_RKD.view(R1, K, y2.shape[-1]) * w1.unsqueeze(-1).to(y2.dtype)).sum(1)
        pending = Pending()
        self.stats.count_combine(partial)
        y1 = all_to_all(partial, in1, out1, self.inter, self.latency_s, pending, self.name, self.inter_b)

        def finish():
            D = y1.shape[-1]
            y_NTD = y1.new_zeros(self.n_nodes * T, D).index_put((pair_node * T + pair_tok,), y1)
            self.stats.combine_s += time.perf_counter() - t0
            return y_NTD.view(self.n_nodes, T, D).sum(0)
        return self._handle(finish, pending)


def exchange_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Non-differentiable uneven all-to-all (for integer metadata)."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out
