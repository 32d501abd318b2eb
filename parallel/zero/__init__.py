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
    named_grads()       name -> this step's gradient so far (FP32; zeros where none), for the pipeline's
                        replica sums to add into
    master_weights()    name -> the FP32 master (DTensor pieces where sharded), what checkpoints store as the
                        weights; None when the weights are FP32 and their own master (``master.py``)
    load_master_weights(sd)
                        the master from a loaded ``master_weights()``, then the BF16 weights from it
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

from kernels import adamw as adamw_kernel

from ..data_parallel import all_finite, clip_coef, clip_grad_norm, grad_norm, grad_sq, reduce_gradients, sync_gradients
from ..dims import ParallelDims
from ..state_dict import to_global, to_local
from .master import WEIGHT_DTYPES, FP32Grads, cast_
from .memory import MemoryReport, account


class NonFiniteGradients(FloatingPointError):
    """Raised by ``step`` when the backend found an inf/nan gradient itself and did not update (DeepSpeed);
    the trainer treats it like a step its own check skipped."""


def fused_adamw(tensors: list[torch.Tensor]) -> bool:
    """Whether ``torch.optim.AdamW`` runs fused (one pass per parameter chunk: parameter, gradient and both moments
    read once, written once; 23 ms instead of the foreach path's 65 ms for 2.16B FP32 parameters on an H100) for
    ``tensors``: on CUDA, where torch has the kernel. Elsewhere torch's default (its CPU numerics, which the
    layout-parity tests compare ZeRO's AdamW with, stay as they were)."""
    return bool(tensors) and all(t.is_cuda and t.is_floating_point() for t in tensors)


def triton_adamw(tensors: list[torch.Tensor]) -> bool:
    """Whether the optimizers update ``tensors`` with the Triton AdamW (``kernels/adamw.py``: one pass per
    parameter, clip coefficient and BF16 weight write included) by default: on CUDA. It still runs only where
    it passed its self-check on the device (``kernels.adamw.usable``); elsewhere the torch path runs."""
    return bool(tensors) and all(t.is_cuda and t.is_floating_point() for t in tensors)


def adamw_step_counter(param: torch.Tensor, fused: bool) -> torch.Tensor:
    """The FP32 scalar step count ``torch.optim.AdamW`` itself would create for ``param``: on the parameter's
    device when fused (its CUDA kernel takes every state tensor on that device and refuses a host counter),
    on the host otherwise (the Triton AdamW's path reads it there without a host sync)."""
    if fused:
        return torch.zeros((), dtype=torch.float32, device=param.device)
    return torch.tensor(0.0, dtype=torch.float32)   # a constant: fake-tensor tracing (tools.roofline) can read it


class Replicated:
    """No sharding: every data-parallel rank keeps the full AdamW state (``torch.optim.AdamW``'s, fp32 moments),
    which ``self.optimizer`` holds (param groups, lr, state) whichever path updates it. With ``weights="bf16"``
    AdamW updates a full FP32 master copy (the FP32 values the model arrives with; ``master.py``) from the
    step's gradients (the BF16 one of a single micro-batch, else their FP32 sum).

    The update, on CUDA (``kernel``, default ``triton_adamw``): the global gradient norm in one fused pass over
    the gradients as they are (shared with ``grads_finite``), the clip coefficient as a device scalar, then one
    Triton AdamW launch per parameter that reads the gradient once, updates master and moments, and writes the
    BF16 weight (``kernels/adamw.py``). Elsewhere, and where the kernel failed its self-check: clip,
    ``torch.optim.AdamW`` (fused on CUDA, ``fused_adamw``), then the master cast into the BF16 parameters in one
    grouped copy.
    ``kernel=True`` forces the Triton path (the interpreter on CPU: tests).

    ``moments="bf16"`` (``optim.moment_dtype``) keeps both moments in BF16, DeepSeek-V3's recipe (maths in FP32):
    ``torch.optim.AdamW`` keeps them in the parameter's dtype, so off the kernel those steps run
    ``kernels.adamw.reference_adamw_``, the kernel's maths in torch, as the native ZeRO optimizer does.

    ``master="split"`` (``optim.master``; BF16 weights): the FP32 master is the BF16 weight itself and 16 low bits
    per element (``kernels.adamw.split_master``: ``self.named`` holds the int16 low halves), 2 bytes less memory
    and 2 bytes less AdamW traffic per parameter; the kernel (or its torch reference) reads and writes both halves.
    The master's values are those of ``master="fp32"`` bit for bit; the weight is the master rounded to nearest
    but for exact ties, which round toward zero."""

    def __init__(self, model: nn.Module, optim_cfg, dims: ParallelDims, grad_weight: Callable[[str], float] | None,
                 weights: str = "fp32", fused: bool | None = None, kernel: bool | None = None,
                 moments: str = "fp32", master: str = "fp32"):
        if master not in MASTERS:
            raise ValueError(f"optim.master: {master!r} is not one of {', '.join(MASTERS)}")
        if master == "split" and weights == "fp32":
            raise ValueError("optim.master=split: FP32 weights are their own master; it needs BF16 weights")
        self.model, self.dims, self.grad_weight = model, dims, grad_weight
        self.split = master == "split"
        self.moments = MOMENT_DTYPES[moments]
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.fp32_grads = None
        self._sq: tuple = (None, None)   # grads_finite's sums and the gradients they came from (_held_sq)
        self.named = self.params   # what AdamW updates: the parameters, or their FP32 master
        if self.split:
            self.named = [(n, self._split(p)) for n, p in self.params]   # the low halves; the weights the high ones
        elif weights != "fp32":
            self.named = [(n, nn.Parameter(p.detach())) for n, p in self.params]   # keeps the FP32 storage
            cast_([p for _, p in self.params], WEIGHT_DTYPES[weights])
        if weights != "fp32":
            self.fp32_grads = FP32Grads([p for _, p in self.params])
        tensors = [t for _, t in self.named]
        kernel_on = [p for _, p in self.params] if self.split else tensors   # the split master's weights: BF16
        self.kernel = triton_adamw(kernel_on) if kernel is None else kernel
        self.check_kernel = kernel is None   # the default path: the kernel runs where it passed its self-check
        decay = [t for t in tensors if t.dim() >= 2]
        no_decay = [t for t in tensors if t.dim() < 2]
        groups = [{"params": decay, "weight_decay": optim_cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        own = self.moments != torch.float32 or self.split   # what torch's AdamW cannot update: the reference does
        fused = fused_adamw(tensors) and not self.kernel and not own if fused is None else fused
        self.optimizer = torch.optim.AdamW(groups, lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2),
                                           eps=optim_cfg.eps, fused=fused or None)
        for t in tensors:   # AdamW's state now (it would at the first step): checkpoints before it, memory()
            self.optimizer.state[t].update(step=adamw_step_counter(t, fused),
                                           exp_avg=torch.zeros_like(t, dtype=self.moments),
                                           exp_avg_sq=torch.zeros_like(t, dtype=self.moments))

    @staticmethod
    @torch.no_grad()
    def _split(p: nn.Parameter) -> torch.Tensor:
        """``p``'s FP32 values split: its data becomes the high halves (BF16), the low halves are returned."""
        high, low = adamw_kernel.split_master(p.detach())
        p.data = high.view(p.shape)
        return low.view(p.shape)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def named_grads(self) -> dict[str, torch.Tensor]:
        """Name -> this step's gradient so far, zeros where none (pipeline replica sums add into these)."""
        if self.fp32_grads is not None:
            return {n: self.fp32_grads.get(p, fill=True) for n, p in self.params}
        for _, p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return {n: p.grad for n, p in self.params}

    @torch.no_grad()
    def grads_finite(self) -> torch.Tensor:
        """Without data parallelism the gradients ``step`` reads are the ones held now: their sums of squares
        (``grad_sq``) answer, and ``step`` reuses them for the clip while those tensors are unchanged (one pass
        over the gradients per step, not two). With dp > 1 ``step`` reads them after the all-reduce."""
        if self.dims.dp == 1:
            grads = self._held()
            sq = grad_sq(self.model, self.grad_weight, self.named, grads)
            self._sq = (sq, [(g, g._version) for g in grads if g is not None])
            return torch.isfinite(sq[0] + sq[1])
        return all_finite([g for g in self._held() if g is not None], next(self.model.parameters()).device)

    def _held(self) -> list[torch.Tensor | None]:
        """The gradient of each of ``self.named`` as held now (what ``_take_grads`` will hand ``step``)."""
        if self.fp32_grads is None:
            return [t.grad for _, t in self.named]
        return [self.fp32_grads.grads.get(p) for _, p in self.params]

    def _held_sq(self, grads: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``grads_finite``'s sums, where ``grads`` are the very tensors it read, unmodified since; else None."""
        sq, seen = self._sq
        self._sq = (None, None)
        now = [g for g in grads if g is not None]
        if sq is None or len(now) != len(seen) or any(g is not h or g._version != v for g, (h, v) in zip(now, seen)):
            return None
        return sq

    def step(self, max_norm: float) -> torch.Tensor:
        kernel = self.kernel and (not self.check_kernel or adamw_kernel.usable(self.named[0][1].device, self.split))
        own = kernel or self.moments != torch.float32 or self.split
        grads = self._take_grads(as_held=own and self.dims.dp == 1)
        if self.dims.dp > 1 and self.split:   # FP32 sums, as the FP32 master's .grad would hold them
            grads = [torch.zeros(p.shape, device=p.device) if g is None else g for (_, p), g in zip(self.params, grads)]
            reduce_gradients(self.model, self.dims, [(n, g) for (n, _), g in zip(self.params, grads)])
        elif self.dims.dp > 1:
            sync_gradients(self.model, self.dims, self.named)
            grads = [t.grad for _, t in self.named]
        if own:
            update = adamw_kernel.triton_adamw_ if kernel else adamw_kernel.reference_adamw_
            return self._own_step(grads, max_norm, update)
        if self.dims.world_size > 1:
            norm = clip_grad_norm(self.model, max_norm, self.dims, self.grad_weight, self.named)
        else:
            norm = torch.nn.utils.clip_grad_norm_([t for _, t in self.named], max_norm if max_norm > 0 else float("inf"))
        self.optimizer.step()
        if self.fp32_grads is not None:
            self._cast_master()
        return norm

    def _take_grads(self, as_held: bool) -> list[torch.Tensor | None]:
        """This step's gradient of each of ``self.named``. BF16 weights: taken from ``fp32_grads``, as held
        (``as_held``: a single micro-batch's stays BF16) or as the FP32 master's ``.grad``."""
        if self.fp32_grads is None:
            return [t.grad for _, t in self.named]
        grads = []
        for (_, p), (_, m) in zip(self.params, self.named):
            g = self.fp32_grads.pop(p)
            if g is not None and not as_held:
                g = g.float()
                if not self.split:   # the split master's low halves hold no gradient: step() reduces the list
                    m.grad = g
            grads.append(g)
        return grads

    @torch.no_grad()
    def _own_step(self, grads: list[torch.Tensor | None], max_norm: float, update: Callable) -> torch.Tensor:
        """Norm, clip coefficient (device scalars), then ``update`` (the Triton AdamW: one launch; or its torch
        reference) per parameter with a gradient (``torch.optim.AdamW`` skips the others too), its step count
        advanced on the host."""
        norm = grad_norm(self.model, self.dims, self.grad_weight, self.named, grads, sq=self._held_sq(grads))
        coef = clip_coef(norm, max_norm).float() if max_norm > 0 else None
        grad_of = {id(t): g for (_, t), g in zip(self.named, grads)}
        low = {id(m): p for (_, p), (_, m) in zip(self.params, self.named)} if self.fp32_grads is not None else {}
        for group in self.optimizer.param_groups:
            beta1, beta2 = group["betas"]
            for t in group["params"]:
                g = grad_of[id(t)]
                if g is None:
                    continue
                state = self.optimizer.state[t]
                state["step"] += 1
                update(t.data, g.contiguous(), state["exp_avg"], state["exp_avg_sq"], lr=group["lr"], beta1=beta1,
                       beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"], step=int(state["step"]),
                       coef=coef, out=low[id(t)].data if id(t) in low else None)
        return norm

    @torch.no_grad()
    def _cast_master(self) -> None:
        torch._foreach_copy_([p for _, p in self.params], [m for _, m in self.named])

    def zero_grad(self) -> None:
        self._sq = (None, None)
        self.optimizer.zero_grad(set_to_none=True)
        if self.fp32_grads is not None:
            self.fp32_grads.clear()
            for _, p in self.params:
                p.grad = None

    def held_grads(self) -> tuple[dict, dict]:
        """This step's gradients as ``step`` will read them: each parameter's ``.grad``, and with BF16 weights
        ``fp32_grads``' entries. A CUDA graph's backward rewrites these tensors at every replay, and ``step`` /
        ``zero_grad`` drop the references, so ``parallel.cuda_graph`` hands them back (``hold_grads``)."""
        return ({p: p.grad for _, p in self.params if p.grad is not None},
                dict(self.fp32_grads.grads) if self.fp32_grads is not None else {})

    def hold_grads(self, held: tuple[dict, dict]) -> None:
        grads, fp32 = held
        for p, g in grads.items():
            p.grad = g
        if self.fp32_grads is not None:
            self.fp32_grads.grads.update(fp32)

    def state_dict(self) -> dict:
        state = {n: {k: self.optimizer.state[t][k] for k in ("step", "exp_avg", "exp_avg_sq")} for n, t in self.named}
        _, optim_sd = to_global({}, {"state": state}, self.model, self.dims)
        return {"state": optim_sd["state"]}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        state = to_local(sd["state"])
        for n, t in self.named:
            if n not in state:
                raise KeyError(f"optimizer state for {n} missing from the checkpoint")
            for k in ("step", "exp_avg", "exp_avg_sq"):
                self.optimizer.state[t][k].copy_(torch.as_tensor(state[n][k]).reshape(self.optimizer.state[t][k].shape))

    def master_weights(self) -> dict[str, torch.Tensor] | None:
        """The FP32 master under the single-device names (experts as DTensors of the global shape), what a
        checkpoint stores as the weights; None when the weights are FP32 and their own master."""
        if self.fp32_grads is None:
            return None
        if self.split:   # joined anew: FP32 copies (what checkpoints store), not the halves the optimizer updates
            return to_global({n: adamw_kernel.join_master(p.detach(), m).view(p.shape)
                              for (n, p), (_, m) in zip(self.params, self.named)}, {}, self.model, self.dims)[0]
        return to_global({n: m.detach() for n, m in self.named}, {}, self.model, self.dims)[0]

    def master_halves(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
        """With a split master, name -> (BF16 weight, int16 low halves): the live halves, which
        ``trainer.ema.ParamEMA`` joins at each update (``master_weights`` gives copies); else None."""
        if not self.split:
            return None
        return {n: (p.detach(), m) for (n, p), (_, m) in zip(self.params, self.named)}

    @torch.no_grad()
    def load_master_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """The master from ``sd`` (``master_weights``' form, loaded), then the BF16 weights from it."""
        sd = to_local(sd)
        if self.split:
            for (n, p), (_, m) in zip(self.params, self.named):
                high, low = adamw_kernel.split_master(sd[n].to(p.device))
                p.copy_(high.view(p.shape))
                m.copy_(low.view(m.shape))
            return
        for n, m in self.named:
            m.copy_(sd[n])
        self._cast_master()

    def memory(self) -> MemoryReport:
        params = [p for _, p in self.params]
        n = sum(p.numel() for p in params)
        measured = {"params": sum(p.numel() * p.element_size() for p in params), "grads": 4 * n,
                    "master": (2 if self.split else 4) * n if self.fp32_grads is not None else 0,
                    "optim": 2 * self.moments.itemsize * n}   # fp32 grads and AdamW moments of every local parameter
        return account(self.model, self.dims, zero=0, moment_bytes=self.moments.itemsize, measured=measured,
                       weight_bytes=params[0].element_size() if params else 4, master_bytes=2 if self.split else 4)


MOMENT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}   # optim.moment_dtype's values, ``auto`` resolved
MASTERS = ("fp32", "split")   # optim.master: the FP32 master as its own tensor, or as the BF16 weight + 16 low bits


def moment_dtype(setting: str, zero: int, backend: str = "native", weights: str = "fp32") -> str:
    """The AdamW moment dtype ``optim.moment_dtype`` resolves to: ``auto`` is bf16, DeepSeek-V3's recipe, wherever
    the optimizer keeps its own FP32 master (BF16 weights: ``weights``, ``train.precision=bf16|fp8``; the native
    ZeRO's master pieces), and fp32 where torch's or DeepSpeed's AdamW updates FP32 weights in place."""
    if setting != "auto":
        return setting
    if zero >= 1:
        return "bf16" if backend == "native" else "fp32"
    return "bf16" if weights != "fp32" else "fp32"


def build_optimizer(model: nn.Module, optim, dims: ParallelDims, zero: int = 0, backend: str = "native",
                    bucket_mb: float = 32.0, grad_weight: Callable[[str], float] | None = None, weights: str = "fp32"):
    """``optim``: the AdamW settings (``lr``, ``beta1``, ``beta2``, ``eps``, ``weight_decay``, ``grad_clip``,
    ``moment_dtype``: the config's ``optim`` section); ``zero``, ``backend``, ``bucket_mb``: ``parallel.zero``,
    ``parallel.zero_backend``, ``parallel.zero_bucket_mb``. ``grad_weight(name)`` (1 / holders) counts a tensor
    held by several pipeline ranks (DualPipe replicas, tied embeddings) once in the global gradient norm.
    ``weights`` (``Precision.weights``, ``parallel/precision.py``): ``bf16`` takes the model's FP32 values as the FP32
    master and casts the parameters to BF16 (``master.py``); ``fp32`` leaves them FP32, their own master."""
    if weights not in WEIGHT_DTYPES:
        raise ValueError(f"weights must be one of {sorted(WEIGHT_DTYPES)}, got {weights!r}")
    if zero and getattr(optim, "master", "fp32") != "fp32":
        raise ValueError(f"optim.master={optim.master} runs without ZeRO only (parallel.zero={zero})")
    if zero == 0:
        return Replicated(model, optim, dims, grad_weight, weights,
                          moments=moment_dtype(getattr(optim, "moment_dtype", "auto"), zero, backend, weights),
                          master=getattr(optim, "master", "fp32"))
    if backend == "deepspeed":
        from .deepspeed_backend import DeepSpeedZero
        return DeepSpeedZero(model, optim, dims, stage=zero, bucket_mb=bucket_mb, weights=weights)
    from .native import ZeroOptimizer
    moments = moment_dtype(optim.moment_dtype, zero, backend, weights)
    return ZeroOptimizer(model, optim, dims, stage=zero, moment_dtype=moments,
                         bucket_mb=bucket_mb, grad_weight=grad_weight, weights=weights)


__all__ = ["build_optimizer", "moment_dtype", "MOMENT_DTYPES", "MASTERS", "WEIGHT_DTYPES", "NonFiniteGradients",
           "Replicated", "MemoryReport", "account"]
