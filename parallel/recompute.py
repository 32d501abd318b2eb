"""Activation recomputation (``train.recompute``): ``apply_recompute(model, mode)`` makes chosen regions of
a built model keep only their inputs for backward and run again there (non-reentrant
``torch.utils.checkpoint``: the region's saved tensors are recomputed on first use by each backward).

Modes:
- ``none``: autograd keeps everything it saves.
- ``selective`` (DeepSeek-V3's set, report §3.2.2 / §3.3): every RMSNorm outside MLA keeps only its input;
  ``MLA.core`` (q_norm, wq_b, kv_norm, wkv_b, rope and the attention they feed: its backward needs q, k, v)
  keeps only the latents it starts from; every ``SwiGLU`` product (dense MLPs, shared and routed experts)
  keeps only ``h1, h3``. A region's output is still kept by its consumer (wo, the next linear, w2), as an FP8
  copy when that linear is FP8. With FP8 experts a MoE layer's SwiGLUs keep ``h1, h3`` as FP8 instead
  (``parallel.fp8.FP8CachedSwiGLU``, V3 §3.3.2): not a checkpoint region; gradients see their FP8 rounding.
- ``full``: a dense block keeps only its input (``Block.forward`` is one region). A MoE block cannot be one
  region (its all-to-alls must not run again in backward, and ``MoE.forward`` counts routed tokens): its calls
  between the all-to-alls are regions (``Block.attention``, ``ffn_norm``, the shared and the routed experts).
  Not regions: ``MoE.gate`` (the balance loss keeps its scores anyway), ``MoE.balance`` (counts the load: a
  side effect), ``MoE.post_combine`` (as a region it would also keep the combine output). The final norm,
  head, loss and MTP's projection are not recomputed (MTP's block is, like any block).

No region contains a collective, so the same regions serve ``Block.forward`` and the pipeline's piecewise F&B
(``parallel/pipeline/overlap.py``). The pipeline's B recomputes a region once and W recomputes nothing: W runs
only the weight-gradient GEMMs B queued (``parallel/wgrad.py``); a W that walked the graph again would
recompute every region a second time.

Mechanism: each chosen module's class is swapped for a subclass whose region methods run under
``checkpoint`` (as ``torch.distributed.fsdp.fully_shard`` swaps classes): parameters, state-dict keys and
numerics are unchanged. Apply it after every transform that replaces modules (``apply_ep``, ``apply_fp8``,
``apply_deferred_wgrad``; the order lives in ``parallel.parallelize``): a replaced module would not recompute.
"""
from __future__ import annotations

import functools
from typing import Callable

from torch import nn
from torch.utils.checkpoint import checkpoint

from models.attention import MLA
from models.layers import MLP, RMSNorm, SwiGLU
from models.moe import MoE
from models.transformer import Block

from .fp8 import FP8CachedSwiGLU, fp8_swiglus

MODES = ("none", "selective", "full")   # train.recompute


def _checkpointed(fn: Callable) -> Callable:
    """``fn(self, *args)`` as a region: non-reentrant checkpoint keeps its tensor inputs and recomputes the
    rest in backward. The model draws no random numbers in forward, so the RNG state is not saved."""
    @functools.wraps(fn)
    def region(self, *args):
        return checkpoint(fn, self, *args, use_reentrant=False, preserve_rng_state=False)
    return region


def _swap(module: nn.Module, methods: tuple[str, ...], classes: dict) -> None:
    """Turn ``methods`` of ``module`` into regions by swapping its class for a subclass (one per
    (class, methods) and ``apply_recompute`` call)."""
    cls = type(module)
    if getattr(cls, "recomputed", ()) == methods:   # applied before
        return
    key = (cls, methods)
    if key not in classes:
        ns = {name: _checkpointed(getattr(cls, name)) for name in methods}
        ns.update(recomputed=methods, __module__=__name__,
                  __doc__=f"{cls.__name__} whose {', '.join(methods)} recompute in backward (parallel/recompute.py).")
        classes[key] = type(f"Recomputed{cls.__name__}", (cls,), ns)
    module.__class__ = classes[key]


def _selective(model: nn.Module) -> list[tuple[nn.Module, tuple[str, ...]]]:
    in_mla = {id(m) for mla in model.modules() if isinstance(mla, MLA) for m in mla.modules()}
    out = []
    for m in model.modules():
        if isinstance(m, MLA):
            out.append((m, ("core",)))
        elif isinstance(m, RMSNorm) and id(m) not in in_mla:
            out.append((m, ("forward",)))
        elif isinstance(m, SwiGLU):
            out.append((m, ("forward",)))
    return out


def _full(model: nn.Module) -> list[tuple[nn.Module, tuple[str, ...]]]:
    out = []
    for blk in (m for m in model.modules() if isinstance(m, Block)):
        moe = blk.ffn
        if not isinstance(moe, MoE):
            out.append((blk, ("forward",)))
            continue
        parts = [blk.ffn_norm, moe.experts] + ([moe.shared_experts] if isinstance(moe.shared_experts, MLP) else [])
        out += [(blk, ("attention",))] + [(m, ("forward",)) for m in parts]
    return out


def apply_recompute(model: nn.Module, mode: str) -> list[str]:
    """Make ``model``'s regions for ``mode`` (see the module docstring) recompute in backward, in place.
    Returns the regions as ``"<module name>.<method>"``. Idempotent."""
    if mode not in MODES:
        raise ValueError(f"train.recompute: {mode!r} is not one of {', '.join(MODES)}")
    if mode == "none":
        return []
    targets = _selective(model) if mode == "selective" else _full(model)
    names = {id(m): n for n, m in model.named_modules()}
    wanted = [f"{names[id(m)]}.{meth}" for m, methods in targets for meth in methods]
    done = regions(model)
    if done and set(done) != set(wanted):
        raise ValueError(f"apply_recompute: the model already recomputes other regions ({done[0]}, ...); "
                         f"one mode per model")
    classes: dict = {}
    fp8 = fp8_swiglus(model) if mode == "selective" else {}
    for module, methods in targets:
        if id(module) in fp8:
            module.__class__ = FP8CachedSwiGLU
            module.backend, module.pow2_scales = fp8[id(module)].backend, fp8[id(module)].pow2_scales
        else:
            _swap(module, methods, classes)
    return wanted


def regions(model: nn.Module) -> list[str]:
    """The recomputed regions of ``model`` now, as ``"<module name>.<method>"``."""
    return [f"{n}.{meth}" for n, m in model.named_modules() for meth in getattr(type(m), "recomputed", ())]


__all__ = ["MODES", "apply_recompute", "regions"]
