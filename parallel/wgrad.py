"""Zero-bubble B/W without re-traversal: a backward computes input gradients at once and queues the
weight-gradient GEMMs, which W runs later (DualPipe's / ZB's split of the backward).

``apply_deferred_wgrad(model, queue)`` swaps, by type, every ``nn.Linear`` (MLA projections, dense MLPs,
shared experts, MTP's ``eh_proj``, the output head) for ``DeferredLinear`` and the routed experts
(``GroupedExperts``) for ``DeferredGroupedExperts``; FP8 modules (``apply_fp8`` ran first) keep their class
and get the queue (their FP8 Wgrad is deferred, FP8 numerics unchanged). Same Parameter objects, same
state-dict keys. Not GEMMs, so their gradients come at B: norms, the MoE gate, the embedding.

One (micro-batch, stage) ``key`` at a time::

    queue.backward(key, tensors, grads, leaves=[x], params=stage_params)   # B: dx, norms, gate, embedding
    queue.run(key)                                                        # W: the deferred dW GEMMs

B differentiates only the leaves and the non-deferred parameters (``inputs=``), so the deferred weights'
gradient accumulators — and ZeRO-2's post-accumulate hooks — do not run at B (a full backward inside
``collect`` would fire them with no gradient); nothing is retained, the graph is freed at B. W runs one
autograd node per weight (``_WeightGrad``) whose backward returns the summed dW, so the engine
accumulates ``.grad`` exactly as in a plain backward, one weight at a time, and every hook fires once
per parameter per W. Outside ``collect`` (a plain or F&B backward) the modules compute dW at once, like
``nn.Linear``. A deferred weight must be used only through its module (B does not differentiate it).

Numerics: the same ops as autograd's (``dW = dyᵀ·x``, ``dx = dy·W``, ``_grouped_mm`` with autograd's
operand layouts, ``silu_backward``), in the dtype the forward chose (BF16 under autocast; B and W run
with autocast off, so it does not matter where W is called): the gradients are bit-identical to the
plain backward's (tested: FP32, BF16 autocast, FP8), except on the per-expert loop reference (SiLU over
the whole tensor instead of per expert: ~1e-9 relative).

Shape legend: R routed token copies (sorted by expert), D hidden, F expert intermediate, E experts,
M rows, K in features, N out features.
"""
from __future__ import annotations

import contextlib
import functools
from collections import deque
from typing import Callable, Hashable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from models.layers import swiglu
from models.moe import GroupedExperts

from .fp8 import FP8GroupedExperts, FP8Linear

Compute = Callable[[], torch.Tensor]


class WeightGradQueue:
    """Deferred weight-gradient GEMMs, one segment per key (a B's closures until its W).

    Owned by whoever runs the step (``PipelineRunner``: one per model replica); ``apply_deferred_wgrad``
    registers the modules whose dW it may hold."""

    def __init__(self):
        self.modules: list[nn.Module] = []                   # registered by ``apply_deferred_wgrad``
        self._segments: dict[Hashable, list[tuple[nn.Parameter, Compute]]] = {}
        self._open: list | None = None

    @property
    def deferred(self) -> dict[int, nn.Parameter]:
        """The parameters whose dW this queue may hold, by id, read from its modules now: a model built on
        meta gets new ``Parameter`` objects when it is materialised after ``apply_deferred_wgrad``."""
        return {id(p): p for m in self.modules if m.wgrad_queue is self for p in m.parameters()}

    @property
    def deferring(self) -> bool:
        return self._open is not None

    def pending(self) -> list:
        """Keys whose W has not run (an executor checks this is empty at the end of a step)."""
        return list(self._segments)

    @contextlib.contextmanager
    def collect(self, key: Hashable) -> Iterator[list]:
        """Within the block, deferred modules queue their dW GEMMs under ``key`` instead of running them."""
        if self._open is not None:
            raise RuntimeError(f"WeightGradQueue.collect({key!r}): another B is still collecting")
        if key in self._segments:
            raise RuntimeError(f"WeightGradQueue.collect({key!r}): its previous W has not run")
        self._open = segment = []
        try:
            yield segment
            self._segments[key] = segment
        finally:
            self._open = None

    def submit(self, param: nn.Parameter, compute: Compute) -> torch.Tensor | None:
        """Called by a backward: ``compute()`` (dW) now, or None after queueing it while collecting."""
        if self._open is None:
            return compute()
        self._open.append((param, compute))
        return None

    def b_inputs(self, leaves: list, params) -> list[torch.Tensor]:
        """What B differentiates: ``leaves`` (None skipped) and the ``params`` that are not deferred."""
        deferred = self.deferred
        rest = [p for p in params if p.requires_grad and id(p) not in deferred]
        return [t for t in leaves if t is not None] + rest

    def backward(self, key: Hashable, tensors: list, grads: list, leaves: list, params) -> None:
        """B of one (micro-batch, stage): gradients of ``leaves`` and of the non-deferred ``params``;
        the deferred dW GEMMs wait under ``key``. Frees the graph (no ``retain_graph``)."""
        inputs = self.b_inputs(leaves, params)
        if not inputs:
            raise ValueError(f"WeightGradQueue.backward({key!r}): no input leaf and no non-deferred parameter: "
                             "nothing for B to differentiate (run the full backward instead)")
        with self.collect(key):
            torch.autograd.backward(tensors, grads, inputs=inputs)

    def run(self, key: Hashable) -> None:
        """W of ``key``: run its dW GEMMs, sum per parameter, accumulate into ``.grad`` through autograd
        (post-accumulate hooks fire once per parameter)."""
        if key not in self._segments:
            raise KeyError(f"WeightGradQueue.run({key!r}): no B collected under this key")
        per_param: dict[int, tuple[nn.Parameter, deque]] = {}
        for param, compute in self._segments.pop(key):          # in B's order: summed in that order
            per_param.setdefault(id(param), (param, deque()))[1].append(compute)
        if per_param:
            with torch.enable_grad():
                roots = [_WeightGrad.apply(computes, param) for param, computes in per_param.values()]
            per_param.clear()
            torch.autograd.backward(roots)


class _WeightGrad(torch.autograd.Function):
    """A graph root over one weight whose backward runs that weight's queued dW GEMMs and sums them: the
    engine hands the dW to the weight's accumulator as a plain backward does (``.grad`` takes the tensor
    when empty, else adds it in place; hooks fire once), one weight at a time, so W holds one dW at most."""

    @staticmethod
    def forward(ctx, computes: deque, param: nn.Parameter):
        ctx.computes = computes
        return torch.zeros((), device=param.device)

    @staticmethod
    @once_differentiable
    def backward(ctx, _):
        dw = None
        while ctx.computes:                          # pop as we go: each closure's tensors free after use
            compute = ctx.computes.popleft()
            dw = compute() if dw is None else dw + compute()
        return None, dw


# ---------------------------------------------------------------------------------------------- linear
def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def _autocast_off(t: torch.Tensor):
    """Autocast off on ``t``'s device (the dtypes are chosen explicitly); a no-op context when it is off."""
    on = torch.is_autocast_enabled(t.device.type)
    return torch.autocast(t.device.type, enabled=False) if on else contextlib.nullcontext()


def _submit(queue: WeightGradQueue | None, param: nn.Parameter, compute: Compute) -> torch.Tensor | None:
    return compute() if queue is None else queue.submit(param, compute)


def _linear_wgrad(dy_MN: torch.Tensor, x_MK: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with _autocast_off(dy_MN):
        return dy_MN.t().mm(x_MK).to(dtype)    # autograd's mm_mat2_backward for ``x·Wᵀ``


class _LinearFn(torch.autograd.Function):
    """``y = x·Wᵀ`` (autocast like ``F.linear``); backward: dx now, dW through the queue."""

    @staticmethod
    def forward(ctx, x, weight, queue):
        dtype = _compute_dtype(x)
        with _autocast_off(x):
            xc, wc = x.to(dtype), weight.to(dtype)
            y = F.linear(xc, wc)
        ctx.save_for_backward(xc, wc)
        ctx.queue, ctx.param, ctx.x_dtype = queue, weight, x.dtype
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        xc, wc = ctx.saved_tensors
        dy_MN = dy.reshape(-1, dy.shape[-1])
        with _autocast_off(dy):      # the dtypes were chosen in forward
            dx = dy_MN.mm(wc).view(xc.shape).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            compute = functools.partial(_linear_wgrad, dy_MN, xc.reshape(-1, xc.shape[-1]), ctx.param.dtype)
            dw = _submit(ctx.queue, ctx.param, compute)
        return dx, dw, None


class DeferredLinear(nn.Linear):
    """``nn.Linear`` (no bias) whose weight gradient a ``WeightGradQueue`` may defer; same parameter."""

    wgrad_queue: WeightGradQueue | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, queue: WeightGradQueue) -> "DeferredLinear":
        new = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        new.weight, new.wgrad_queue = linear.weight, queue
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearFn.apply(x, self.weight, self.wgrad_queue)


# --------------------------------------------------------------------------------------- routed experts
class ExpertGemms:
    """The expert GEMMs on rows sorted by expert: ``torch._grouped_mm`` (autograd's operand layouts) or
    the per-expert loop, the reference (chosen like ``GroupedExperts.forward``)."""

    def __init__(self, tokens_per_expert: torch.Tensor, grouped: bool):
        self.grouped = grouped
        if grouped:
            self.offs = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
        else:
            self.counts = tokens_per_expert.tolist()

    def fprop(self, a_MK: torch.Tensor, w_ENK: torch.Tensor) -> torch.Tensor:
        """Rows of expert e times ``w[e]ᵀ`` -> ``[M, N]``."""
        if self.grouped:
            return torch._grouped_mm(a_MK, w_ENK.transpose(-2, -1), offs=self.offs)
        return torch.cat([a.mm(w_ENK[e].t()) for e, a in enumerate(a_MK.split(self.counts))])

    def dgrad(self, d_MN: torch.Tensor, w_ENK: torch.Tensor) -> torch.Tensor:
        """Rows of expert e times ``w[e]`` -> ``[M, K]``."""
        if self.grouped:
            return torch._grouped_mm(d_MN, w_ENK, offs=self.offs)
        return torch.cat([d.mm(w_ENK[e]) for e, d in enumerate(d_MN.split(self.counts))])

    def wgrad(self, d_MN: torch.Tensor, a_MK: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``dW[e] = d_eᵀ·a_e`` over expert e's rows -> ``[E, N, K]`` (zeros for experts without rows)."""
        with _autocast_off(d_MN):
            if self.grouped:
                return torch._grouped_mm(d_MN.t(), a_MK, offs=self.offs).to(dtype)
            pairs = zip(d_MN.split(self.counts), a_MK.split(self.counts))
            return torch.stack([d.t().mm(a) for d, a in pairs]).to(dtype)


class _ExpertsFn(torch.autograd.Function):
    """SwiGLU experts ``y = swiglu(x·W13ᵀ)·W2ᵀ`` per expert; saves x and h13 (recomputes the activation in
    backward, as V3 does), returns dx at once and queues dW13, dW2."""

    @staticmethod
    def forward(ctx, x_RD, w13, w2, tokens_per_expert, queue):
        dtype = _compute_dtype(x_RD)
        with _autocast_off(x_RD):
            x, w13c, w2c = (t.to(dtype) for t in (x_RD, w13, w2))
            mm = ExpertGemms(tokens_per_expert, GroupedExperts._grouped_mm_ok(x, w13c))
            h13 = mm.fprop(x, w13c)
            y = mm.fprop(swiglu(h13), w2c)
        ctx.save_for_backward(x, h13, w13c, w2c)
        ctx.mm, ctx.queue, ctx.params, ctx.x_dtype = mm, queue, (w13, w2), x_RD.dtype
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_RD):
        x, h13, w13c, w2c = ctx.saved_tensors
        mm, (w13, w2) = ctx.mm, ctx.params
        with _autocast_off(dy_RD):      # the dtypes were chosen in forward
            h1_RF, h3_RF = h13.chunk(2, dim=-1)
            s1_RF = F.silu(h1_RF)
            da_RF = mm.dgrad(dy_RD, w2c)
            dh13 = torch.empty_like(h13)   # the halves' gradients written in place: no concatenation
            dh1_RF, dh3_RF = dh13.chunk(2, dim=-1)
            torch.ops.aten.silu_backward.grad_input(da_RF * h3_RF, h1_RF, grad_input=dh1_RF)
            torch.mul(da_RF, s1_RF, out=dh3_RF)
            dx = mm.dgrad(dh13, w13c).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
            a_RF = s1_RF * h3_RF
        dws = []
        for i, (param, d, a) in enumerate(((w13, dh13, x), (w2, dy_RD, a_RF))):
            need = ctx.needs_input_grad[1 + i]
            dws.append(_submit(ctx.queue, param, functools.partial(mm.wgrad, d, a, param.dtype)) if need else None)
        return dx, *dws, None, None


class DeferredGroupedExperts(GroupedExperts):
    """Routed SwiGLU experts whose weight gradients a ``WeightGradQueue`` may defer; same parameters."""

    wgrad_queue: WeightGradQueue | None = None

    @classmethod
    def from_experts(cls, experts: GroupedExperts, queue: WeightGradQueue) -> "DeferredGroupedExperts":
        E, D, F_ = experts.w2.shape
        with torch.device("meta"):
            new = cls(E, D, F_, experts.expert_offset)
        new.w13, new.w2 = experts.w13, experts.w2
        new.wgrad_queue = queue
        new.train(experts.training)
        return new

    def forward(self, x_RD: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return _ExpertsFn.apply(x_RD, self.w13, self.w2, tokens_per_expert, self.wgrad_queue)


# --------------------------------------------------------------------------------------------- converter
def apply_deferred_wgrad(model: nn.Module, queue: WeightGradQueue) -> list[str]:
    """Make every linear and routed-expert module of ``model`` defer its dW GEMMs into ``queue`` (see the
    module docstring); returns their names. Idempotent; a second call moves them to the new queue."""
    names = []
    for name, module in list(model.named_modules()):
        if isinstance(module, (FP8Linear, FP8GroupedExperts, DeferredLinear, DeferredGroupedExperts)):
            module.wgrad_queue = queue                     # FP8 keeps its class and numerics
            new = module
        elif isinstance(module, nn.Linear):
            if module.bias is not None:
                raise ValueError(f"apply_deferred_wgrad: {name or 'model'} has a bias (the model's linears have none)")
            new = DeferredLinear.from_linear(module, queue)
        elif isinstance(module, GroupedExperts):
            new = DeferredGroupedExperts.from_experts(module, queue)
        else:
            continue
        if new is not module:
            if not name:
                raise ValueError("apply_deferred_wgrad: pass the model that holds the module, not the module")
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, new)
        if not any(m is new for m in queue.modules):
            queue.modules.append(new)
        names.append(name)
    return names
