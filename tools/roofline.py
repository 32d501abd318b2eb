"""The GPU cost of one training step, predicted on the CPU: ``python -m tools.roofline +exp=v3_small [overrides]``.

The step of ``Trainer.train_step`` on one device (forward and backward of every micro-batch under the run's
autocast, with CUDA's rules for its FP32 ops: ``tools.cuda_autocast``; the check for non-finite gradients, the
optimizer step with its clip, ``zero_grad``, the expert-bias update) runs on fake tensors
(``FakeTensorMode``: shapes and dtypes, no data, seconds on a CPU), while a dispatch mode records every aten op
the step issues, by phase (``forward``, ``backward``, ``optimizer``, ``other``): its FLOPs (torch's
``flop_registry``), the bytes it reads and writes in memory (its tensor inputs and outputs, views excluded), one
kernel launch per op that is not a view, and host synchronisations (``.item()``, ``.tolist()``, ``nonzero``).
Attention runs as one fused kernel (``F.scaled_dot_product_attention``, as CUDA runs it), not the CPU's
decomposition; with ``train.precision=fp8`` the FP8 modules' quantisers and GEMMs are the kernels CUDA's ``auto``
backend launches (``tools/roofline_fp8.py``).

Predicted time on an H100, per op: ``max(FLOPs / rate of its class, bytes / bandwidth of its class)`` plus a
per-launch cost; the constants (``H100``) and where each comes from are listed in ``H100.sources``. The report
prints per phase, per op class and for the ``--top N`` costliest ops (each per phase): calls, FLOPs, bytes,
launches, syncs and predicted ms; its last line is ``predicted step: <ms> ms on H100 (<mfu> % MFU)``, MFU
against the dense BF16 peak (989 TFLOP/s) with the model
FLOPs of ``models.params.flops_per_token``.

Batch: ``train.micro_batch_size`` x ``data.seq_len`` tokens per micro-batch, ``--micro-batches N`` of them per step
(default 1: the single-GPU step of the measured profiles). ``--layers N`` cuts the model to N layers (the
measured 4-layer step).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import sys
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

PHASES = ("forward", "backward", "optimizer", "other")
# Ops that launch no kernel (views, metadata, aliases): no bytes, no launch.
NO_KERNEL = {"aten.view", "aten._unsafe_view", "aten.t", "aten.transpose", "aten.expand", "aten.permute",
             "aten.as_strided", "aten.slice", "aten.select", "aten.detach", "aten.unsqueeze", "aten.squeeze",
             "aten.split", "aten.split_with_sizes", "aten.alias", "aten.unbind", "aten.view_as_real",
             "aten.view_as_complex", "aten._reshape_alias", "aten.reshape", "aten.unflatten", "aten.flatten",
             "aten.chunk", "aten.narrow", "aten.diagonal", "aten.lift_fresh", "aten.empty", "aten.empty_like",
             "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided", "aten.is_same_size", "aten.sym_size",
             "aten.sym_stride", "aten.sym_numel", "aten.sym_storage_offset", "aten._to_copy_noop", "prim.device",
             "prim.layout", "aten.is_nonzero", "aten._has_compatible_shallow_copy_type", "aten.set_",
             "aten.resize_", "aten._local_scalar_dense_view"}
SYNC = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.repeat_interleave",
        "aten.bincount", "aten.unique", "aten._unique2"}
GEMM = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"}
# Ops that write a new tensor without reading their tensor arguments' data.
FACTORIES = {"aten.zeros", "aten.zeros_like", "aten.ones", "aten.ones_like", "aten.full", "aten.full_like",
             "aten.new_zeros", "aten.new_ones", "aten.new_full", "aten.scalar_tensor", "aten.arange", "aten.fill_",
             "aten.zero_", "aten.randint", "aten.rand", "aten.randn", "aten.normal_", "aten.uniform_"}


def grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, *args, **kwargs) -> float:
    """FLOPs of ``torch._grouped_mm`` (not in torch's flop registry): 2 x the products of its groups."""
    if a.dim() == 2 and b.dim() == 3:          # rows grouped by offs: [R, K] x [E, K, N]
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[2]
    if a.dim() == 2 and b.dim() == 2:          # the contraction grouped (weight gradients): [M, K] x [K, N]
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    if a.dim() == 3 and b.dim() == 2:          # [E, M, K] x [K, N], N grouped
        return 2.0 * a.shape[1] * a.shape[2] * b.shape[1]
    return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]   # batched [E, M, K] x [E, K, N]


EXTRA_FLOPS = {"aten._grouped_mm": grouped_mm_flops}
SORTS = {"aten.sort", "aten.topk", "aten.argsort"}
INDEX_PUT = {"aten.index_put", "aten.index_put_", "aten._index_put_impl_"}


def op_class(name: str, args: tuple = (), kwargs: dict | None = None) -> str:
    """The class an op's rate and bandwidth come from (``args``: an index write's ``accumulate``)."""
    if name in SORTS:
        return "sort / top-k"
    if name in INDEX_PUT and (kwargs or {}).get("accumulate", len(args) > 3 and bool(args[3])):
        return "accumulating index write"
    if name in GEMM:
        return "gemm"
    if name == "aten._grouped_mm":
        return "grouped gemm"
    if name.startswith("attention"):
        return "attention"
    if name in ("aten._to_copy", "aten.copy_", "aten.clone"):
        return "copy / cast"
    if name.startswith("compiled region"):
        return "compiled elementwise"
    if name.startswith("aten._foreach") or name.startswith("aten._fused_adam"):
        return "optimizer (foreach)"
    if name.startswith("adamw kernel"):
        return "optimizer"
    if name.startswith("fp8 "):           # tools/roofline_fp8.py: its kernel names are its classes
        return name
    if "softmax" in name or "nll_loss" in name or name.startswith("cross-entropy"):
        return "softmax / loss"
    return "elementwise / other"


@dataclass(frozen=True)
class Hardware:
    """Achieved rates of one H100 SXM (torch 2.11), per op class; ``sources`` says where each comes from."""
    name: str = "H100"
    peak_bf16: float = 989e12
    rates: dict = field(default_factory=lambda: {"gemm": 700e12, "grouped gemm": 600e12, "attention": 300e12,
                                                  "fp8 gemm": 1090e12, "fp8 gemm wgrad": 860e12,
                                                  "fp8 grouped gemm": 520e12, "fp8 grouped wgrad": 420e12})
    bandwidth: dict = field(default_factory=lambda: {"copy / cast": 2.7e12, "optimizer (foreach)": 2.7e12,
                                                      "softmax / loss": 2.7e12, "elementwise / other": 2.7e12,
                                                      "compiled elementwise": 2.7e12, "sort / top-k": 34e9,
                                                      "accumulating index write": 0.83e12,
                                                      "fp8 quantise 1x128": 2.3e12, "fp8 quantise 128x1": 2.1e12,
                                                      "fp8 quantise 128x128": 2.0e12, "fp8 transpose": 2.7e12})
    launch_s: float = 6.7e-6
    sources: tuple = ()


H100 = Hardware(sources=(
    "gemm 700 TFLOP/s: torch BF16 matmul in the GPU suite, 671-792 TFLOP/s at M 4096-16384, N, K 2048-16384 "
    "(docs/benchmarks.md)",
    "grouped gemm 600 TFLOP/s: torch._grouped_mm BF16 in the suite, 574-670 TFLOP/s (32,768 token copies, D 7168)",
    "attention 300 TFLOP/s: an assumption (no attention kernel was timed); FlashAttention-2-class kernels reach "
    "~35 % of the BF16 peak at head dims 96/64",
    "bandwidth 2.7 TB/s: a device-to-device copy in the suite, 2,637-2,938 GB/s (read + write)",
    "sort / top-k 34 GB/s of their tensors' bytes: the default's 12-layer step on an H100, profiled "
    "before the routers' ranks (docs/log/, the regions and AdamW bisect): 36 top-k's (gatherTopK + bitonicSort, "
    "2.87 ms) and 12 radix sorts (0.53 ms of 37 at 44 us) over 0.106 GB, launches apart",
    "accumulating index write 0.83 TB/s: the present default's 12-layer step on an H100, profiled "
    "(docs/benchmarks.md, One H100): 12 BF16 index_put(accumulate=True) backward writes, "
    "indexing_backward 2.19 ms + a radix sort each, over 2.02 GB, launches apart (FP32 writes, before the residual "
    "stream was BF16 on CUDA, ran 1.65 ms for 10 of twice the bytes: this rate overprices them)",
    "fp8 gemm 1,090 TFLOP/s, fp8 gemm wgrad 860: torch's blockwise scaled_mm (cuBLASLt), which the auto backend "
    "runs for dense FP8 GEMMs, in the suite's gemm part (docs/log/, the tuning and fused CE session): Fprop and "
    "Dgrad 1,030-1,148 TFLOP/s, Wgrad (1x128 x 1x128) 838-922, at M 4096-16384, N, K 2048-16384",
    "fp8 grouped gemm 520 TFLOP/s, fp8 grouped wgrad 420: the Triton grouped kernels with the H100 tuning table, "
    "same session: Fprop and Dgrad 463-575 TFLOP/s, Wgrad 355-500 (32,768 token copies, D 7168, F 2048, 8 or 32 "
    "experts)",
    "fp8 quantisers 2.3 (1x128), 2.1 (128x1, transposed), 2.0 TB/s (128x128): bytes read and written over time, "
    "0.84-0.89, 0.74-0.80 and 0.73-0.78 of a device copy (docs/benchmarks.md, One H100, GPU suite); fp8 transpose "
    "(the weights' Dgrad copy): copy speed, an assumption (not timed alone)",
    "launch 6.7 us: the first H100 run's profile of the 4-layer v3_small step (../shared/gpu/, "
    "profile_v3small_4layers_bf16.txt), (wall 141.3 ms - GPU kernel "
    "time 126.6 ms) / 2,191 launches; replayed from a CUDA graph (train.cuda_graph) the 12-layer step leaves "
    "1.3 us between kernels ((wall 120.7 - kernel time 115.8 ms) / 3,649 launches), so the 6.7 us now stand "
    "for each kernel's cost beyond its FLOPs and bytes, which the rates miss",
))


@dataclass
class Stat:
    calls: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    launches: int = 0
    syncs: int = 0
    seconds: float = 0.0

    def add(self, other: "Stat") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _nbytes(ts: list[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in ts:
        key = (id(t.untyped_storage()) if t.device.type != "meta" else id(t), t.storage_offset(), t.shape)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


class Recorder(TorchDispatchMode):
    """Records every aten op under it into ``stats[(phase, class, op)]``; ``phase`` is set by the driver."""

    def __init__(self, hw: Hardware = H100):
        super().__init__()
        self.hw, self.phase = hw, "other"
        self.stats: dict[tuple[str, str, str], Stat] = collections.defaultdict(Stat)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.record(str(func.overloadpacket), func.overloadpacket, args, kwargs, out)
        return out

    def record(self, name: str, packet, args, kwargs, out, flops: float | None = None) -> None:
        s = Stat(calls=1)
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        host = self.phase == "optimizer" and all(t.dim() == 0 for t in inputs + outputs)
        if name in SYNC and not host:
            s.syncs = 1
        if name not in NO_KERNEL and not name.startswith("profiler.") and not host:
            s.launches = _launches(name, args)
            read = [] if name in FACTORIES else inputs
            s.bytes = _nbytes(read) + _nbytes(outputs or _written(name, args))
            if flops is None:
                from torch.utils.flop_counter import flop_registry
                if name in EXTRA_FLOPS:
                    flops = EXTRA_FLOPS[name](*args, **kwargs)
                else:
                    fn = flop_registry.get(packet) if packet is not None else None
                    flops = fn(*args, **kwargs, out_val=out) if fn is not None else 0.0
            s.flops = flops
            s.seconds = self.seconds(op_class(name, args, kwargs), s)
        self.stats[(self.phase, op_class(name, args, kwargs), name)].add(s)

    def seconds(self, cls: str, s: Stat) -> float:
        compute = s.flops / self.hw.rates[cls] if cls in self.hw.rates else 0.0
        memory = s.bytes / self.hw.bandwidth.get(cls, self.hw.bandwidth["elementwise / other"])
        return max(compute, memory) + s.launches * self.hw.launch_s


def _written(name: str, args: tuple) -> list[torch.Tensor]:
    """What an in-place op that returns nothing writes: its first argument (a tensor or a list of them:
    ``_foreach_add_``); ``_fused_adam(w)_``: the parameters and both moments."""
    if not name.endswith("_") or not args:
        return []
    if name.startswith("aten._fused_adam"):
        return _tensors((args[0], args[2], args[3]))
    return _tensors(args[0])


FOREACH_TENSORS_PER_LAUNCH = 2   # measured: AdamW's 2 _foreach_addcdiv_ calls over 83 tensors launched 45 kernels


def _launches(name: str, args: tuple) -> int:
    """Kernels an op launches: one, or for a ``_foreach`` op one per ``FOREACH_TENSORS_PER_LAUNCH`` tensors of
    its first list (``multi_tensor_apply`` packs tensors into a launch up to a byte budget)."""
    if name.startswith(("aten._foreach", "aten._fused_adam")) and args and isinstance(args[0], (list, tuple)):
        return max(1, -(-len(args[0]) // FOREACH_TENSORS_PER_LAUNCH))
    return 1


@contextlib.contextmanager
def as_on_cuda(fused_adamw: bool = True, adamw_kernel: bool = True):
    """The CUDA choices on the fake CPU tensors: AdamW and the gradient clip take their ``_foreach`` paths (torch's
    default for CUDA parameters), ``parallel.zero.fused_adamw`` says yes, and ``parallel.zero.triton_adamw`` says
    ``adamw_kernel`` (the optimizers' default on CUDA; its launches are recorded by ``adamw_kernel_recorded``)."""
    import torch.nn.utils.clip_grad as clip_grad
    import torch.optim.adam as adam

    import parallel.zero as zero
    saved = (adam._default_to_fused_or_foreach, clip_grad._has_foreach_support, clip_grad._device_has_foreach_support,
             zero.fused_adamw, zero.triton_adamw)
    adam._default_to_fused_or_foreach = lambda params, differentiable, use_fused=False: (False, True)
    clip_grad._has_foreach_support = lambda tensors, device: True
    clip_grad._device_has_foreach_support = lambda device: True
    zero.fused_adamw = lambda tensors: fused_adamw and bool(tensors)
    zero.triton_adamw = lambda tensors: adamw_kernel and bool(tensors)
    try:
        yield
    finally:
        (adam._default_to_fused_or_foreach, clip_grad._has_foreach_support, clip_grad._device_has_foreach_support,
         zero.fused_adamw, zero.triton_adamw) = saved


@contextlib.contextmanager
def adamw_kernel_recorded(recorder: "Recorder"):
    """``kernels/adamw.py``'s Triton AdamW as CUDA runs it, recorded instead of run (fake tensors run no Triton):
    one launch per call that reads the gradient, master and both moments once and writes master, moments and the
    BF16 weight once (class ``optimizer``); a split master (int16 low halves) reads the BF16 weight too, its high
    halves; its self-check taken as passed."""
    from kernels import adamw

    def launch(master, grad, exp_avg, exp_avg_sq, *, out=None, **hyper):
        written = (master, exp_avg, exp_avg_sq) + ((out,) if out is not None else ())
        read = (master, grad, exp_avg, exp_avg_sq) + ((out,) if master.dtype == torch.int16 else ())
        recorder.record("adamw kernel", None, read, {}, written, 0.0)

    saved = adamw.triton_adamw_, adamw.usable
    adamw.triton_adamw_, adamw.usable = launch, lambda device, split=False: True
    try:
        yield
    finally:
        adamw.triton_adamw_, adamw.usable = saved


# ---- attention as one fused kernel ------------------------------------------------------------------------
def attention_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> float:
    """Forward FLOPs of attention: QKᵀ and PV, halved when causal."""
    B, H, T, D = q.shape
    S, Dv = k.shape[-2], v.shape[-1]
    return 2.0 * B * H * T * S * (D + Dv) * (0.5 if causal else 1.0)


class _FusedAttention(torch.autograd.Function):
    """``scaled_dot_product_attention`` as CUDA runs it (one kernel forward, one backward: 2.5x the forward
    FLOPs, the scores recomputed), recorded as such, its output laid out like the query; on fake tensors the
    values do not matter."""

    @staticmethod
    def forward(ctx, q, k, v, causal, recorder):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        if q.transpose(1, 2).is_contiguous():   # laid out like the query, as cuDNN's kernel lays it out
            out = out.transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v)
        ctx.causal, ctx.recorder = causal, recorder
        recorder.record("attention forward", None, (q, k, v), {}, out, attention_flops(q, k, v, causal))
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        ctx.recorder.record("attention backward", None, (q, k, v, dout), {}, (dq, dk, dv),
                            2.5 * attention_flops(q, k, v, ctx.causal))
        return dq, dk, dv, None, None


@contextlib.contextmanager
def fused_attention(recorder: Recorder):
    """``F.scaled_dot_product_attention`` replaced by ``_FusedAttention`` for the duration."""
    original = torch.nn.functional.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        assert attn_mask is None and dropout_p == 0.0, "the roofline models causal attention without a mask"
        with _paused(recorder):
            return _FusedAttention.apply(q, k, v, is_causal, recorder)

    torch.nn.functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


# Ops inductor leaves to torch's own kernels inside a region (``topk``, ``sort``: unless ``decompose_sort_ops``; the
# H100 profile of the default step counted a radix sort for each combine region's argsort when it had one).
REGION_EXTERN = {"aten.topk", "aten.sort"} | GEMM


class _CompiledRegion(torch.autograd.Function):
    """A ``parallel/compile.py`` region as inductor runs it: one generated kernel forward (reads the inputs,
    writes the output), one backward (reads the inputs and the output's gradient, writes the inputs' gradients)
    plus one reduction per gradient that the eager backward sums into (a norm's weight, a MoE gate, a rope key
    shared by the heads). Its aten ops run unrecorded: the region's cost is its memory traffic, not the sum of
    its eager ops; except the forward's ``REGION_EXTERN`` ops, which run as torch's kernels (recorded as
    themselves) and split the generated code: one more generated kernel after each."""

    @staticmethod
    def forward(ctx, fn, recorder, *inputs):
        ctx.fn, ctx.recorder = fn, recorder
        ctx.grads = ctx.needs_input_grad[2:]
        ctx.save_for_backward(*[t for t in inputs if isinstance(t, torch.Tensor)])
        ctx.others = [None if isinstance(t, torch.Tensor) else t for t in inputs]
        externs: list[tuple] = []
        with _paused(recorder, externs=externs):
            out = fn(*inputs)
        recorder.record("compiled region forward", None, [t for t in inputs if isinstance(t, torch.Tensor)], {}, out, 0.0)
        for name, packet, args, kwargs, result in externs:
            Recorder.record(recorder, name, packet, args, kwargs, result)   # past the caller's pause
            recorder.record("compiled region forward", None, (), {}, (), 0.0)   # the generated kernel after it
        return out

    @staticmethod
    def backward(ctx, *douts):
        saved = iter(ctx.saved_tensors)
        inputs = [next(saved).detach() if o is None else o for o in ctx.others]
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        wrt = [t.requires_grad_(True) for t, g in zip(inputs, ctx.grads) if g]   # what needed a gradient
        sums: list[tuple] = []   # the shapes the eager backward sums into
        with torch.enable_grad(), _paused(ctx.recorder, sums):
            outs = ctx.fn(*inputs)
            pairs = [(o, d) for o, d in zip(outs if isinstance(outs, tuple) else (outs,), douts)
                     if d is not None and o.requires_grad]          # the outputs a gradient reached
            grads = dict(zip(map(id, wrt), torch.autograd.grad([o for o, _ in pairs], wrt, [d for _, d in pairs],
                                                               allow_unused=True)))
        grads = {k: g for k, g in grads.items() if g is not None}
        ctx.recorder.record("compiled region backward", None, (*tensors, *[d for _, d in pairs]), {},
                            list(grads.values()), 0.0)
        for g in grads.values():
            if _squeezed(g.shape) in sums:   # a reduced gradient (a norm's weight, a gate, a key shared by the heads)
                ctx.recorder.record("compiled region backward", None, (), {}, g, 0.0)
        return (None, None, *[grads.get(id(t)) if isinstance(t, torch.Tensor) else None for t in inputs])


@contextlib.contextmanager
def compiled_regions(recorder: Recorder):
    """``parallel.compile.region`` replaced: each compiled region (``train.compile`` on CUDA) records itself
    as the fused kernels it becomes (``_CompiledRegion``)."""
    from parallel import compile as regional

    def region(fn, backend):
        def run(*inputs):
            with _paused(recorder):
                return _CompiledRegion.apply(fn, recorder, *inputs)
        return run

    original, regional.region = regional.region, region
    try:
        yield
    finally:
        regional.region = original


FUSED = ("attention", "cross-entropy", "compiled region")   # ops that record themselves


REDUCTIONS = ("aten.sum", "aten.mean")


def _squeezed(shape) -> tuple:
    """``shape`` without its 1s: autograd sums a broadcast gradient with ``keepdim`` and then views it."""
    return tuple(d for d in shape if d != 1)


@contextlib.contextmanager
def _paused(recorder: Recorder, sums: list | None = None, externs: list | None = None):
    """The recorder's dispatch hook off (the fused op records itself; ``new_empty`` is no kernel anyway); the
    output shapes of the reductions that run meanwhile go to ``sums``, the ``REGION_EXTERN`` ops to ``externs``."""
    saved = recorder.record

    def record(name, packet, args, kwargs, out, *rest, **kw):
        if name.startswith(FUSED):
            return saved(name, packet, args, kwargs, out, *rest, **kw)
        if sums is not None and name in REDUCTIONS and isinstance(out, torch.Tensor) and out.is_floating_point():
            sums.append(_squeezed(out.shape))   # an integer sum (a count, a rank) is no gradient's
        if externs is not None and name in REGION_EXTERN:
            externs.append((name, packet, args, kwargs, out))
    recorder.record = record
    try:
        yield
    finally:
        recorder.record = saved


# ---- the step ---------------------------------------------------------------------------------------------
def fake_model(cfg, layers: int | None = None):
    """``cfg.model`` (cut to ``layers``) with FP32 fake parameters on the CPU device: built on meta, its
    parameters and buffers replaced by fake tensors of the same shapes (caller holds a ``FakeTensorMode``)."""
    import models
    m_cfg = dataclasses.replace(cfg.model, n_layers=layers) if layers else cfg.model
    model = models.build(m_cfg, device="meta")
    for mod in model.modules():
        for n, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[n] = nn.Parameter(torch.empty(p.shape, dtype=torch.float32), requires_grad=p.requires_grad)
        for n, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[n] = torch.empty(b.shape, dtype=b.dtype)
    return model


def record_step(cfg, layers: int | None = None, micro_batches: int = 1, hw: Hardware = H100,
                fused_adamw: bool = True, adamw_kernel: bool = True) -> tuple[Recorder, object]:
    """One training step of ``cfg`` on fake tensors, recorded (module docstring). The optimizer as on CUDA: the
    Triton AdamW (``adamw_kernel``); ``adamw_kernel=False``: torch's AdamW, fused, or with ``fused_adamw=False``
    its foreach path, as the step measured on the H100 ran. Returns the recorder and the model config it ran."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from parallel.dims import ParallelDims
    from parallel.head_loss import apply_head_loss
    from parallel.precision import Precision
    from parallel.zero import build_optimizer
    from parallel.compile import apply_compile
    from parallel.compile import enabled as compile_enabled

    from parallel.fp8 import apply_fp8, reuse_fp8_weights

    from .cuda_autocast import CudaAutocastPolicy
    from .roofline_fp8 import fp8_kernels
    from .roofline_loss import head_losses
    t = cfg.train
    precision = Precision(t.precision)
    rec = Recorder(hw)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = fake_model(cfg, layers)
        apply_head_loss(model, t.head_loss)
        if precision.fp8:
            apply_fp8(model)
        if compile_enabled(t.compile, "cuda"):
            apply_compile(model)
        model.train()
        with as_on_cuda(fused_adamw, adamw_kernel):
            opt = build_optimizer(model, cfg.optim, ParallelDims(world_size=1), weights=precision.weights)
        ids = torch.randint(0, model.cfg.vocab_size, (t.micro_batch_size, cfg.data.seq_len + 1))
        autocast = torch.autocast("cpu", dtype=precision.autocast or torch.bfloat16,
                                  enabled=precision.autocast is not None)
        with rec, fused_attention(rec), head_losses(rec), compiled_regions(rec), as_on_cuda(), \
                adamw_kernel_recorded(rec), fp8_kernels(rec):
            with reuse_fp8_weights(model), warnings.catch_warnings():   # FP8 weights quantised once per step
                # (its cache's key reads a data pointer, which fake tensors warn about; it works as on a device)
                warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
                for _ in range(micro_batches):
                    rec.phase = "forward"
                    with autocast, CudaAutocastPolicy():
                        out = model.compute_loss(ids[:, :-1], ids[:, 1:], mtp_weight=t.mtp_loss_weight.at(0, 0),
                                                 aux_alpha=t.aux_loss_alpha)
                    rec.phase = "backward"
                    opt.backward(out.loss / micro_batches)
            rec.phase = "optimizer"
            opt.grads_finite()   # the trainer's check before the update (Trainer.check_step)
            opt.step(cfg.optim.grad_clip)
            rec.phase = "other"
            opt.zero_grad()
            model.update_expert_bias(1e-3)
    return rec, model.cfg


def totals(rec: Recorder, by: str) -> dict[str, Stat]:
    """Stats summed ``by`` phase, class or op."""
    index = {"phase": 0, "class": 1, "op": 2}[by]
    out: dict[str, Stat] = collections.defaultdict(Stat)
    for key, s in rec.stats.items():
        out[key[index]].add(s)
    return dict(out)


def report(rec: Recorder, model_cfg, tokens: int, seq_len: int, top: int = 12) -> list[str]:
    """The printed report; ``top``: how many ops it lists, each per phase (``phase: op``)."""
    from models.params import flops_per_token
    rows = [f"{'':<40} {'calls':>7} {'TFLOP':>9} {'GB':>9} {'launches':>9} {'syncs':>6} {'pred. ms':>9}"]

    def line(name, s: Stat):
        return (f"{name:<40} {s.calls:>7} {s.flops / 1e12:>9.3f} {s.bytes / 1e9:>9.2f} {s.launches:>9} {s.syncs:>6} "
                f"{s.seconds * 1e3:>9.1f}")
    for by in ("phase", "class"):
        rows.append(f"-- by {by}")
        for name, s in sorted(totals(rec, by).items(), key=lambda kv: -kv[1].seconds):
            rows.append(line(name, s))
    total = Stat()
    for s in rec.stats.values():
        total.add(s)
    rows.append(line("step", total))
    rows.append("-- top ops")
    per_phase: dict[str, Stat] = collections.defaultdict(Stat)
    for (phase, _, op), s in rec.stats.items():
        per_phase[f"{phase}: {op}"].add(s)
    for name, s in sorted(per_phase.items(), key=lambda kv: -kv[1].seconds)[:top]:
        rows.append(line(name, s))
    rows += [f"source: {s}" for s in rec.hw.sources]
    model_flops = flops_per_token(model_cfg, seq_len).per_token * tokens
    mfu = model_flops / total.seconds / rec.hw.peak_bf16
    rows.append(f"predicted step: {total.seconds * 1e3:.1f} ms on {rec.hw.name} ({100 * mfu:.1f} % MFU)")
    return rows


def main(argv: list[str] | None = None) -> int:
    from configs.schema import compose
    from errors import ConfigError
    ap = argparse.ArgumentParser(prog="python -m tools.roofline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=None, help="cut the model to this many layers")
    ap.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step (default 1)")
    ap.add_argument("--top", type=int, default=12, help="ops listed, each per phase (default 12)")
    args, overrides = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = compose(overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        rec, model_cfg = record_step(cfg, args.layers, args.micro_batches)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len * args.micro_batches
    print(f"roofline: {model_cfg.n_layers} layers, {args.micro_batches} x {cfg.train.micro_batch_size} x "
          f"{cfg.data.seq_len} tokens, precision {cfg.train.precision}")
    print("\n".join(report(rec, model_cfg, tokens, cfg.data.seq_len, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
