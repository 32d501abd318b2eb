"""``parallelize(model, spec, dims, device) -> (model, pipeline)``: every transform of a built single-device model,
in the one order they must run. The model's forward is written once (``models/``); layouts are applied to it.

1. ``apply_ep``: keep this rank's routed experts, give each MoE layer its all-to-all dispatcher; then
   ``apply_head_loss`` (``train.head_loss``), before anything wraps or moves the head;
2. ``apply_fp8`` (``Precision.fp8``): FP8 linears and grouped experts, swapped in by name;
3. with ``dims.pp > 1``, ``PipelineRunner.from_model``: deferred weight gradients for zero-bubble schedules
   (``wgrad_queue``; the stages hold the modules it replaces, so before them), then this rank's stages, the rest
   pruned;
4. ``apply_compile`` (``train.compile``; ``parallel/compile.py``): the norms and SwiGLU products as compiled regions;
5. ``apply_recompute`` last: it swaps classes in place, and a module replaced after it (the routed experts by
   the FP8 or deferred ones) would silently not recompute.
The F&B overlap is decided here (``fb_overlap``), once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .compile import apply_compile, enabled
from .dims import ParallelDims
from .ep import apply_ep
from .head_loss import apply_head_loss
from .pipeline.runner import PipelineRunner
from .pipeline.schedules import NO_PIPELINE
from .precision import Precision
from .recompute import apply_recompute


@dataclass(frozen=True)
class ParallelSpec:
    """What ``parallelize`` needs of a run's configuration (``trainer.startup.parallel_spec`` makes it)."""
    precision: Precision = Precision("fp32")
    dispatcher: str = "hierarchical"        # parallel.ep_dispatcher
    fp8_dispatch: bool = False              # parallel.fp8_dispatch
    schedule: str = NO_PIPELINE             # parallel.schedule
    n_microbatches: int = 1                 # the first step's, per data-parallel rank
    pp_layout: tuple[int, ...] | None = None
    overlap: bool = True                    # parallel.overlap
    recompute: str = "none"                 # train.recompute
    head_loss: str = "fused"                # train.head_loss
    compile: str = "auto"                   # train.compile


def fb_overlap(overlap: bool, ep: int) -> bool:
    """Whether DualPipe's F&B actions run overlapped: ``parallel.overlap`` where an expert all-to-all exists to
    hide (ep > 1). With ep = 1 the dispatcher moves nothing, and cutting and interleaving the halves would only
    cost time (about 6 % of the F&Bs of a tiny CPU model, docs/benchmarks.md)."""
    return overlap and ep > 1


def parallelize(model, spec: ParallelSpec, dims: ParallelDims, device: torch.device | str = "cpu"):
    """The transforms of the module docstring, in order; returns ``(model, PipelineRunner or None)``, the model
    in train mode (with a pipeline, only this rank's stages are left in it)."""
    model = apply_ep(model, dims, dispatcher=spec.dispatcher, fp8_dispatch=spec.fp8_dispatch)
    apply_head_loss(model, spec.head_loss)
    if spec.precision.fp8:
        from .fp8 import apply_fp8
        apply_fp8(model)
    pipe = None
    if dims.pp > 1:
        layout = list(spec.pp_layout) if spec.pp_layout is not None else None
        pipe = PipelineRunner.from_model(model, dims, spec.schedule, spec.n_microbatches, layout, device,
                                         fb_overlap(spec.overlap, dims.ep), spec.precision.weight_dtype)
    if enabled(spec.compile, device):
        apply_compile(model)
    apply_recompute(model, spec.recompute)
    model.train()
    return model, pipe
