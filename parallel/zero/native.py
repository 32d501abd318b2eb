"""Native ZeRO-1/2 for AdamW: optimizer state (and with stage 2 gradients) sharded over data parallelism.

Which ranks share what (``ParallelDims``): dense parameters are replicated over the ``dp`` ranks of a
pipeline stage and sharded over them; routed-expert parameters are already split over ``ep`` and
replicated over ``edp = dp / ep``, so they are sharded over the expert-dp group.

Shard layout (chosen so checkpoints are plain DTensors that DCP reshards): every parameter is cut into
``torch.chunk``-style pieces along one dimension —

* dense: dim 0, over the (edp, ep) mesh of the stage, i.e. placements ``[Shard(0), Shard(0)]``
  (rank ``dp_rank = edp_index * ep + ep_index`` holds the ``dp_rank``-th nested chunk);
* experts (local shape ``[E/ep, a, b]``): dim 1 over edp, on top of EP's dim-0 split, i.e.
  ``[Shard(1), Shard(0)]`` on (edp, ep) — the expert dimension is often smaller than edp, the
  feature dimensions are not.

Parameters are grouped into buckets (same reduce group, weight decay and dtype; about
``bucket_mb`` of gradients each). A bucket is one ``[k, S]`` buffer for a group of ``k`` ranks: row
``i`` holds rank ``i``'s pieces of all the bucket's parameters (each padded to the largest piece), so a
single ``reduce_scatter`` leaves every rank the summed gradient of exactly its pieces, and one
``all_gather`` of the updated FP32 master pieces rebuilds every parameter.

Step: gradients (fp32, accumulated over the step's micro-batches) -> reduce-scatter (sum; / dp) ->
global norm over shards, data-parallel and pipeline ranks (tensors held by several pipeline ranks
weighted 1 / holders) -> clip -> AdamW on the FP32 master pieces (moments in ``moment_dtype``, maths in
FP32, the same operation order as ``torch.optim.AdamW``) -> all-gather into the parameters.

Stage 2 (``backward()`` path, no pipeline): a bucket is reduce-scattered as soon as the last of its
gradients has been accumulated in a micro-batch's backward (buckets are issued in one fixed order on
every rank), added into a persistent FP32 shard accumulator, and its full gradients are freed; only
the shards persist across micro-batches. With a pipeline the executor drives the backward and the
DualPipe replica sums need the full gradients, so both stages reduce once, at ``step``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ..data_parallel import all_finite
from ..dims import ParallelDims
from ..ep import is_expert_param
from . import MOMENT_DTYPES
from .memory import MemoryReport, account


def chunk_range(n: int, k: int, i: int) -> tuple[int, int]:
    """(start, length) of piece ``i`` of ``n`` elements cut into ``k`` (``torch.chunk`` / DTensor ``Shard``)."""
    size = -(-n // k) if n else 0
    start = min(i * size, n)
    return start, max(0, min(n, start + size) - start)


@dataclass
class _Slot:
    """One parameter inside a bucket: its pieces (one per rank of the reduce group) and place in a row."""
    name: str
    param: nn.Parameter
    dim: int                                   # the dimension cut into pieces
    index: list[tuple]                         # per group rank: the piece's index into the local parameter
    shapes: list[tuple[int, ...]]              # per group rank: the piece's shape
    numels: list[int]
    offset: int = 0                            # start of this parameter's slot in each row
    weight: float = 1.0                        # 1 / pipeline holders (global norm)

    @property
    def slot(self) -> int:
        return max(self.numels)


@dataclass
class _Bucket:
    kind: str                                  # "dense" | "expert"
    weight_decay: float
    group: object
    k: int                                     # ranks in the reduce group
    me: int                                    # this rank's index in it
    slots: list[_Slot] = field(default_factory=list)
    size: int = 0                              # S: row length
    master: torch.Tensor | None = None
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    grad: torch.Tensor | None = None           # reduced gradient shard (fp32), accumulated
    ready: int = 0                             # stage-2 hooks: parameters accumulated this backward

    def mine(self, t: torch.Tensor, s: _Slot) -> torch.Tensor:
        """This rank's piece of slot ``s`` inside a row-sized flat tensor, shaped like the piece."""
        return t[s.offset:s.offset + s.numels[self.me]].view(s.shapes[self.me])


class _LRGroups(torch.optim.Optimizer):
    """Holds one param group per bucket so ``torch.optim.lr_scheduler`` can set each group's ``lr``.
    ``step`` does no maths (``ZeroOptimizer.step`` does); it is called once per update so the scheduler
    sees the usual optimizer-then-scheduler order."""

    def step(self, closure=None):
        return None


class ZeroOptimizer:
    def __init__(self, model: nn.Module, optim_cfg, dims: ParallelDims, stage: int = 1, moment_dtype: str = "bf16",
                 bucket_mb: float = 32.0, grad_weight: Callable[[str], float] | None = None):
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
        self.buckets = self._build_buckets(optim_cfg.weight_decay, bucket_mb, grad_weight)
        for b in self.buckets:
            self._allocate(b)
        self.optimizer = _LRGroups([{"params": [b.master], "weight_decay": b.weight_decay} for b in self.buckets],
                                   {"lr": self.lr})
        if stage == 2:
            for b in self.buckets:
                for s in b.slots:
                    s.param.register_post_accumulate_grad_hook(lambda p, b=b: self._on_grad(b))

    # ---- layout --------------------------------------------------------------------------------------
    def _build_buckets(self, weight_decay: float, bucket_mb: float, grad_weight) -> list[_Bucket]:
        d = self.dims
        expert = is_expert_param(self.model)
        groups = {"dense": (d.group("dp") if d.dp > 1 else None, d.dp, d.dp_rank),
                  "expert": (d.group("edp") if d.edp > 1 else None, d.edp, d.dp_rank // d.ep)}
        limit = bucket_mb * 2**20
        open_: dict[tuple, _Bucket] = {}
        buckets: list[_Bucket] = []
        # Reverse registration order: roughly the order gradients become final in a backward.
        for name, p in reversed(list(self.model.named_parameters())):
            if not p.requires_grad:
                continue
            if p.dim() == 0:
                raise ValueError(f"ZeRO: parameter {name} is a scalar; shard-able parameters need >= 1 dim")
            kind = "expert" if expert[name] else "dense"
            wd = weight_decay if p.dim() >= 2 else 0.0
            group, k, me = groups[kind]
            dim = 1 if kind == "expert" and p.dim() >= 2 else 0
            slot = self._slot(name, p, dim, kind, k)
            slot.weight = grad_weight(name) if grad_weight else 1.0
            key = (kind, wd, p.dtype)
            b = open_.get(key)
            if b is None or (b.size and (b.size + slot.slot) * k * 4 > limit):
                b = open_[key] = _Bucket(kind, wd, group, k, me)
                buckets.append(b)
            slot.offset = b.size
            b.size += slot.slot
            b.slots.append(slot)
        return buckets

    def _slot(self, name: str, p: torch.Tensor, dim: int, kind: str, k: int) -> _Slot:
        d = self.dims
        index, shapes, numels = [], [], []
        n = p.shape[dim]
        for i in range(k):
            if kind == "dense":   # nested chunks: over edp first, then over ep (DTensor [Shard(0), Shard(0)])
                e, r = divmod(i, d.ep)
                s0, l0 = chunk_range(n, d.edp, e)
                s1, l1 = chunk_range(l0, d.ep, r)
                start, length = s0 + s1, l1
            else:
                start, length = chunk_range(n, k, i)
            idx = tuple([slice(None)] * dim + [slice(start, start + length)])
            shape = tuple(p.shape[:dim]) + (length,) + tuple(p.shape[dim + 1:])
            index.append(idx)
            shapes.append(shape)
            numels.append(math.prod(shape))
        return _Slot(name, p, dim, index, shapes, numels)

    def _allocate(self, b: _Bucket) -> None:
        b.master = torch.zeros(b.size, dtype=torch.float32, device=b.slots[0].param.device)
        b.exp_avg = torch.zeros(b.size, dtype=self.moment_dtype, device=b.master.device)
        b.exp_avg_sq = torch.zeros_like(b.exp_avg)
        self._refresh_master(b)

    @torch.no_grad()
    def _refresh_master(self, b: _Bucket) -> None:
        for s in b.slots:
            b.mine(b.master, s).copy_(s.param[s.index[b.me]])

    # ---- gradients ---------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's backward. Stage 2 reduce-scatters buckets as their gradients become final."""
        if self.stage != 2:
            loss.backward()
            return
        self._armed, self._next, self._reduced = True, 0, True
        for b in self.buckets:
            b.ready = 0
        try:
            loss.backward()
        finally:
            self._armed = False
        while self._next < len(self.buckets):   # parameters without a gradient this time count as zeros
            self._issue(self.buckets[self._next])
            self._next += 1
        self._drain()

    def _on_grad(self, b: _Bucket) -> None:
        if not self._armed:
            return
        b.ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].slots):
            self._issue(self.buckets[self._next])
            self._next += 1

    @torch.no_grad()
    def _issue(self, b: _Bucket) -> None:
        """Pack the bucket's gradients into ``[k, S]``, free them, start the reduce-scatter."""
        self._drain(keep=1)   # at most two buckets in flight
        send = torch.zeros(b.k, b.size, dtype=torch.float32, device=b.master.device)
        for s in b.slots:
            g = s.param.grad
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
        sq = torch.zeros((), dtype=torch.float64, device=self.buckets[0].master.device if self.buckets else "cpu")
        for b in self.buckets:
            b.grad.mul_(1.0 / d.dp)   # sums over dp (experts: the all-to-all already summed over ep) -> mean
            for s in b.slots:
                if s.numels[b.me]:
                    sq += b.mine(b.grad, s).double().pow(2).sum() * s.weight
        if d.dp > 1:
            dist.all_reduce(sq, group=d.group("dp"))   # dense pieces over dp; expert pieces over edp x ep
        if d.pp > 1:
            dist.all_reduce(sq, group=d.group("pp"))
        norm = sq.sqrt()   # stays on the device: the clip factor below needs no host sync
        if max_norm > 0:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for b in self.buckets:
                b.grad.mul_(coef)
        self.n_steps += 1
        beta1, beta2 = self.betas
        bc1 = 1 - beta1 ** self.n_steps
        bc2_sqrt = (1 - beta2 ** self.n_steps) ** 0.5
        for b, group in zip(self.buckets, self.optimizer.param_groups):
            lr = group["lr"]
            m = b.exp_avg.float() if b.exp_avg.dtype != torch.float32 else b.exp_avg
            v = b.exp_avg_sq.float() if b.exp_avg_sq.dtype != torch.float32 else b.exp_avg_sq
            if b.weight_decay:
                b.master.mul_(1 - lr * b.weight_decay)
            m.lerp_(b.grad, 1 - beta1)
            v.mul_(beta2).addcmul_(b.grad, b.grad, value=1 - beta2)
            denom = (v.sqrt() / bc2_sqrt).add_(self.eps)
            b.master.addcdiv_(m, denom, value=-lr / bc1)
            if m is not b.exp_avg:
                b.exp_avg.copy_(m)
                b.exp_avg_sq.copy_(v)
            b.grad = None
        self._step_reduced = False
        self._all_gather()
        self.optimizer.step()
        return norm

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
        for b in self.buckets:
            b.grad = None
            for s in b.slots:
                s.param.grad = None

    # ---- checkpoints -------------------------------------------------------------------------------
    def _dtensor(self, b: _Bucket, flat: torch.Tensor, s: _Slot) -> DTensor | torch.Tensor:
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
        """After the model's parameters have been loaded: moments from ``sd``, master pieces from the
        parameters (the FP32 weights are the checkpointed master)."""
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
            self._refresh_master(b)
        if len(steps) > 1:
            raise ValueError(f"optimizer state holds different step counts {sorted(steps)}")
        self.n_steps = steps.pop() if steps else 0

    # ---- accounting --------------------------------------------------------------------------------
    def memory(self) -> MemoryReport:
        params = [s.param for b in self.buckets for s in b.slots]
        n = sum(p.numel() for p in params)
        shard = sum(b.size for b in self.buckets)
        measured = {"params": sum(p.numel() * p.element_size() for p in params),
                    "grads": 4 * (shard if self.stage == 2 else n),
                    "master": sum(b.master.numel() * b.master.element_size() for b in self.buckets),
                    "optim": sum((b.exp_avg.numel() + b.exp_avg_sq.numel()) * b.exp_avg.element_size()
                                 for b in self.buckets)}
        return account(self.model, self.dims, zero=self.stage, moment_bytes=self.buckets[0].exp_avg.element_size()
                       if self.buckets else 4, measured=measured)
