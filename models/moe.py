"""DeepSeekMoE: shared experts + fine-grained routed experts, sigmoid gate, group(node)-limited routing,
aux-loss-free bias balancing and the complementary sequence-wise balance loss.

The experts never move tokens themselves: the layer hands its tokens, routing and experts to
``self.dispatcher.route`` (dispatch -> grouped expert compute -> combine), a generator that yields a ``Cut``
wherever rows travel (``models/steps.py``). ``MoE.forward`` drives it straight through; a pipeline drives
it piecewise. The default ``LocalDispatcher`` is the single-device reference; expert parallelism
(``parallel/``) swaps it for a communicating one.

Shape legend: T tokens (batch*seq flattened), D hidden, E routed experts, K experts per token,
G groups, R = T*K routed token copies, F expert intermediate size.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import MLP, SwiGLU, normal_in_order_
from .steps import Cut, LocalLink, Steps, carrying, drive


def ranks(x: torch.Tensor) -> torch.Tensor:
    """Each element's rank along the last dimension (0: the largest; equal values by index): ``ranks(x) < k``
    marks what ``x.topk(k)`` selects. Pairwise comparisons, for short rows (an expert group, the groups, a token's
    experts): work a compiled region fuses, where a top-k runs as torch's own kernels (on an H100, 80 us per call)."""
    n = x.shape[-1]
    i = torch.arange(n, device=x.device)
    x_i, x_j = x.unsqueeze(-1), x.unsqueeze(-2)
    return ((x_j > x_i) | ((x_j == x_i) & (i < i.unsqueeze(-1)))).sum(-1)


RANKED_ROW = 64   # rows up to this long are ranked (``ranks``: work that grows as its square), longer ones top-k'd


def top_k_indices(x_TE: torch.Tensor, k: int) -> torch.Tensor:
    """``x_TE.topk(k)[1]``: the ``k`` largest of each row, largest first; by ``ranks`` for rows up to
    ``RANKED_ROW`` (equal values by index)."""
    if x_TE.shape[-1] > RANKED_ROW:
        return x_TE.topk(k, dim=-1)[1]
    return (ranks(x_TE).unsqueeze(-1) == torch.arange(k, device=x_TE.device)).int().argmax(-2)


def select_experts(logits_TE: torch.Tensor, expert_bias_E: torch.Tensor, n_groups: int, group_topk: int,
                   n_limited: int, topk: int, route_scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gate after its GEMM: sigmoid scores, node-limited top-k on ``score + bias``, the chosen experts'
    unbiased scores normalised to sum 1 and scaled. The top-k's are ``ranks`` (the experts' through
    ``top_k_indices``, in order of their biased scores as ``topk`` returns them; ``topk`` itself past
    ``RANKED_ROW`` experts): one chain of elementwise work and reductions, so that a transform may run it as one
    compiled region (``parallel/compile.py``) without torch's top-k kernels.

    Returns ``(topk_idx [T,K] int64, topk_weight [T,K], scores [T,E])`` in ``logits_TE``'s dtype.
    """
    scores_TE = logits_TE.sigmoid()
    biased_TE = scores_TE.detach() + expert_bias_E
    if n_limited < n_groups:
        T = logits_TE.shape[0]
        biased_TGe = biased_TE.view(T, n_groups, -1)
        top_TGe = ranks(biased_TGe) < group_topk
        group_score_TG = torch.where(top_TGe, biased_TGe, 0.0).sum(-1)
        keep_TG = ranks(group_score_TG) < n_limited
        biased_TE = biased_TGe.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(T, -1)
    topk_idx_TK = top_k_indices(biased_TE, topk)
    w_TK = scores_TE.gather(1, topk_idx_TK)
    w_TK = w_TK / w_TK.sum(-1, keepdim=True) * route_scale
    return topk_idx_TK, w_TK, scores_TE


class Gate(nn.Module):
    """Sigmoid router with node-limited top-k selection (``select_experts``), in FP32.

    Selection uses ``score + expert_bias``; the gate values are the *unbiased* scores of the chosen
    experts, normalised to sum 1 and multiplied by ``route_scale``.
    """
    select = staticmethod(select_experts)   # everything after the GEMM (a transform may compile it)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts = cfg.n_routed_experts
        self.topk = cfg.n_activated_experts
        self.n_groups = cfg.n_expert_groups
        self.n_limited = cfg.n_limited_groups
        self.group_topk = cfg.effective_group_topk
        self.route_scale = cfg.route_scale
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.dim))
        # Balancing bias b_i: persistent (checkpointed), never trained by gradients.
        self.register_buffer("expert_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns ``(topk_idx [T,K] int64, topk_weight [T,K] fp32, scores [T,E] fp32)``, in FP32 under a BF16
        autocast too (which would run the GEMM in BF16)."""
        device = x_TD.device.type
        with torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext():
            logits_TE = F.linear(x_TD.float(), self.weight.float())
        return self.select(logits_TE, self.expert_bias, self.n_groups, self.group_topk, self.n_limited, self.topk,
                           self.route_scale)

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.weight, std=std)
        self.expert_bias.zero_()


def expert_counts(idx: torch.Tensor, n: int) -> torch.Tensor:
    """``torch.bincount(idx.flatten(), minlength=n)`` for ``idx < n``, without a host sync (CUDA's bincount
    reads the maximum on the host to size its output). Integer adds: exact and order-independent."""
    flat = idx.flatten()
    return torch.zeros(n, dtype=torch.long, device=idx.device).scatter_add_(0, flat, torch.ones_like(flat))


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked weights; computes on tokens already sorted by expert.

    Each expert's gate and up projections are one weight, ``w13 [E, 2F, D]`` (``[w1; w3]``, the gate's rows
    first, as ``MLP.w13``): one grouped GEMM reads the token copies once, and the backward gives their gradient in
    one grouped GEMM instead of two and an add over every copy."""

    def __init__(self, n_experts: int, dim: int, inter_dim: int, expert_offset: int | None = None):
        super().__init__()
        self.expert_offset = expert_offset   # global id of expert 0 when this holds a slice (parallel.ep), else None
        self.w13 = nn.Parameter(torch.empty(n_experts, 2 * inter_dim, dim))   # [gate; up]  [E,2F,D]
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, inter_dim))        # down        [E,D,F]
        self.act = SwiGLU()   # a module, so that train.recompute=selective covers it (parallel/recompute.py)

    def forward(self, x_RD: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x_RD``: token copies sorted by expert; ``tokens_per_expert [E]`` their counts."""
        w13, w2 = self.w13, self.w2
        if torch.is_autocast_enabled(x_RD.device.type):
            # autocast covers F.linear but not torch._grouped_mm: compute in the autocast dtype ourselves,
            # as the dense layers do (otherwise BF16 training runs the experts in FP32).
            dtype = torch.get_autocast_dtype(x_RD.device.type)
            x_RD, w13, w2 = (t.to(dtype) for t in (x_RD, w13, w2))
        if self._grouped_mm_ok(x_RD, w13):
            offs = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
            h_RF = self.act(torch._grouped_mm(x_RD, w13.transpose(-2, -1), offs=offs))
            return torch._grouped_mm(h_RF, w2.transpose(-2, -1), offs=offs)
        return self.forward_loop(x_RD, tokens_per_expert)

    def forward_loop(self, x_RD: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Reference: one matmul chain per expert."""
        outs = []
        for e, x in enumerate(torch.split(x_RD, tokens_per_expert.tolist())):
            outs.append(F.linear(self.act(F.linear(x, self.w13[e])), self.w2[e]))
        return torch.cat(outs) if outs else x_RD.new_zeros(0, self.w2.shape[1])

    @staticmethod
    def _grouped_mm_ok(x_RD: torch.Tensor, w: torch.Tensor) -> bool:
        # torch._grouped_mm needs 16-byte aligned strides and a floating dtype the backend supports.
        if not hasattr(torch, "_grouped_mm") or x_RD.dtype not in (torch.float32, torch.bfloat16):
            return False
        if w.dtype != x_RD.dtype:
            return False
        per_elem = x_RD.element_size()
        return (w.shape[1] * per_elem) % 16 == 0 and (w.shape[2] * per_elem) % 16 == 0

    def init_weights(self, std: float) -> None:
        gate, up = self.w13.chunk(2, dim=-2)
        normal_in_order_([gate, self.w2, up], std)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``argsort(order)`` of a permutation ``order``, by one scatter instead of a sort."""
    arange = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return torch.empty_like(order).scatter_(0, order, arange)


def gate_weighted_sum(y_TKD: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    """``sum_k w[t,k] * y[t,k]`` -> ``[T, D]`` in ``y``'s dtype. The dtype is explicit: CUDA's autocast runs a
    ``sum`` without one in FP32, which would turn the residual stream after the first MoE layer into FP32 (every
    later norm, linear input and gradient twice the bytes, plus a cast before each GEMM); CPU's autocast does
    not. The reduction accumulates in FP32 either way."""
    return (y_TKD * w_TK.unsqueeze(-1).to(y_TKD.dtype)).sum(1, dtype=y_TKD.dtype)


def index_copies(x_TD: torch.Tensor, order_R: torch.Tensor, K: int) -> torch.Tensor:
    """``x_TD[order_R // K]``: each token's K copies in the order ``order_R`` sorted them (the dispatch's gather;
    autograd's backward sums the copies' gradients per token by an accumulating index write)."""
    return x_TD[order_R // K]


class _GatherCopies(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, order_R: torch.Tensor, K: int) -> torch.Tensor:
        ctx.save_for_backward(order_R)
        ctx.K = K
        return index_copies(x_TD, order_R, K)

    @staticmethod
    def backward(ctx, g_RD: torch.Tensor):
        (order_R,) = ctx.saved_tensors
        g_RD = g_RD[inverse_permutation(order_R)]
        if ctx.K > 1:
            g_RD = g_RD.view(-1, ctx.K, g_RD.shape[-1]).sum(1, dtype=g_RD.dtype)   # see gate_weighted_sum
        return g_RD, None, None


def gather_copies(x_TD: torch.Tensor, order_R: torch.Tensor, K: int) -> torch.Tensor:
    """``index_copies`` for a permutation ``order_R`` of the T*K (token, k) copies, whose backward un-sorts the
    copies' gradients (a gather by the inverse permutation) and sums each token's K of them, where autograd's
    writes them into ``[T, D]`` by an accumulating index write (a sort of the indices, then atomic or segmented
    adds). The same sums: exact up to the order of K additions."""
    return _GatherCopies.apply(x_TD, order_R, K)


class _Unsort(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_sorted: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(order)
        return y_sorted[inverse_permutation(order)]

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (order,) = ctx.saved_tensors
        return g[order], None


def unsort_rows(y_sorted: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``y_sorted[argsort(order)]`` for a permutation ``order``: rows sorted by ``order`` put back. Its backward
    sorts the gradient's rows again (a gather by ``order``), where autograd's writes them into zeros by an index
    write (a zero fill and a scatter). Exact either way: each row moves once."""
    return _Unsort.apply(y_sorted, order)


def unsort_and_weight(y_sorted: torch.Tensor, order: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    """Expert outputs sorted by expert (``order`` sorted the T*K copies) back in (token, k) order,
    weighted by the gate and summed over k -> ``[T, D]``. A gather, not ``index_add``: deterministic."""
    T, K = w_TK.shape
    y_TKD = y_sorted[inverse_permutation(order)].view(T, K, y_sorted.shape[-1])
    return gate_weighted_sum(y_TKD, w_TK)


def unsort_rows_and_weight(y_sorted: torch.Tensor, order: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    """``unsort_and_weight`` with ``unsort_rows``' backward (the same values and gradients, bit for bit)."""
    T, K = w_TK.shape
    return gate_weighted_sum(unsort_rows(y_sorted, order).view(T, K, y_sorted.shape[-1]), w_TK)


class LocalDispatcher:
    """Single-device reference dispatcher: sort token copies by expert, un-sort and weight-sum back.

    Deterministic (a gather, not ``index_add``), and dropless. ``route`` cuts where an expert-parallel
    dispatcher's all-to-alls are, with nothing in flight (``link``, a ``LocalLink`` unless a benchmark gives its
    links a latency).
    """
    link = LocalLink
    gather = staticmethod(index_copies)       # the dispatch's copies of the tokens (a transform may replace it)
    weigh = staticmethod(unsort_and_weight)   # the combine's un-sort and weighted sum (a transform may compile it)

    def __init__(self, n_experts: int):
        self.n_experts = n_experts

    def dispatch(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Returns ``(x_RD sorted by expert, tokens_per_expert [E] int64, handle)``."""
        K = topk_idx_TK.shape[1]
        flat_R = topk_idx_TK.flatten()
        order_R = torch.argsort(flat_R, stable=True)
        tokens_per_expert = expert_counts(flat_R, self.n_experts)
        x_RD = self.gather(x_TD, order_R, K)
        return x_RD, tokens_per_expert, (order_R, topk_weight_TK)

    def combine(self, y_RD: torch.Tensor, handle: Any) -> torch.Tensor:
        order_R, w_TK = handle
        return self.weigh(y_RD, order_R, w_TK)

    def route(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weight_TK: torch.Tensor,
              experts: nn.Module) -> Steps:
        """dispatch | experts | combine, as steps; returns ``y_TD``. The gate weights cross the cuts."""
        x_RD, tokens_per_expert, (order_R, w_TK) = self.dispatch(x_TD, topk_idx_TK, topk_weight_TK)
        (w_TK,), (x_RD,) = yield Cut((w_TK,), [x_RD], self.link())
        y_RD = experts(x_RD, tokens_per_expert)
        (w_TK,), (y_RD,) = yield Cut((w_TK,), [y_RD], self.link())
        return self.combine(y_RD, (order_R, w_TK))


def balance_and_load(scores_BTE: torch.Tensor, topk_idx_BTK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Complementary sequence-wise balance loss (without alpha), averaged over sequences, and the routed copies
    per expert ``[E]`` (FP32, exact integers), from one count. A transform may run it as one compiled region.

    ``L = sum_i f_i * P_i`` per sequence, with ``f_i = E/(K*T) * #tokens choosing i`` and
    ``P_i = mean_t s'_{i,t}``, ``s'`` = scores normalised over all experts per token.
    """
    B, T, E = scores_BTE.shape
    K = topk_idx_BTK.shape[-1]
    ones = torch.ones(B, T * K, dtype=torch.float32, device=scores_BTE.device)
    counts_BE = torch.zeros(B, E, device=scores_BTE.device).scatter_add_(1, topk_idx_BTK.reshape(B, T * K), ones)
    f_BE = counts_BE * (E / (K * T))
    p_BE = (scores_BTE / scores_BTE.sum(-1, keepdim=True)).mean(1)
    return (f_BE * p_BE).sum(-1).mean(), counts_BE.sum(0)


def sequence_balance_loss(scores_BTE: torch.Tensor, topk_idx_BTK: torch.Tensor) -> torch.Tensor:
    """The complementary sequence-wise balance loss alone (``balance_and_load``)."""
    return balance_and_load(scores_BTE, topk_idx_BTK)[0]


@torch.no_grad()
def update_biases(moes: list["MoE"], load_LE: torch.Tensor, gamma: float) -> None:
    """Aux-loss-free balancing, sign rule: ``b_i += gamma * sign(mean_load - load_i)`` for each layer of
    ``moes`` at once (a few launches, not a few per layer); row l of ``load_LE`` is layer l's token count per
    expert over the whole global batch."""
    if not moes:
        return
    load_LE = load_LE.to(moes[0].gate.expert_bias)
    step_LE = gamma * torch.sign(load_LE.mean(-1, keepdim=True) - load_LE)
    torch._foreach_add_([m.gate.expert_bias for m in moes], list(step_LE.unbind(0)))


class MoE(nn.Module):
    balance_terms = staticmethod(balance_and_load)   # balance loss and load (a transform may compile it)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_experts = cfg.n_routed_experts
        self.gate = Gate(cfg)
        self.experts = GroupedExperts(cfg.n_routed_experts, cfg.dim, cfg.moe_inter_dim)
        self.shared_experts = MLP(cfg.dim, cfg.moe_inter_dim * cfg.n_shared_experts) if cfg.n_shared_experts else None
        self.dispatcher = LocalDispatcher(cfg.n_routed_experts)
        # Routed token copies per expert, summed over training forwards since the last bias update.
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.n_routed_experts), persistent=False)
        self.aux_loss: torch.Tensor | None = None   # sequence-wise balance loss of the last training forward

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return drive(self.steps(x_BTD))[0]

    def steps(self, x_BTD: torch.Tensor) -> Steps:
        """The layer as steps, cut wherever the dispatcher moves tokens. Returns ``(y, balance loss)``
        (the loss is None outside training); the layer input and the loss cross the cuts."""
        B, T, D = x_BTD.shape
        x_TD = x_BTD.reshape(B * T, D)
        topk_idx_TK, topk_w_TK, scores_TE = self.gate(x_TD)
        aux = self.balance(scores_TE.view(B, T, -1), topk_idx_TK.view(B, T, -1))
        routed = self.dispatcher.route(x_TD, topk_idx_TK, topk_w_TK, self.experts)
        y_TD, (x_TD, aux) = yield from carrying(routed, (x_TD, aux))
        return self.post_combine(y_TD, x_TD).view(B, T, D), aux

    def balance(self, scores_BTE: torch.Tensor, topk_idx_BTK: torch.Tensor) -> torch.Tensor | None:
        """In training: count the routed copies per expert (for the bias update) and return the
        sequence-wise balance loss (also kept as ``self.aux_loss``). None otherwise."""
        if not self.training:
            return None
        self.aux_loss, load_E = self.balance_terms(scores_BTE, topk_idx_BTK)
        with torch.no_grad():
            self.tokens_per_expert += load_E
        return self.aux_loss

    def post_combine(self, y_TD: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
        """The combined routed output plus the shared experts' output on the layer input."""
        return y_TD if self.shared_experts is None else y_TD + self.shared_experts(x_TD)

    def update_bias(self, load_E: torch.Tensor, gamma: float) -> None:
        """Aux-loss-free balancing of this layer (``update_biases``); ``load_E`` is the step's token count per
        expert over the whole global batch."""
        update_biases([self], load_E.unsqueeze(0), gamma)

    def init_weights(self, std: float) -> None:
        self.gate.init_weights(std)
        self.experts.init_weights(std)
        self.tokens_per_expert.zero_()
