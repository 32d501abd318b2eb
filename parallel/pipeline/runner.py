"""``PipelineRunner``: what the trainer needs from pipeline parallelism, in one object.

``PipelineRunner.from_model`` takes the full single-device model (already expert-sharded, FP8 swapped): with a
zero-bubble schedule it makes the model's GEMM modules defer their weight gradients (``wgrad_queue``), then keeps
this rank's stages and prunes the rest (``parallel.parallelize`` calls it in its place among the transforms). The
runner owns the executor for this rank's action list, the ``WeightGradQueue`` and the replica sums (DualPipe's
twin stages, tied embeddings), and runs forward-only evaluation through the stages.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from models.transformer import DeepSeekV3

from ..dims import ParallelDims
from ..wgrad import WeightGradQueue, apply_deferred_wgrad
from .executor import PipelineExecutor
from .p2p import PipeChannels
from .schedules.actions import Kind
from .replicas import ReplicaSync
from .schedules import Schedule, get_schedule
from .stages import build_stages, prune_model


def wgrad_queue(model: DeepSeekV3, schedule: Schedule) -> WeightGradQueue | None:
    """For a schedule with zero-bubble B/W actions (ZB1P, DualPipe, DualPipeV): a queue, with the model's
    linears and routed experts made to defer their weight GEMMs into it (``apply_deferred_wgrad``), so that
    B computes dx and W runs only the dW GEMMs. None otherwise (1F1B): a deferred module's plain backward
    costs a few % (docs/benchmarks.md). Before ``build_stages`` (the stages hold the modules it replaces)
    and before ``apply_recompute`` (``parallel.parallelize`` keeps the order)."""
    if not schedule.splits_backward:
        return None
    queue = WeightGradQueue()
    apply_deferred_wgrad(model, queue)
    return queue


class PipelineRunner:
    def __init__(self, stages: dict, schedule: Schedule, dims: ParallelDims, model_cfg,
                 wgrad: WeightGradQueue | None = None, layout: list[int] | None = None,
                 device: torch.device | str = "cpu", overlap: bool = True, wire_dtype: torch.dtype = torch.float32):
        """``stages``: this rank's (``build_stages``), their GEMM modules already deferring into ``wgrad`` where
        ``schedule`` splits B and W; ``overlap``: run F&B actions overlapped (``parallelize.fb_overlap``)."""
        self.dims, self.cfg = dims, model_cfg
        self.schedule, self.n_stages = schedule, schedule.n_stages
        self.wgrad, self.stages = wgrad, stages       # one queue per model replica: every executor of it uses it
        self.replicas = ReplicaSync(model_cfg, schedule, dims, layout)
        self.p2p = PipeChannels(dims)
        self.device, self.overlap, self.wire_dtype = torch.device(device), overlap, wire_dtype
        self.n_microbatches = None
        self.set_microbatches(schedule.n_microbatches)

    @classmethod
    def from_model(cls, model: DeepSeekV3, dims: ParallelDims, schedule: str, n_microbatches: int,
                   layout: list[int] | None = None, device: torch.device | str = "cpu", overlap: bool = True,
                   wire_dtype: torch.dtype = torch.float32) -> "PipelineRunner":
        """Deferred weight gradients (zero-bubble schedules), then this rank's stages; the rest of ``model`` is
        pruned."""
        sched = get_schedule(schedule, dims.pp, n_microbatches)
        wgrad = wgrad_queue(model, sched)
        stages = build_stages(model, sched, dims.pp_rank, layout)
        prune_model(model, stages)
        return cls(stages, sched, dims, model.cfg, wgrad, layout, device, overlap, wire_dtype)

    def set_microbatches(self, n: int) -> None:
        """Use the schedule's action lists for ``n`` micro-batches per step (a batch-size ramp changes it
        between steps; every rank changes at the same step). The stages and channels stay."""
        if n == self.n_microbatches:
            return
        self.schedule = get_schedule(self.schedule.name, self.dims.pp, n)
        self.executor = PipelineExecutor(self.stages, self.schedule[self.dims.pp_rank], self.p2p, self.n_stages,
                                         self.cfg.dim, self.device, self.overlap, self.wgrad, self.wire_dtype)
        self.n_microbatches = n

    def forward_backward(self, micro_batches, loss_scale: float, mtp_weight: float, aux_alpha: float) -> torch.Tensor:
        """Run the schedule; returns ``[lm_sum, mtp_sum, aux_sum, n_microbatches]`` summed over the pipeline."""
        s = self.executor.step(micro_batches, loss_scale, mtp_weight, aux_alpha)
        out = torch.stack([s["lm"], s["mtp"], s["aux"], s["n"]])
        dist.all_reduce(out, group=self.dims.group("pp"))
        return out

    def action_times(self) -> dict[str, float]:
        """This rank's seconds in the last step's compute actions, per kind (``f``, ``b``, ``w``, ``bw``,
        ``fb``: each kind it ran), and ``span``: from its first compute action's start to its last's end."""
        out = {k.name.lower(): sum(v) for k, v in self.executor.durations.items() if v}
        return {**out, "span": self.executor.span_s}

    def bubble(self) -> tuple[float, float]:
        """(measured, simulated) bubble fraction of this rank for the last step. Measured: idle share
        between this rank's first and last compute action (waits on receives and on peers' collectives).
        Simulated: the simulator on the same action lists with the step's measured mean costs."""
        from .simulator import Costs, simulate
        d = self.executor.durations
        busy = sum(sum(v) for v in d.values())
        measured = max(0.0, 1 - busy / self.executor.span_s) if self.executor.span_s > 0 else 0.0
        mean = {k: sum(v) / len(v) for k, v in d.items() if v}
        f = mean.get(Kind.F, 0.0)
        bw = mean.get(Kind.BW, mean.get(Kind.B, 0.0) + mean.get(Kind.W, 0.0))
        w = mean.get(Kind.W, bw / 2)
        b = mean.get(Kind.B, bw - w)
        costs = Costs(f=f, b=b, w=w, bw=bw, fb=mean.get(Kind.FB))
        sim = simulate(self.schedule, costs)
        r = self.dims.pp_rank
        total = sim.bubble[r] + sim.busy[r]
        return measured, (sim.bubble[r] / total if total > 0 else 0.0)

    def sum_replica_loads(self, named_loads: dict[str, torch.Tensor]) -> None:
        self.replicas.sum_(named_loads)

    def grad_weight(self, name: str) -> float:
        return self.replicas.weight(name)

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        """Mean LM loss over ``batches``, stage by stage (each stage on its first holder rank)."""
        holder = {}
        for chunk, st in self.stages.items():
            holder[st.stage] = chunk
        owner = {s: self.schedule.rank_of(s) for s in range(self.n_stages)}   # twin stages: the chunk-0 copy
        total = torch.zeros((), dtype=torch.float64, device=self.device)   # NCCL reduces device tensors only
        for i, (ids, labels) in enumerate(batches):
            ids, labels = ids.to(self.device), labels.to(self.device)
            h = None
            for s in range(self.n_stages):
                rank = owner[s]
                if rank == self.dims.pp_rank:
                    if s > 0 and owner[s - 1] != rank:
                        h = torch.empty(ids.shape[0], ids.shape[1], self.cfg.dim, device=self.device,
                                        dtype=self.wire_dtype)
                        self.p2p.recv(h, owner[s - 1], ("eval", i, s - 1))
                    out, parts = self.stages[holder[s]](h, ids, labels)
                    if parts is not None:
                        total += parts[0].detach().double()
                    else:
                        h = out
                        if owner[s + 1] != rank:
                            h = h.to(self.wire_dtype).contiguous()
                            self.p2p.isend(h, owner[s + 1], ("eval", i, s)).wait()
        dist.all_reduce(total, group=self.dims.group("pp"))   # only the last stage's owner added to it
        return float(total) / max(len(batches), 1)
