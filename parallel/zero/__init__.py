"""The optimizer a training step talks to, for every layout: ``build_optimizer`` returns an object with

    backward(loss)      one micro-batch's backward (non-pipelined path; the pipeline executor runs its own)
    grads_finite()      a boolean device scalar: no inf/nan in the gradients this rank holds (the trainer
                        combines every rank's answer in one reduction and skips the update if any is False)
    step(max_norm)      after all micro-batches (and the pipeline's replica sums): reduce gradients over
                        the data-parallel ranks, clip by the global norm, update, bring every rank's
                        parameters up to date; returns the global gradient norm before clipping (a
                        scalar tensor on the device, or a float: the caller reads it with the step's
                        other numbers, so the step needs no extra host sync)
    zero_grad()
    state_dict() / load_state_dict(sd)
                        ``{"state": {name: {"step", "exp_avg", "exp_avg_sq"}}}`` keyed by the
                        single-device model's parameter names, tensors as DTensors of the global shape,
                        so DCP checkpoints reshard between layouts (and between ZeRO and no ZeRO)
    memory()            bytes per rank (parameters, gradients, master weights, optimizer state) and the
                        analytical formula for the layout
    optimizer           the ``torch.optim.Optimizer`` whose ``param_groups[i]["lr"]`` the LR scheduler sets

Backends: ``parallel.zero=0`` -> ``Replicated`` (torch.optim.AdamW, gradients all-reduced);
``parallel.zero=1|2`` -> ``native.ZeroOptimizer`` (this package) or, with
``parallel.zero_backend=deepspeed``, DeepSpeed's ZeRO-1/2 optimizer (``deepspeed_backend``).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_optimizer_state_dict

from ..data_parallel import all_finite, clip_grad_norm, sync_gradients
from ..dims import ParallelDims
from ..state_dict import to_global, to_local
from .memory import MemoryReport, account


class NonFiniteGradients(FloatingPointError):
    """Raised by ``step`` when the backend found an inf/nan gradient itself and did not update (DeepSpeed);
    the trainer treats it like a step its own check skipped."""


class Replicated:
    """No sharding: every data-parallel rank keeps the full AdamW state (torch.optim.AdamW, fp32 moments)."""

    def __init__(self, model: nn.Module, optim_cfg, dims: ParallelDims, grad_weight: Callable[[str], float] | None):
        self.model, self.dims, self.grad_weight = model, dims, grad_weight
        decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
        groups = [{"params": decay, "weight_decay": optim_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2),
                                           eps=optim_cfg.eps)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    @torch.no_grad()
    def grads_finite(self) -> torch.Tensor:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return all_finite(grads, next(self.model.parameters()).device)

    def step(self, max_norm: float) -> float:
        if self.dims.world_size > 1:
            sync_gradients(self.model, self.dims)
            norm = clip_grad_norm(self.model, max_norm, self.dims, self.grad_weight)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm if max_norm > 0 else float("inf"))
        self.optimizer.step()
        return norm

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        _, optim_sd = get_state_dict(self.model, self.optimizer)   # initialises empty AdamW state
        _, optim_sd = to_global({}, optim_sd, self.model, self.dims)
        return {"state": optim_sd["state"]}

    def load_state_dict(self, sd: dict) -> None:
        _, full = get_state_dict(self.model, self.optimizer)
        full["state"] = to_local(sd["state"])
        set_optimizer_state_dict(self.model, self.optimizer, full)

    def memory(self) -> MemoryReport:
        params = [p for p in self.model.parameters() if p.requires_grad]
        n = sum(p.numel() for p in params)
        measured = {"params": sum(p.numel() * p.element_size() for p in params), "grads": 4 * n, "master": 0,
                    "optim": 2 * 4 * n}   # fp32 grads and AdamW moments of every local parameter
        return account(self.model, self.dims, zero=0, moment_bytes=4, measured=measured)


MOMENT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}   # optim.moment_dtype's values, ``auto`` resolved


def moment_dtype(setting: str, zero: int, backend: str = "native") -> str:
    """The AdamW moment dtype ``optim.moment_dtype`` resolves to: ``auto`` is bf16 under the native ZeRO
    optimizer (DeepSeek-V3's recipe) and fp32 otherwise (torch.optim.AdamW; DeepSpeed's optimizer)."""
    if setting != "auto":
        return setting
    return "bf16" if zero >= 1 and backend == "native" else "fp32"


def build_optimizer(model: nn.Module, optim, dims: ParallelDims, zero: int = 0, backend: str = "native",
                    bucket_mb: float = 32.0, grad_weight: Callable[[str], float] | None = None):
    """``optim``: the AdamW settings (``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay``, ``grad_clip``,
    ``moment_dtype``: the config's ``optim`` section); ``zero``, ``backend``, ``bucket_mb``: ``parallel.zero``,
    ``parallel.zero_backend``, ``parallel.zero_bucket_mb``. ``grad_weight(name)`` (1 / holders) counts a tensor
    held by several pipeline ranks (DualPipe replicas, tied embeddings) once in the global gradient norm."""
    if zero == 0:
        return Replicated(model, optim, dims, grad_weight)
    if backend == "deepspeed":
        from .deepspeed_backend import DeepSpeedZero
        return DeepSpeedZero(model, optim, dims, stage=zero, bucket_mb=bucket_mb)
    from .native import ZeroOptimizer
    return ZeroOptimizer(model, optim, dims, stage=zero, moment_dtype=moment_dtype(optim.moment_dtype, zero, backend),
                         bucket_mb=bucket_mb, grad_weight=grad_weight)


__all__ = ["build_optimizer", "moment_dtype", "MOMENT_DTYPES", "NonFiniteGradients", "Replicated", "MemoryReport",
           "account"]
