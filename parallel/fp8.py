"""FP8 training (DeepSeek-V3 recipe): swap a built model's linears and routed experts for FP8 versions.

``apply_fp8(model, backend="auto")`` replaces, by module name,
- MLA projections ``attn.{wqkv_a, wq_b, wkv_b, wo}``,
- dense-layer MLPs ``ffn.{w13, w2}`` and shared experts ``ffn.shared_experts.{w13, w2}``
  with ``FP8Linear``, and the routed experts ``ffn.experts`` with ``FP8GroupedExperts``. The new modules
  hold the *same* Parameter objects, so optimizer state, state-dict keys and checkpoints are unchanged.
Left alone (BF16/FP32): embedding, output head, MoE gate, norms, the attention core, MTP's ``eh_proj``.

Every converted GEMM runs in FP8 (E4M3) with FP32 accumulation promoted every 128 of K:
- Fprop  ``y  = x·Wᵀ``   x 1×128 tiles, W 128×128 blocks;
- Dgrad  ``dx = dy·W``   dy 1×128 tiles, W 128×128 blocks (the same quantised W, read transposed);
- Wgrad  ``dW = dyᵀ·x``  dy and x in 128×1 tiles (along tokens).
Where both FP8 copies of one tensor are needed (the input when Wgrad runs, the output gradient when Dgrad and
Wgrad both do), one ``quant_act_both`` launch makes them; otherwise the single quantiser runs.
The forward caches its input only in FP8 (the 128×1, transposed copy Wgrad needs) plus the FP8 weight, which
is quantised once per step and shared by the micro-batches in flight (``WeightFP8``, ``reuse_fp8_weights``);
master weights and gradients stay FP32. Outputs follow autocast (BF16 under ``torch.autocast``) or the
input dtype; ``dx`` has the input's dtype, ``dW`` the weight's.

Zero-bubble split (``parallel/wgrad.py``): with a ``wgrad_queue`` set, the backward quantises ``dyᵀ`` and
hands the Wgrad GEMM to the queue (``queue.submit``), which runs it now or, inside ``queue.collect``, at W —
the same FP8 operands either way, so the gradients are bit-identical.

Backends: ``kernels.get_ops`` (``auto`` is resolved per call from the input's device).
"""
from __future__ import annotations

import contextlib
import functools
import os
import re

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels import WGRAD_BF16_ENV
from kernels.reference import dequant
from models.layers import SwiGLU, swiglu
from models.moe import GroupedExperts

LINEAR_NAMES = re.compile(r"(^|\.)(attn\.(wqkv_a|wq_b|wkv_b|wo)|ffn\.(w13|w2)|shared_experts\.(w13|w2))$")
EXPERT_NAMES = re.compile(r"(^|\.)ffn\.experts$")


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32


def _quant_weight(ops, w: torch.Tensor, pow2: bool, transpose: bool):
    """``(q, s, q_t or None)``; the K-major transposed copy is made only when Dgrad will need it."""
    return ops.quant_weight(w, pow2, transpose=True) if transpose else (*ops.quant_weight(w, pow2), None)


class WeightFP8:
    """One weight's FP8 copy (128×128 blocks, plus the transposed copy Dgrad reads), made once per training
    step instead of at every micro-batch's forward, while ``active`` (``reuse_fp8_weights``: the trainer's
    forward/backward phase). The backward saves this copy, so the micro-batches in flight share one instead of
    each keeping its own (1 byte per weight element each). Only within that scope: weights change between
    steps in ways a cache cannot see (ZeRO writes the gathered values through ``.data``, which bumps no version
    counter), so inactive it quantises at every call. Inside, a changed storage or version makes a new copy."""

    def __init__(self):
        self.active, self.key, self.value = False, None, None

    def get(self, ops, w: torch.Tensor, pow2: bool, transpose: bool):
        if not self.active:
            return _quant_weight(ops, w, pow2, transpose)
        key = (w.data_ptr(), w._version, w.dtype, tuple(w.shape), pow2, id(ops))
        if key != self.key or (transpose and self.value[2] is None):
            self.value, self.key = _quant_weight(ops, w, pow2, transpose), key
        return self.value

    def release(self) -> None:
        self.active, self.key, self.value = False, None, None

    def __deepcopy__(self, memo):   # a copied module starts without a copy, outside any scope
        return WeightFP8()


def _weight(cache: WeightFP8 | None, ops, w: torch.Tensor, pow2: bool, transpose: bool):
    return _quant_weight(ops, w, pow2, transpose) if cache is None else cache.get(ops, w, pow2, transpose)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _wgrad(queue, param: torch.Tensor, gemm, *args) -> torch.Tensor | None:
    """The Wgrad GEMM ``gemm(*args)`` (FP32 out, in the weight's dtype) now, or — a ``WeightGradQueue``
    collecting a B — None after queueing it."""
    compute = functools.partial(_wgrad_gemm, gemm, param.dtype, *args)
    return compute() if queue is None else queue.submit(param, compute)


def _wgrad_gemm(gemm, dtype: torch.dtype, *args) -> torch.Tensor:
    """The Wgrad GEMM in the weight's dtype: FP32 out and a cast, or with ``WGRAD_BF16_ENV`` a BF16 weight's
    gradient written by the GEMM itself (the same bits: tests/test_fp8_kernels.py, tests/test_fp8_linear.py)."""
    with torch.autocast(args[0].device.type, enabled=False):
        if dtype == torch.bfloat16 and os.environ.get(WGRAD_BF16_ENV) == "1":
            return gemm(*args, torch.bfloat16)
        return gemm(*args, torch.float32).to(dtype)


class _FP8LinearFn(torch.autograd.Function):
    """``y = x·Wᵀ`` with Fprop, Dgrad and Wgrad in FP8; caches x only as FP8 (128×1, transposed)."""

    @staticmethod
    def forward(ctx, x, weight, ops, pow2, out_dtype, grad_on, queue=None, cache=None):
        with torch.autocast(x.device.type, enabled=False):
            xq, xs, *xt = _quant_copies(ops, _rows(x), None, pow2, True, grad_on and ctx.needs_input_grad[1])
            wq, ws, wq_t = _weight(cache, ops, weight, pow2, grad_on and ctx.needs_input_grad[0])
            y = ops.gemm(xq, xs, wq, ws, _gemm_dtype(out_dtype)).to(out_dtype)
        ctx.save_for_backward(*xt, wq_t, ws)
        ctx.ops, ctx.pow2, ctx.x_shape, ctx.x_dtype, ctx.queue = ops, pow2, x.shape, x.dtype, queue
        ctx.param = weight
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        xt_q, xt_s, wq_t, ws = ctx.saved_tensors
        ops, pow2 = ctx.ops, ctx.pow2
        dx = dw = None
        with torch.autocast(dy.device.type, enabled=False):
            dyq, dys, dyt_q, dyt_s = _quant_copies(ops, _rows(dy), None, pow2, *ctx.needs_input_grad[:2])
            if ctx.needs_input_grad[0]:
                dx = ops.gemm(dyq, dys, wq_t, ws.mT, _gemm_dtype(ctx.x_dtype)).to(ctx.x_dtype).view(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                dw = _wgrad(ctx.queue, ctx.param, ops.gemm, dyt_q, dyt_s, xt_q, xt_s)
        return dx, dw, None, None, None, None, None, None


class _FP8GroupedLinearFn(torch.autograd.Function):
    """Per-expert ``y_e = x_e·W_eᵀ`` over rows sorted by expert; the three GEMMs in FP8."""

    @staticmethod
    def forward(ctx, x, weight, tokens_per_expert, ops, pow2, out_dtype, grad_on, queue=None, cache=None):
        with torch.autocast(x.device.type, enabled=False):
            need_xt = grad_on and ctx.needs_input_grad[1]
            xq, xs, *xt = _quant_copies(ops, _rows(x), tokens_per_expert, pow2, True, need_xt)
            wq, ws, wq_t = _weight(cache, ops, weight, pow2, grad_on and ctx.needs_input_grad[0])
            y = ops.grouped_gemm(xq, xs, wq, ws, tokens_per_expert, _gemm_dtype(out_dtype)).to(out_dtype)
            xt = xt if need_xt else (None, None)
        ctx.save_for_backward(*xt, wq_t, ws, tokens_per_expert)
        ctx.ops, ctx.pow2, ctx.x_dtype, ctx.queue, ctx.param = ops, pow2, x.dtype, queue, weight
        return y

    @staticmethod
    def backward(ctx, dy):
        xt_q, xt_s, wq_t, ws, tpe = ctx.saved_tensors
        ops, pow2 = ctx.ops, ctx.pow2
        dx = dw = None
        with torch.autocast(dy.device.type, enabled=False):
            dyq, dys, dyt_q, dyt_s = _quant_copies(ops, _rows(dy), tpe, pow2, *ctx.needs_input_grad[:2])
            if ctx.needs_input_grad[0]:
                dx = ops.grouped_gemm(dyq, dys, wq_t, ws.mT, tpe, _gemm_dtype(ctx.x_dtype)).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                dw = _wgrad(ctx.queue, ctx.param, ops.grouped_wgrad, dyt_q, dyt_s, xt_q, xt_s, tpe)
        return dx, dw, None, None, None, None, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, backend: str = "auto", pow2_scales: bool = False,
               wgrad_queue=None, weight_cache: WeightFP8 | None = None):
    """``x [..., K] · weight [N, K]ᵀ`` in FP8 (differentiable in both; Wgrad through ``wgrad_queue`` if given;
    the weight quantised once per value with a ``weight_cache``)."""
    ops = kernels.get_ops(backend, x.device)
    return _FP8LinearFn.apply(x, weight, ops, pow2_scales, _out_dtype(x), torch.is_grad_enabled(), wgrad_queue,
                              weight_cache)


def fp8_grouped_linear(x_RK: torch.Tensor, w_ENK: torch.Tensor, tokens_per_expert: torch.Tensor,
                       backend: str = "auto", pow2_scales: bool = False, wgrad_queue=None,
                       weight_cache: WeightFP8 | None = None) -> torch.Tensor:
    """Rows of expert e of ``x_RK`` (sorted by expert) times ``w_ENK[e]ᵀ``, in FP8."""
    ops = kernels.get_ops(backend, x_RK.device)
    return _FP8GroupedLinearFn.apply(x_RK, w_ENK, tokens_per_expert, ops, pow2_scales, _out_dtype(x_RK),
                                     torch.is_grad_enabled(), wgrad_queue, weight_cache)


def _quant_copies(ops, x2: torch.Tensor, tokens_per_expert: torch.Tensor | None, pow2: bool, rows: bool,
                  cols: bool) -> tuple:
    """``(q, s, q_t, s_t)`` of rows ``x2``: the 1×128 copy (Fprop, Dgrad) if ``rows``, the 128×1 transposed one
    (Wgrad; tiles per expert with ``tokens_per_expert``) if ``cols``, None where not asked. Both: one launch
    (``quant_act_both``) that reads ``x2`` once."""
    if rows and cols:
        return ops.quant_act_both(x2, tokens_per_expert, pow2)
    return (*(ops.quant_act(x2, pow2) if rows else (None, None)),
            *(ops.quant_act_t(x2, tokens_per_expert, pow2) if cols else (None, None)))


class FP8Linear(nn.Linear):
    """``nn.Linear`` (no bias) whose Fprop, Dgrad and Wgrad run in FP8; same parameter, same keys."""

    wgrad_queue = None     # a parallel.wgrad.WeightGradQueue, set by apply_deferred_wgrad

    def __init__(self, in_features: int, out_features: int, backend: str = "auto", pow2_scales: bool = False,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)
        kernels.resolve_backend(backend, "cpu")
        self.backend, self.pow2_scales = backend, pow2_scales
        self.weight_fp8 = WeightFP8()

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: str = "auto", pow2_scales: bool = False) -> "FP8Linear":
        assert linear.bias is None, "FP8Linear: bias is not supported (the model's linears have none)"
        new = cls(linear.in_features, linear.out_features, backend, pow2_scales, device="meta")
        new.weight, new.wgrad_queue = linear.weight, getattr(linear, "wgrad_queue", None)
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.backend, self.pow2_scales, self.wgrad_queue, self.weight_fp8)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8 backend={self.backend}, pow2_scales={self.pow2_scales}"


class FP8GroupedExperts(GroupedExperts):
    """Routed SwiGLU experts with all GEMMs in FP8; holds the original stacked parameters."""

    wgrad_queue = None     # a parallel.wgrad.WeightGradQueue, set by apply_deferred_wgrad (or copied below)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weight_fp8 = {k: WeightFP8() for k in ("w13", "w2")}

    @classmethod
    def from_experts(cls, experts: GroupedExperts, backend: str = "auto", pow2_scales: bool = False):
        kernels.resolve_backend(backend, "cpu")
        E, D, F_ = experts.w2.shape
        with torch.device("meta"):
            new = cls(E, D, F_, experts.expert_offset)
        new.w13, new.w2 = experts.w13, experts.w2
        new.wgrad_queue = getattr(experts, "wgrad_queue", None)   # deferred Wgrad applied first (parallel/wgrad.py)
        new.backend, new.pow2_scales = backend, pow2_scales
        new.train(experts.training)
        return new

    def forward(self, x_RD: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``w13`` (gate and up, one GEMM: ``x_RD`` quantised once) and ``w2``, each a grouped FP8 GEMM."""
        args = (tokens_per_expert, self.backend, self.pow2_scales, self.wgrad_queue)
        c = self.weight_fp8
        h_RF = self.act(fp8_grouped_linear(x_RD, self.w13, *args, c["w13"]))
        return fp8_grouped_linear(h_RF, self.w2, *args, c["w2"])

    def extra_repr(self) -> str:
        return f"fp8 backend={self.backend}, pow2_scales={self.pow2_scales}"


class _FP8CachedSwiGLUFn(torch.autograd.Function):
    """``silu(h1) * h3`` of ``h13 = [h1 | h3]`` from the exact input, keeping it for backward only as FP8 (1×128
    tiles, the activations' quantisation); backward recomputes from the dequantised copy."""

    @staticmethod
    def forward(ctx, h13, ops, pow2):
        with torch.autocast(h13.device.type, enabled=False):
            out = swiglu(h13)
            ctx.save_for_backward(*ops.quant_act(_rows(h13), pow2))
        ctx.shape, ctx.dtype = h13.shape, h13.dtype
        return out

    @staticmethod
    def backward(ctx, g):
        q, s = ctx.saved_tensors
        with torch.autocast(g.device.type, enabled=False):
            h1, h3 = dequant(q, s).view(ctx.shape).chunk(2, dim=-1)
            g = g.float()
            # the kernels autograd runs for silu(h1) * h3 (mul's backward, then silu's, the halves' gradients
            # concatenated as chunk's backward does), so that the result is autograd's at the dequantised input
            # bit for bit
            d13 = torch.cat([torch.ops.aten.silu_backward(g * h3, h1), g * F.silu(h1)], dim=-1)
        return d13.to(ctx.dtype), None, None


class FP8CachedSwiGLU(SwiGLU):
    """The SwiGLU of a MoE layer's FP8 experts under ``train.recompute=selective`` (DeepSeek-V3 §3.3.2: the
    SwiGLU inputs in MoE are cached in FP8 and its output recomputed in backward): it keeps ``h13`` for backward
    as FP8 with 1×128 scales (1 byte + 4/128 per element instead of the activation dtype's 2 or 4) and
    recomputes the product's derivative from it. Set by ``parallel/recompute.py``, which copies the FP8 module's
    backend and scale mode here. Forward values are exact; gradients see the FP8 rounding of h1, h3."""

    recomputed = ("forward",)   # reported by parallel.recompute.regions like its checkpointed regions
    backend, pow2_scales = "auto", False

    def forward(self, h13: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or not h13.requires_grad:
            return super().forward(h13)
        return _FP8CachedSwiGLUFn.apply(h13, kernels.get_ops(self.backend, h13.device), self.pow2_scales)


def fp8_swiglus(model: nn.Module) -> dict[int, nn.Module]:
    """``id(SwiGLU) -> the FP8 module it belongs to`` for every MoE SwiGLU whose GEMMs are FP8: the routed
    experts' (``FP8GroupedExperts``) and the shared experts' (an MLP whose ``w13`` is an ``FP8Linear``)."""
    out = {}
    for m in model.modules():
        if isinstance(m, FP8GroupedExperts):
            out[id(m.act)] = m
        shared = getattr(m, "shared_experts", None)
        if isinstance(getattr(shared, "w13", None), FP8Linear):
            out[id(shared.act)] = shared.w13
    return out


def _weight_caches(model: nn.Module) -> list[WeightFP8]:
    out = []
    for m in model.modules():
        if isinstance(m, FP8Linear):
            out.append(m.weight_fp8)
        elif isinstance(m, FP8GroupedExperts):
            out += m.weight_fp8.values()
    return out


@contextlib.contextmanager
def reuse_fp8_weights(model: nn.Module):
    """Within: every FP8 module of ``model`` quantises each weight once (``WeightFP8``); on exit the copies are
    dropped (the backward keeps what it saved). Wrap one step's forwards and backwards, not the weight update."""
    caches = _weight_caches(model)
    for c in caches:
        c.active = True
    try:
        yield
    finally:
        for c in caches:
            c.release()


def apply_fp8(model: nn.Module, backend: str = "auto", pow2_scales: bool = False) -> list[str]:
    """Swap the FP8-eligible modules of ``model`` in place (see the module docstring); returns their names.

    Call after the model is built and on its device, before the optimizer is created or after (the
    parameters are the same objects). Idempotent: already converted modules are updated, not re-wrapped.
    """
    kernels.resolve_backend(backend, "cpu")
    if backend == "triton":
        kernels.get_ops("triton")            # fail now, not mid-step, when triton is missing
    converted = []
    for name, module in list(model.named_modules()):
        if isinstance(module, (FP8Linear, FP8GroupedExperts)):
            module.backend, module.pow2_scales = backend, pow2_scales
            converted.append(name)
            continue
        if LINEAR_NAMES.search(name) and isinstance(module, nn.Linear):
            new = FP8Linear.from_linear(module, backend, pow2_scales)
        elif EXPERT_NAMES.search(name) and isinstance(module, GroupedExperts):
            new = FP8GroupedExperts.from_experts(module, backend, pow2_scales)
        else:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
        converted.append(name)
    return converted
