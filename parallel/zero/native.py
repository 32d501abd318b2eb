"""Native ZeRO-1/2 for AdamW: optimizer state (and with stage 2 gradients) sharded over data parallelism.

Which ranks share what (``ParallelDims``): dense parameters are replicated over the ``dp`` ranks of a
pipeline stage and sharded over them; routed-expert parameters are already split over ``ep`` and
replicated over ``edp = dp / ep``, so they are sharded over the expert-dp group.

Layout: ``buckets.py``; one ``reduce_scatter`` per bucket leaves every rank the summed gradient of exactly its
pieces, and one ``all_gather`` of the updated FP32 master pieces rebuilds every parameter.

BF16 weights (``weights="bf16"``, ``master.py``): the master pieces come from the FP32 values the model
arrives with, then the parameters are cast; gradients are accumulated in FP32 per parameter (``FP32Grads``)
and all-gathers carry BF16.

Step: gradients (fp32, accumulated over the step's micro-batches) -> reduce-scatter (sum; / dp) ->
global norm over shards, data-parallel and pipeline ranks (tensors held by several pipeline ranks
weighted 1 / holders) -> clip -> AdamW on the FP32 master pieces (moments in ``moment_dtype``, maths in
FP32, the same operation order as ``torch.optim.AdamW``) -> all-gather into the parameters.

Stage 2 (``backward()`` path, no pipeline): a bucket is reduce-scattered as soon as the last of its
gradients has been accumulated in a micro-batch's backward (buckets are issued in one fixed order on
every rank), added into a persistent FP32 shard accumulator, and its full gradients are freed; only
the shards persist across micro-batches (BF16 weights: each micro-batch's BF16 gradient is reduced in FP32
and summed into the FP32 shard). With a pipeline the executor drives the backward and the
DualPipe replica sums need the full gradients, so both stages reduce once, at ``step``.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..data_parallel import all_finite, clip_coef, weighted_sq
from ..dims import ParallelDims
from kernels import adamw as adamw_kernel

from . import MOMENT_DTYPES, triton_adamw
from .buckets import Bucket, Slot, build_buckets, chunk_range  # noqa: F401 - chunk_range: this module's API too
from .master import WEIGHT_DTYPES, FP32Grads, cast_
from .memory import MemoryReport, account


class _LRGroups(torch.optim.Optimizer):
    """Holds one param group per bucket so ``torch.optim.lr_scheduler`` can set each group's ``lr``.
    ``step`` does no maths (``ZeroOptimizer.step`` does); it is called once per update so the scheduler
    sees the usual optimizer-then-scheduler order."""

    def step(self, closure=None):
        return None


class ZeroOptimizer:
    def __init__(self, model: nn.Module, optim_cfg, dims: ParallelDims, stage: int = 1, moment_dtype: str = "bf16",
                 bucket_mb: float = 32.0, grad_weight: Callable[[str], float] | None = None, weights: str = "fp32",
                 kernel: bool | None = None):
        """``kernel``: update each bucket with the Triton AdamW (``kernels/adamw.py``, one launch per bucket, the
        clip folded in); default on CUDA where it passed its self-check (``triton_adamw``), ``True`` forces it
        (the interpreter on CPU: tests), else ``kernels.adamw.reference_adamw_`` (the same maths in torch)."""
        if stage not in (1, 2):
            raise ValueError(f"ZeRO stage must be 1 or 2, got {stage}")
        self.model, self.dims, self.stage = model, dims, stage
        self.moment_dtype = MOMENT_DTYPES[moment_dtype]
        self.lr, self.betas, self.eps = optim_cfg.lr, (optim_cfg.beta1, optim_cfg.beta2), optim_cfg.eps
        self.n_steps = 0
        self._armed = False
        self._reduced = False                # stage 2: this step's gradients went through backward()
        self._step_reduced = False           # this step's gradients are reduced into the buckets
        self._pending: list = []
        self._next = 0                       # stage 2: index of the next bucket to issue
        self.buckets = build_buckets(model, dims, optim_cfg.weight_decay, bucket_mb, grad_weight)
        for b in self.buckets:
            self._allocate(b)
        self.kernel = triton_adamw([b.master for b in self.buckets]) if kernel is None else kernel
        self.check_kernel = kernel is None
        self.optimizer = _LRGroups([{"params": [b.master], "weight_decay": b.weight_decay} for b in self.buckets],
                                   {"lr": self.lr})
        params = [s.param for b in self.buckets for s in b.slots]
        self.fp32_grads = None   # BF16 weights: FP32 accumulators (the master pieces hold the FP32 values now)
        if weights != "fp32":
            cast_(params, WEIGHT_DTYPES[weights])
            self.fp32_grads = FP32Grads(params)
        if stage == 2:
            for b in self.buckets:
                for s in b.slots:
                    s.param.register_post_accumulate_grad_hook(lambda p, b=b: self._on_grad(b))

    def _allocate(self, b: Bucket) -> None:
        b.master = torch.zeros(b.size, dtype=torch.float32, device=b.slots[0].param.device)
        b.exp_avg = torch.zeros(b.size, dtype=self.moment_dtype, device=b.master.device)
        b.exp_avg_sq = torch.zeros_like(b.exp_avg)
        self._refresh_master(b)

    @torch.no_grad()
    def _refresh_master(self, b: Bucket) -> None:
        for s in b.slots:
            b.mine(b.master, s).copy_(s.param[s.index[b.me]])

    # ---- gradients ---------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's backward. Stage 2 reduce-scatters buckets as their gradients become final."""
        if self.stage != 2:
            loss.backward()
            return
        self._armed, self._next, self._reduced = True, 0, True
        self._pause_fp32_grads(True)   # each bucket's micro-batch gradient goes straight into its FP32 reduce
        for b in self.buckets:
            b.ready = 0
        try:
            loss.backward()
        finally:
            self._armed = False
            self._pause_fp32_grads(False)
        while self._next < len(self.buckets):   # parameters without a gradient this time count as zeros
            self._issue(self.buckets[self._next])
            self._next += 1
        self._drain()

    def _pause_fp32_grads(self, paused: bool) -> None:
        if self.fp32_grads is not None:
            self.fp32_grads.paused = paused

    def _take_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """``p``'s gradient so far, handed over: ``p.grad`` (FP32 weights; ZeRO-2's backward path) or, with BF16
        weights, its FP32 accumulator (removed from ``fp32_grads``)."""
        if p.grad is not None or self.fp32_grads is None:
            return p.grad
        return self.fp32_grads.pop(p)

    def named_grads(self) -> dict[str, torch.Tensor]:
        """Name -> this step's gradient so far, zeros where none (pipeline replica sums add into these)."""
        out = {}
        for b in self.buckets:
            for s in b.slots:
                if self.fp32_grads is not None:
                    out[s.name] = self.fp32_grads.get(s.param, fill=True)
                else:
                    if s.param.grad is None:
                        s.param.grad = torch.zeros_like(s.param)
                    out[s.name] = s.param.grad
        return out

    def _on_grad(self, b: Bucket) -> None:
        if not self._armed:
            return
        b.ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].slots):
            self._issue(self.buckets[self._next])
            self._next += 1

    @torch.no_grad()
    def _issue(self, b: Bucket) -> None:
        """Pack the bucket's gradients into ``[k, S]``, free them, start the reduce-scatter."""
        self._drain(keep=1)   # at most two buckets in flight
        send = torch.zeros(b.k, b.size, dtype=torch.float32, device=b.master.device)
        for s in b.slots:
            g = self._take_grad(s.param)
            if g is None:
                continue
            for i in range(b.k):
                if s.numels[i]:
                    send[i, s.offset:s.offset + s.numels[i]].copy_(g[s.index[i]].reshape(-1))
            s.param.grad = None
        if b.group is None:
            self._pending.append((None, send[0], b))
            return
        out = torch.empty(b.size, dtype=torch.float32, device=send.device)
        work = dist.reduce_scatter_single(out, send.view(-1), group=b.group, async_op=True)
        self._pending.append((work, out, b))

    def _drain(self, keep: int = 0) -> None:
        while len(self._pending) > keep:
            work, out, b = self._pending.pop(0)
            if work is not None:
                work.wait()
            if b.grad is None:
                b.grad = out
            else:
                b.grad.add_(out)

    def _reduce_all(self) -> None:
        """Every bucket, in the same order on every rank (collectives must match), unless stage 2's
        backward() already reduced them all; once per step (``grads_finite`` may have done it)."""
        if self._step_reduced:
            return
        if not self._reduced:
            for b in self.buckets:
                self._issue(b)
        self._drain()
        self._reduced = False
        self._step_reduced = True

    @torch.no_grad()
    def grads_finite(self) -> torch.Tensor:
        """No inf/nan in this rank's reduced gradient pieces (reduces them now: ``step`` would anyway). A
        non-finite value anywhere in the dp group lands, summed, in the piece of the rank that owns it."""
        self._reduce_all()
        device = self.buckets[0].master.device if self.buckets else "cpu"
        return all_finite([b.grad for b in self.buckets if b.grad is not None], device)

    # ---- the update --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, max_norm: float) -> torch.Tensor:
        self._reduce_all()
        d = self.dims
        pieces, weights = [], []
        for b in self.buckets:
            b.grad.mul_(1.0 / d.dp)   # sums over dp (experts: the all-to-all already summed over ep) -> mean
            for s in b.slots:
                if s.numels[b.me]:
                    pieces.append(b.mine(b.grad, s))
                    weights.append(s.weight)
        device = self.buckets[0].master.device if self.buckets else torch.device("cpu")
        sq = weighted_sq(pieces, [0] * len(pieces), weights, 1, device)[0]   # FP64, no FP64 copy of a piece
        if d.dp > 1:
            dist.all_reduce(sq, group=d.group("dp"))   # dense pieces over dp; expert pieces over edp x ep
        if d.pp > 1:
            dist.all_reduce(sq, group=d.group("pp"))
        norm = sq.sqrt()   # stays on the device: the clip factor below needs no host sync
        coef = clip_coef(norm, max_norm).float() if max_norm > 0 else None
        self.n_steps += 1
        update = self._update()
        for b, group in zip(self.buckets, self.optimizer.param_groups):
            update(b.master, b.grad, b.exp_avg, b.exp_avg_sq, lr=group["lr"], beta1=self.betas[0],
                   beta2=self.betas[1], eps=self.eps, weight_decay=b.weight_decay, step=self.n_steps, coef=coef)
            b.grad = None
        self._step_reduced = False
        self._all_gather()
        self.optimizer.step()
        return norm

    def _update(self):
        """The AdamW update of a bucket: the Triton kernel (``kernel``, where it passed its self-check), else the
        same maths in torch."""
        usable = self.buckets and (not self.check_kernel or adamw_kernel.usable(self.buckets[0].master.device))
        return adamw_kernel.triton_adamw_ if self.kernel and usable else adamw_kernel.reference_adamw_

    def _all_gather(self) -> None:
        works = []
        for b in self.buckets:
            dtype = b.slots[0].param.dtype
            if b.group is None:
                works.append((None, b.master.to(dtype).unsqueeze(0), b))
                continue
            out = torch.empty(b.k, b.size, dtype=dtype, device=b.master.device)
            works.append((dist.all_gather_single(out.view(-1), b.master.to(dtype), group=b.group, async_op=True), out, b))
        for work, out, b in works:
            if work is not None:
                work.wait()
            for s in b.slots:
                for i in range(b.k):
                    if s.numels[i]:
                        s.param.data[s.index[i]] = out[i, s.offset:s.offset + s.numels[i]].view(s.shapes[i])

    def zero_grad(self) -> None:
        self._reduced = self._step_reduced = False
        if self.fp32_grads is not None:
            self.fp32_grads.clear()
        for b in self.buckets:
            b.grad = None
            for s in b.slots:
                s.param.grad = None

    # ---- checkpoints -------------------------------------------------------------------------------
    def _dtensor(self, b: Bucket, flat: torch.Tensor, s: Slot) -> DTensor | torch.Tensor:
        d = self.dims
        local = b.mine(flat, s)
        if not dist.is_initialized():   # one process: the pieces are the whole tensors
            return local
        shape = list(s.param.shape)
        if b.kind == "expert":
            shape[0] *= d.ep
            placements = [Shard(s.dim), Shard(0)]
        else:
            placements = [Shard(0), Shard(0)]
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, d.expert_mesh(), placements, run_check=False, shape=torch.Size(shape),
                                  stride=stride)

    def state_dict(self) -> dict:
        """Per parameter (single-device name and global shape): this rank's pieces of the AdamW moments."""
        state = {}
        for b in self.buckets:
            for s in b.slots:
                state[s.name] = {"step": torch.tensor(float(self.n_steps)),
                                 "exp_avg": self._dtensor(b, b.exp_avg, s),
                                 "exp_avg_sq": self._dtensor(b, b.exp_avg_sq, s)}
        return {"state": state}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """After the model's parameters have been loaded: moments from ``sd``; with FP32 weights the master
        pieces from the parameters (they are the checkpointed master; BF16 weights: ``load_master_weights``)."""
        state = sd["state"]
        steps = set()
        for b in self.buckets:
            for s in b.slots:
                if s.name not in state:
                    raise KeyError(f"optimizer state for {s.name} missing from the checkpoint")
                for key, flat in (("exp_avg", b.exp_avg), ("exp_avg_sq", b.exp_avg_sq)):
                    t = state[s.name][key]
                    t = t.to_local() if isinstance(t, DTensor) else t
                    b.mine(flat, s).copy_(t.reshape(s.shapes[b.me]))
                steps.add(int(float(state[s.name]["step"])))
            if self.fp32_grads is None:
                self._refresh_master(b)
        if len(steps) > 1:
            raise ValueError(f"optimizer state holds different step counts {sorted(steps)}")
        self.n_steps = steps.pop() if steps else 0

    def master_weights(self) -> dict[str, torch.Tensor] | None:
        """BF16 weights: this rank's FP32 master pieces under the single-device names (DTensors of the global
        shape, like the moments), what a checkpoint stores as the weights; None with FP32 weights."""
        if self.fp32_grads is None:
            return None
        return {s.name: self._dtensor(b, b.master, s) for b in self.buckets for s in b.slots}

    @torch.no_grad()
    def load_master_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """The master pieces from ``sd`` (``master_weights``' form, loaded), then all-gathered into the BF16
        weights (a collective)."""
        for b in self.buckets:
            for s in b.slots:
                t = sd[s.name]
                b.mine(b.master, s).copy_((t.to_local() if isinstance(t, DTensor) else t).reshape(s.shapes[b.me]))
        self._all_gather()

    # ---- accounting --------------------------------------------------------------------------------
    def memory(self) -> MemoryReport:
        params = [s.param for b in self.buckets for s in b.slots]
        n = sum(p.numel() for p in params)
        shard = sum(b.size for b in self.buckets)
        measured = {"params": sum(p.numel() * p.element_size() for p in params),
                    # stage 2 holds only shards through backward(); under a pipeline full gradients accumulate
                    "grads": 4 * (shard if self.stage == 2 and self.dims.pp == 1 else n),
                    "master": sum(b.master.numel() * b.master.element_size() for b in self.buckets),
                    "optim": sum((b.exp_avg.numel() + b.exp_avg_sq.numel()) * b.exp_avg.element_size()
                                 for b in self.buckets)}
        return account(self.model, self.dims, zero=self.stage, moment_bytes=self.buckets[0].exp_avg.element_size()
                       if self.buckets else 4, measured=measured, weight_bytes=params[0].element_size() if params else 4)
