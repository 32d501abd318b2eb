"""``parallel.zero_backend=deepspeed``: DeepSpeed's ZeRO-1/2 optimizer (``DeepSpeedZeroOptimizer``)
behind the same protocol as ``native.ZeroOptimizer`` (see ``parallel/zero/__init__.py``).

Pinned to ``deepspeed==0.19.8`` (``pip install -e '.[deepspeed]'``): the optimizer is driven without
``deepspeed.initialize``/the engine, through methods that are internal to DeepSpeed
(``enter_backward``/``overlapping_partition_gradients_reduce_epilogue``/``reduce_gradients``/
``finalize_gradient_accumulation_boundary``), so another version may need this file to change.
``import deepspeed`` happens only when this backend is built.

What it does
* A ``torch.optim.AdamW`` (fp32 moments; weight decay for dim >= 2 parameters) wrapped in
  ``DeepSpeedZeroOptimizer``: stage 1 (``partition_grads=False``) shards the fp32 master weights
  and AdamW moments over the data-parallel ranks, stage 2 also the gradients. DeepSpeed flattens
  each parameter group into one buffer; the model's parameters become views of it.
* Routed experts (``parallel.ep > 1``) go into DeepSpeed MoE parameter groups: their gradients are
  reduced over the expert-data-parallel group (``edp = dp / ep``) and divided by ``dp`` — the same
  mean as ``parallel/data_parallel.py`` — and their state is sharded over ``edp``.
* Gradient accumulation: stage 1 accumulates full gradients in ``param.grad`` over the micro-batches
  and reduces once in ``step``; stage 2 reduces every micro-batch's gradients during its backward
  and accumulates only this rank's partition (DeepSpeed's "unmanaged" accumulation).
* ``step(max_norm)``: DeepSpeed computes the global gradient norm over all partitions, clips to
  ``max_norm`` (its ``clip_grad``), runs AdamW on this rank's fp32 partition and all-gathers the
  parameters. Returns the norm before clipping.
* Checkpoints: ``state_dict()`` gathers each parameter's full moments (a collective) under the single-device
  names and global shapes, the other backends' format, so DCP checkpoints move between backends.

Not supported: BF16 weights (``train.precision=bf16|fp8``), BF16 moments (DeepSpeed keeps the wrapped
optimizer's moments in fp32), pipeline parallelism (config validation refuses these three, naming the key);
one process (launch with torchrun and dp >= 2); DeepSpeed's fp16 loss scaling, CPU/NVMe offload and ZeRO-3.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from errors import ConfigError

from ..dims import ParallelDims, validate_layout
from ..ep import is_expert_param
from ..state_dict import to_global, to_local
from . import NonFiniteGradients
from .memory import MemoryReport, account

DEEPSPEED_VERSION = "0.19.8"
_EXPERT_GROUP = "routed_experts"   # DeepSpeed's name for the MoE parameter groups' expert-dp group


def _import_deepspeed():
    """``import deepspeed`` without the JIT build of its shared-memory all-reduce op (g++/ninja, ~40 s
    on a cold machine); collectives then go through torch.distributed (gloo / NCCL)."""
    try:
        import deepspeed
        import deepspeed.comm.torch  # noqa: F401
    except ImportError as e:
        raise ImportError(f"parallel.zero_backend=deepspeed needs deepspeed=={DEEPSPEED_VERSION} "
                          f"(pip install -e '.[deepspeed]'): {e}") from e
    if deepspeed.__version__ != DEEPSPEED_VERSION:
        raise ImportError(f"parallel.zero_backend=deepspeed is pinned to deepspeed=={DEEPSPEED_VERSION} (it drives "
                          f"DeepSpeed's ZeRO optimizer through internal methods); found {deepspeed.__version__}")
    # `import deepspeed.comm.torch as m` would bind deepspeed.comm's `torch` attribute (the torch
    # package), so the module object has to come from sys.modules.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    return deepspeed


class DeepSpeedZero:
    def __init__(self, model: nn.Module, optim_cfg, dims: ParallelDims, stage: int = 1, bucket_mb: float = 32.0,
                 weights: str = "fp32"):
        validate_layout(dims.world_size, dims.pp, dims.ep, dims.ranks_per_node, zero=stage, zero_backend="deepspeed",
                        weights=weights)
        if not dist.is_initialized():
            raise ConfigError("parallel.zero_backend=deepspeed needs torch.distributed (launch with torchrun "
                              "--nproc_per_node >= 2); for one process use parallel.zero_backend=native or "
                              "parallel.zero=0")
        deepspeed = _import_deepspeed()
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
        from deepspeed.utils.timer import NoopTimer

        deepspeed.init_distributed(dist_backend=dist.get_backend())   # wraps the existing process group
        self.model, self.dims, self.stage = model, dims, stage
        self.names = {p: n for n, p in model.named_parameters() if p.requires_grad}
        expert = is_expert_param(model)
        groups = self._param_groups(model, optim_cfg.weight_decay, expert)
        has_experts = any(g.get("moe") for g in groups)
        if has_experts:
            for g in groups:
                if g.get("moe"):
                    for p in g["params"]:   # DeepSpeed's MoE marker (deepspeed.moe.utils.is_moe_param)
                        p.allreduce, p.group_name = False, _EXPERT_GROUP
        inner = torch.optim.AdamW(groups, lr=optim_cfg.lr, betas=(optim_cfg.beta1, optim_cfg.beta2), eps=optim_cfg.eps)
        bucket = max(2, int(bucket_mb * 2**20 / 4)) // 2 * 2   # elements of fp32 gradients (even: DS alignment)
        self.zopt = DeepSpeedZeroOptimizer(
            inner, param_names=dict(self.names), timers=NoopTimer(), optimizer_params={},
            dp_process_group=dims.group("dp"),
            expert_parallel_group={_EXPERT_GROUP: dims.group("ep")} if has_experts else None,
            expert_data_parallel_group={_EXPERT_GROUP: dims.group("edp")} if has_experts else None,
            has_moe_layers=has_experts, partition_grads=stage == 2, reduce_scatter=True, overlap_comm=False,
            contiguous_gradients=True, reduce_bucket_size=bucket, allgather_bucket_size=bucket,
            communication_data_type=torch.float32, gradient_accumulation_dtype=torch.float32,
            clip_grad=optim_cfg.grad_clip, verbose=False)
        self.optimizer = self.zopt.optimizer   # the torch AdamW: its param_groups' "lr" drive the update
        self._init_state()

    @staticmethod
    def _param_groups(model: nn.Module, weight_decay: float, expert: dict[str, bool]) -> list[dict]:
        """Dense decay / no-decay, then (MoE groups, reduced over expert-dp) expert decay / no-decay;
        empty groups are left out (DeepSpeed reads each group's first parameter)."""
        groups = []
        for moe in (False, True):
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and expert[n] == moe]
            for decay in (True, False):
                params = [p for _, p in named if (p.dim() >= 2) == decay]
                if not params:
                    continue
                g = {"params": params, "weight_decay": weight_decay if decay else 0.0}
                if moe:
                    g.update(moe=True, name=_EXPERT_GROUP)
                groups.append(g)
        return groups

    def _init_state(self) -> None:
        """Allocate AdamW's state for every flat fp32 partition now (torch would at the first step), so
        checkpoints can be written and loaded before the first step and ``memory()`` is measured; then
        link DeepSpeed's per-parameter views of it."""
        for group in self.optimizer.param_groups:
            for flat in group["params"]:
                state = self.optimizer.state[flat]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
        self.zopt._lazy_init_hp_params_optimizer_state()

    # ---- gradients ---------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch. Stage 2 reduces gradient buckets during the backward (hooks) and the rest right
        after it, accumulating this rank's partition; stage 1 only accumulates ``param.grad``."""
        z = self.zopt
        z.clear_backward_seen_flag()
        z.set_gradient_accumulation_boundary(False)   # the boundary is step()
        z.enter_backward()
        try:
            z.scale_if_loss(loss).backward()
            z.backward_epilogue()
        finally:
            z.exit_backward()
        if self.stage == 2:
            z.overlapping_partition_gradients_reduce_epilogue()

    @torch.no_grad()
    def step(self, max_norm: float) -> float:
        z = self.zopt
        if self.stage == 2:
            z.finalize_gradient_accumulation_boundary()
        else:
            for group in z.bit16_groups:   # a parameter without a gradient counts as zeros on every rank
                for p in group:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
            z.setup_buckets()   # the reduce bucket (allocated by the first gradient hook of a backward)
            z.set_gradient_accumulation_boundary(True)
            z.reduce_gradients(pipeline_parallel=False)
        z.clip_grad = float(max_norm) if max_norm > 0 else 0.0
        z.step()
        if z.overflow:   # fp32 has no loss scale: a non-finite gradient norm; DeepSpeed skipped the update
            raise NonFiniteGradients("deepspeed ZeRO: the gradient norm is not finite (inf/nan); the update was skipped")
        norm = z._global_grad_norm
        return float(norm)

    def zero_grad(self) -> None:
        self.zopt.zero_grad(set_to_none=True)

    def grads_finite(self) -> torch.Tensor:
        """Always True here: DeepSpeed reduces the gradients inside ``step`` and checks them itself (its
        overflow check agrees over the data-parallel ranks); ``step`` then raises ``NonFiniteGradients``."""
        return torch.ones((), dtype=torch.bool, device=next(self.model.parameters()).device)

    # ---- checkpoints -------------------------------------------------------------------------------
    def _step_count(self) -> float:
        steps = {float(self.optimizer.state[flat]["step"]) for g in self.optimizer.param_groups for flat in g["params"]}
        if len(steps) > 1:
            raise ValueError(f"deepspeed ZeRO: parameter groups hold different step counts {sorted(steps)}")
        return steps.pop()

    def state_dict(self) -> dict:
        """Full moments per parameter (gathered over the ranks that share it; every rank must call this),
        experts as DTensors over the EP mesh like ``Replicated``."""
        from deepspeed.utils import safe_get_full_optimizer_state
        step = self._step_count()
        state = {}
        for p, name in self.names.items():
            state[name] = {"step": torch.tensor(step),
                           "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
                           "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone()}
        _, optim_sd = to_global({}, {"state": state}, self.model, self.dims)
        return {"state": optim_sd["state"]}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """After the model's weights were loaded: moments from ``sd``, fp32 master partitions from the
        weights (the checkpointed fp32 parameters are the master copy)."""
        from deepspeed.utils import safe_set_full_optimizer_state
        state = to_local(sd["state"])
        steps = set()
        for p, name in self.names.items():
            if name not in state:
                raise KeyError(f"optimizer state for {name} missing from the checkpoint")
            for key in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, state[name][key].to(p.device, torch.float32).reshape(p.shape), key)
            steps.add(float(state[name]["step"]))
        if len(steps) > 1:
            raise ValueError(f"optimizer state holds different step counts {sorted(steps)}")
        step = steps.pop() if steps else 0.0
        for g in self.optimizer.param_groups:
            for flat in g["params"]:
                self.optimizer.state[flat]["step"].fill_(step)
        self._refresh_master()

    @torch.no_grad()
    def _refresh_master(self) -> None:
        z = self.zopt
        for i, params in enumerate(z.round_robin_bit16_groups):
            flat = z.bit16_groups_flat[i]
            for p, meta, offset in zip(params, z.round_robin_bit16_meta[i], z.round_robin_bit16_offsets[i]):
                view = flat.narrow(0, offset, meta.numel()).view(meta.shape)
                if p.data.data_ptr() != view.data_ptr():   # weights were re-assigned, not copied in: re-link
                    view.copy_(p.data)
            z._update_model_bit16_weights(i)
            me = dist.get_rank(group=z.real_dp_process_group[i])
            z.single_partition_of_fp32_groups[i].data.copy_(z.parallel_partitioned_bit16_groups[i][me].data)

    # ---- accounting --------------------------------------------------------------------------------
    def master_weights(self) -> None:
        """None: the weights are FP32 and their own master (BF16 weights are refused above). No
        ``named_grads``: this backend runs without a pipeline (config validation)."""
        return None

    def memory(self) -> MemoryReport:
        z = self.zopt
        flat_params = sum(f.numel() * f.element_size() for f in z.bit16_groups_flat)
        shard = sum(int(s) for s in z.partition_size)
        master = sum(f.numel() * f.element_size() for f in z.single_partition_of_fp32_groups)
        optim = sum(t.numel() * t.element_size() for g in self.optimizer.param_groups for flat in g["params"]
                    for k, t in self.optimizer.state[flat].items() if k in ("exp_avg", "exp_avg_sq"))
        n = sum(p.numel() for p in self.names)
        measured = {"params": flat_params, "grads": 4 * (shard if self.stage == 2 else n), "master": master,
                    "optim": optim}
        return account(self.model, self.dims, zero=self.stage, moment_bytes=4, measured=measured)
