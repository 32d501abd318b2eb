"""Regional ``torch.compile`` (``train.compile``): ``apply_compile(model, backend)`` runs the model's elementwise
chains as generated kernels, the rest of the forward as written.

Regions: every ``RMSNorm`` (``models.layers.rms_norm``; with ``RESIDUAL_ENV=1`` the FFN norm with the residual add
before it too, ``RMSNorm.residual``: ``models.layers.add_rms_norm``, whose backward sums the residual stream's two
gradients: opt-in until a GPU has run its generated kernels), every ``SwiGLU`` product (``models.layers.swiglu``:
dense MLPs, shared and routed experts), the MoE combine's un-sort and gate-weighted sum
(``models.moe.unsort_and_weight``, the ``weigh`` of the single-device and flat all-to-all dispatchers; with
``UNSORT_ENV=1`` ``unsort_rows_and_weight``, whose backward gathers the gradient's rows instead of a zero fill and a
scatter), with ``GATHER_ENV=1`` the single-device dispatch's copies of the tokens (``models.moe.gather_copies``,
``LocalDispatcher.gather``: backward, the copies' gradients un-sorted and summed per token in one pass, instead of
an accumulating index write; the flat all-to-all dispatcher's backward does the same), each
attention's whole query and key/value heads from its up-projections' outputs (layout, rotation, concatenation:
``models.attention.query_heads``, ``key_value_heads``; ``MLA.query_heads``, ``MLA.kv_heads``; with ``HEADS_ENV=1``
``query_heads_bthd``, ``key_value_heads_bthd``: the same values laid out ``[B,T,H,.]``, so that an attention kernel
whose output follows its query's layout gives wo's input without a copy), each router's
selection after its GEMM (``models.moe.select_experts``, ``Gate.select``: sigmoid, group and expert top-k's,
normalisation; inductor runs the top-k's as torch's kernels and fuses the rest) and each MoE layer's balance loss
and load count (``models.moe.balance_and_load``, ``MoE.balance_terms``).
In eager a norm is 8 kernels forward and about 12 backward, each a pass over the activations; compiled, each
region is one or two generated kernels each way. They are the largest share of the step's elementwise bytes
(``python -m tools.roofline``). Regions hold no collective and no host sync, so compiling them cannot break a
graph, and the same regions serve ``Block.forward`` and the pipeline's piecewise F&B.

With ``CHECK_ENV=1`` each call that compiles a new graph is checked against eager on its own inputs, on its device
(``check_region``: the outputs, and the inputs' gradients from a seeded random cotangent, within ``CHECK_TOL`` of
the least precise float type involved; integer outputs such as a router's top-k row by row, up to
``INDEX_MISMATCH`` of rows for 1-ulp ties). A graph that differs, or fails to compile, sends its region back to
eager with one warning line. The check costs one eager and one compiled run per new graph (a handful per region),
never inside a CUDA graph's capture.

Modes (``MODES``): ``auto`` compiles on CUDA and leaves the CPU eager (inductor's CPU code is not faster for
the tiny models run there, and its first compile costs seconds); ``on`` compiles on any device; ``off`` never.

Mechanism: each chosen module's class is swapped for a subclass whose ``forward`` calls the compiled function
with the module's own weight and eps (as ``parallel/recompute.py`` swaps classes: parameters, state-dict keys
and numerics are unchanged). One compiled function per (region, backend), shared by every instance: dynamo
keeps one graph per input shape and dtype, and marks a dimension dynamic once it has seen it change (the routed
experts' row count changes every step), so a model compiles a handful of graphs, not one per layer. Apply it
before ``apply_recompute``, which then recomputes the compiled region (the order lives in
``parallel.parallelize``).
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Callable

import torch
from torch import nn

from models.attention import MLA, key_value_heads, key_value_heads_bthd, query_heads, query_heads_bthd
from models.layers import RMSNorm, SwiGLU, add_rms_norm, rms_norm, swiglu
from models.moe import (LocalDispatcher, MoE, balance_and_load, gather_copies, select_experts, unsort_and_weight,
                        unsort_rows_and_weight)

log = logging.getLogger("parallel")

MODES = ("auto", "on", "off")   # train.compile
CHECK_ENV = "DSV3_COMPILE_CHECK"   # "1": every new graph checked against eager (module doc)
RESIDUAL_ENV = "DSV3_COMPILE_RESIDUAL"   # "1": RMSNorm.residual compiled as one region (OTHER_METHODS; module doc)
GATHER_ENV = "DSV3_GATHER_COPIES"       # "1": the dispatch's copies with gather_copies' backward (module doc)
UNSORT_ENV = "DSV3_UNSORT_GATHER"       # "1": the combine's un-sort with unsort_rows' backward (module doc)
HEADS_ENV = "DSV3_HEADS_BTHD"           # "1": the attention heads laid out [B,T,H,.] in memory (module doc)
# Graphs a region may keep (dynamo's recompile limit, 8 by default): a norm sees 3 widths (model, q and kv latents),
# BF16 and FP32 inputs, training and no-grad evaluation, and batch shapes; past the limit dynamo runs it eagerly.
RECOMPILE_LIMIT = 64
COMPILE_ERRORS = tuple(getattr(torch._dynamo.exc, name) for name in ("TorchDynamoException", "FailOnRecompileLimitHit")
                       if hasattr(torch._dynamo.exc, name))


def enabled(mode: str, device: torch.device | str) -> bool:
    """Whether ``train.compile=mode`` compiles on ``device``."""
    if mode not in MODES:
        raise ValueError(f"train.compile: {mode!r} is not one of {', '.join(MODES)}")
    return mode == "on" or (mode == "auto" and torch.device(device).type == "cuda")


@functools.cache
def region(fn: Callable, backend: str) -> Callable:
    """``fn`` compiled for ``backend``, one per process (``tools.roofline`` replaces this to record a region as
    the one fused kernel it becomes). If dynamo or the backend fails to compile it, one warning line names the
    region and the error, and ``fn`` runs eagerly from then on: slower, never wrong. With ``checking()``, each
    call that compiled a new graph is then checked against eager on its own inputs (``check_region``: the
    outputs, and the gradients
    from a random cotangent), on the device it runs on; a wrong graph sends the region back to eager, with one
    warning line naming the region and the error."""
    graphs = [0]
    compiler = torch._dynamo.lookup_backend(backend)

    def counted(gm, example_inputs, **kwargs):
        graphs[0] += 1
        return compiler(gm, example_inputs, **kwargs)
    state = {"fn": torch.compile(fn, backend=counted)}
    limit = torch._dynamo.config
    limit.recompile_limit = max(limit.recompile_limit, RECOMPILE_LIMIT)

    def run(*args):
        seen = graphs[0]
        try:
            out = state["fn"](*args)
        except COMPILE_ERRORS as e:
            if state["fn"] is fn:
                raise
            log.warning("train.compile: compiling %s with %s failed (%s: %s); it runs eagerly",
                        fn.__name__, backend, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            state["fn"] = fn
            return fn(*args)
        if graphs[0] != seen and state["fn"] is not fn and checking() and not _capturing(args):
            try:
                why = check_region(state["fn"], fn, args)
            except Exception as e:   # a check that cannot run vouches for nothing: eager, named in the warning
                why = f"the check failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if why:
                log.warning("train.compile: %s compiled with %s differs from eager (%s); it runs eagerly",
                            fn.__name__, backend, why)
                state["fn"] = fn
                return fn(*args)
        return out
    return run


def checking() -> bool:
    """Whether ``region`` checks new graphs (``check_region``): with ``CHECK_ENV=1``."""
    return os.environ.get(CHECK_ENV) == "1"


def _capturing(args) -> bool:
    """Whether a CUDA graph is being captured (no check then: it would be captured too; warm-up runs it first)."""
    return any(isinstance(a, torch.Tensor) and a.is_cuda for a in args) and torch.cuda.is_current_stream_capturing()


def _tol(dtypes) -> float:
    """How far a compiled region's float result may be from eager's (norm-wise), for the least precise of
    ``dtypes`` (the region's float inputs and outputs, and autocast's type where it is on): FP32 to rounding (a
    different order of the same sums), 16-bit within a few roundings (inductor rounds once where eager rounds per
    op, and an FP32 result from 16-bit inputs carries their rounding); a wrong kernel is off by ~1."""
    return max(CHECK_TOL.get(d, CHECK_TOL[torch.bfloat16]) for d in dtypes)


def _float_types(args: tuple, outs: list) -> set[torch.dtype]:
    """The float types a region computes in: its tensors' and, under autocast on their device, autocast's."""
    tensors = [t for t in (*args, *outs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    types = {t.dtype for t in tensors}
    device = tensors[0].device.type if tensors else "cpu"
    if torch.is_autocast_enabled(device):
        types.add(torch.get_autocast_dtype(device))
    return types


CHECK_TOL = {torch.float64: 1e-8, torch.float32: 1e-4, torch.bfloat16: 2e-2}
INDEX_MISMATCH = 1e-2   # integer results (a router's top-k): the fraction of rows allowed to differ (1-ulp ties)


def check_region(compiled_fn: Callable, fn: Callable, args: tuple) -> str:
    """``compiled_fn`` vs eager ``fn`` on ``args`` (detached copies, the same grad mode and autocast): "" when the
    outputs and (in grad mode) the inputs' gradients from a seeded random cotangent agree (``_tol``; integer
    outputs row by row, and float results compared on the rows where those agree), else what differs."""
    grad = torch.is_grad_enabled()
    runs = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):   # not a recompute's hooks
        for f in (fn, compiled_fn):
            xs = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
            out = f(*xs)
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            leaves = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
            pairs = [(o, _cotangent(o)) for o in outs if o.is_floating_point() and o.requires_grad]
            grads = torch.autograd.grad([o for o, _ in pairs], leaves, [c for _, c in pairs], allow_unused=True) \
                if grad and pairs and leaves else []
            runs.append((outs, [g for g in grads if g is not None]))
    (want, dwant), (got, dgot) = runs
    tol = _tol(_float_types(args, want))
    same = None
    for w, g in zip(want, got):
        if not w.is_floating_point():
            rows = (w == g).reshape(len(w), -1).all(1) if w.dim() else (w == g).reshape(1)
            if 1 - rows.float().mean().item() > INDEX_MISMATCH:
                return f"{1 - rows.float().mean().item():.3g} of an integer output's rows differ"
            same = rows if w.dim() else same
    for i, (w, g) in enumerate(list(zip(want, got)) + list(zip(dwant, dgot))):
        if w.is_floating_point():
            if same is not None and w.dim() and len(w) == len(same):
                w, g = w[same], g[same]
            err = ((w.double() - g.double()).norm() / w.double().norm().clamp_min(1e-30)).item()
            if not err <= tol:
                return f"{'output' if i < len(want) else 'gradient'} {i if i < len(want) else i - len(want)}: " \
                       f"relative error {err:.3g} > {tol:g}"
    return ""


def _cotangent(t: torch.Tensor) -> torch.Tensor:
    g = torch.Generator(device=t.device).manual_seed(0)   # not the global generator: training draws stay as they were
    return torch.randn(t.shape, generator=g, device=t.device, dtype=t.dtype)


def _norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    return region(rms_norm, self.compile_backend)(x, self.weight, self.eps)


def _norm_residual(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return region(add_rms_norm, self.compile_backend)(x, y, self.weight, self.eps)


def _swiglu_forward(self, h13: torch.Tensor) -> torch.Tensor:
    return region(swiglu, self.compile_backend)(h13)


FORWARDS = {RMSNorm: _norm_forward, SwiGLU: _swiglu_forward}
# The compiled class's methods besides its forward, with RESIDUAL_ENV=1 (no GPU has run the fused region yet)
OTHER_METHODS = {RMSNorm: {"residual": _norm_residual}}


class Region:
    """A function run as a compiled region (``region(fn, backend)``, looked up at each call), for the places
    that call a function rather than a module: the MoE combine's ``weigh``, the attention's ``query_heads`` and
    ``kv_heads``, the router's ``select``, the MoE layer's ``balance_terms``."""

    def __init__(self, fn: Callable, backend: str):
        self.fn, self.backend = fn, backend

    def __call__(self, *args):
        return region(self.fn, self.backend)(*args)


def _on(env: str) -> bool:
    """An opt-in of this module (``RESIDUAL_ENV``, ``GATHER_ENV``, ``UNSORT_ENV``, ``HEADS_ENV``) set to 1."""
    return os.environ.get(env) == "1"


def _weighing(m: nn.Module) -> bool:
    """A MoE layer whose dispatcher combines with ``unsort_and_weight`` (the single-device and the flat
    all-to-all dispatchers; the hierarchical one sums per node with its own steps)."""
    from .ep.dispatch import AllToAllDispatcher
    return isinstance(m, MoE) and isinstance(m.dispatcher, (LocalDispatcher, AllToAllDispatcher))


def apply_compile(model: nn.Module, backend: str = "inductor") -> list[str]:
    """Swap every ``RMSNorm`` and ``SwiGLU`` of ``model`` (exactly those classes: a subclass with a forward of
    its own, such as FP8's cached SwiGLU, keeps it) for its compiled subclass, and compile the MoE combines'
    ``weigh``, the attentions' ``query_heads`` and ``kv_heads``, the routers' ``select`` and the MoE layers'
    ``balance_terms``, in place. Returns the compiled modules' (and functions') names. Idempotent."""
    classes: dict[tuple[type, str], type] = {}
    names = []
    for name, m in model.named_modules():
        if _weighing(m):
            m.dispatcher.weigh = Region(unsort_rows_and_weight if _on(UNSORT_ENV) else unsort_and_weight, backend)
            names.append(f"{name}.dispatcher.weigh")
        if isinstance(m, MoE) and isinstance(m.dispatcher, LocalDispatcher) and _on(GATHER_ENV):
            m.dispatcher.gather = Region(gather_copies, backend)
            names.append(f"{name}.dispatcher.gather")
        if isinstance(m, MLA):
            q, kv = (query_heads_bthd, key_value_heads_bthd) if _on(HEADS_ENV) else (query_heads, key_value_heads)
            m.query_heads, m.kv_heads = Region(q, backend), Region(kv, backend)
            names += [f"{name}.query_heads", f"{name}.kv_heads"]
        if isinstance(m, MoE):
            m.gate.select = Region(select_experts, backend)
            m.balance_terms = Region(balance_and_load, backend)
            names += [f"{name}.gate.select", f"{name}.balance_terms"]
        if getattr(type(m), "compiled_from", None) is not None:   # compiled before (maybe recomputed since)
            names.append(name)
            continue
        base = next((c for c in FORWARDS if type(m) is c), None)
        if base is None:
            continue
        key = (base, backend)
        if key not in classes:
            others = OTHER_METHODS.get(base, {}) if _on(RESIDUAL_ENV) else {}
            classes[key] = type(f"Compiled{base.__name__}", (base,), {
                "forward": FORWARDS[base], **others, "compiled_from": base, "compile_backend": backend,
                "__module__": __name__,
                "__doc__": f"{base.__name__} run as one compiled region ({backend}; parallel/compile.py)."})
        m.__class__ = classes[key]
        names.append(name)
    return names


def compiled(model: nn.Module) -> list[str]:
    """The names of ``model``'s compiled modules and functions (``apply_compile``)."""
    return [n for n, m in model.named_modules() if getattr(type(m), "compiled_from", None) is not None] + \
        [f"{n}.dispatcher.{attr}" for n, m in model.named_modules() if isinstance(m, MoE)
         for attr in ("weigh", "gather") if isinstance(m.dispatcher.__dict__.get(attr), Region)] + \
        [f"{n}.{attr}" for n, m in model.named_modules() if isinstance(m, MLA)
         for attr in ("query_heads", "kv_heads") if isinstance(m.__dict__.get(attr), Region)] + \
        [f"{n}.{attr}" for n, m in model.named_modules() if isinstance(m, MoE)
         for attr, owner in (("gate.select", m.gate), ("balance_terms", m))
         if isinstance(owner.__dict__.get(attr.rsplit(".", 1)[-1]), Region)]


__all__ = ["CHECK_ENV", "GATHER_ENV", "HEADS_ENV", "MODES", "RESIDUAL_ENV", "UNSORT_ENV", "Region", "apply_compile",
           "compiled", "enabled", "region"]
