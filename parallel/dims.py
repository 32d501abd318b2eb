"""``ParallelDims``: the one object that knows the layout. Built from the world size and the config,
validated (``validate_layout``, also the config's and tools' layout checks) before any collective is
issued, and passed explicitly (no module-level process groups).

Rank layout (world = pp × dp, dp = edp × ep; ep lives inside the data-parallel ranks, as in DeepSeek-V3)::

    rank = pp_index * dp + edp_index * ep + ep_index

so an EP group is ``ep`` consecutive ranks, and nodes (``ranks_per_node`` consecutive ranks) hold whole
EP sub-groups. Within the EP group, *EP nodes* are the ``ep / ranks_per_node`` nodes it spans (1 if
the group fits in a node). Routing groups (``model.n_expert_groups``, G) are the model's, the nodes the
cluster's: experts are laid out in order, so when the EP node count divides G a node holds G / nodes whole
groups, and when G divides it a group spans nodes / G whole nodes. Either is accepted (``routing_reach``
turns "at most M groups" into a bound on the nodes a token's copies reach); other pairs are refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from errors import ConfigError
from models.config import ModelConfig


def validate_layout(world_size: int, pp: int = 1, ep: int = 1, ranks_per_node: int = 1, *,
                    model: ModelConfig | None = None, zero: int | None = None, zero_backend: str | None = None,
                    moment_dtype: str | None = None, schedule: str | None = None, weights: str = "fp32") -> None:
    """The layout checks, in one place for config validation, ``ParallelDims``, ``tools.size`` and the
    DeepSpeed backend: the sizes against the world size, then what is given: the model against EP, the
    ZeRO stage (and what ``zero_backend``, ``moment_dtype`` and the weights' dtype ``weights``,
    ``Precision.weights``, allow), the schedule's name and pp.
    Raises a one-line ``ConfigError`` naming the key."""
    if pp < 1 or ep < 1 or ranks_per_node < 1:
        raise ConfigError(f"parallel.pp ({pp}), parallel.ep ({ep}) and parallel.ranks_per_node ({ranks_per_node}) "
                          "must be >= 1")
    if world_size % pp:
        raise ConfigError(f"parallel.pp ({pp}) must divide the world size ({world_size})")
    dp = world_size // pp
    if dp % ep:
        raise ConfigError(f"parallel.ep ({ep}) must divide the data-parallel size dp "
                          f"({dp} = world {world_size} / pp {pp})")
    if ep > 1 and ep % ranks_per_node and ranks_per_node % ep:
        raise ConfigError(f"parallel.ep ({ep}) and parallel.ranks_per_node ({ranks_per_node}): one must divide the "
                          f"other so that EP groups hold whole nodes or fit inside one")
    if model is not None:
        _check_model(model, ep, ranks_per_node)
    if zero is not None:
        _check_zero(zero, zero_backend, moment_dtype, world_size, pp, weights)
    if schedule is not None:
        _check_schedule(schedule, pp)


def ep_split(ep: int, ranks_per_node: int) -> tuple[int, int]:
    """(EP ranks per node, EP nodes) of an EP group: it fits inside one node or spans whole nodes."""
    per_node = min(ep, ranks_per_node)
    return per_node, ep // per_node


def _check_model(m: ModelConfig, ep: int, ranks_per_node: int) -> None:
    if ep == 1:
        return
    per_node, nodes = ep_split(ep, ranks_per_node)
    if m.n_routed_experts % ep:
        raise ConfigError(f"model.n_routed_experts ({m.n_routed_experts}) must be divisible by parallel.ep ({ep})")
    G = m.n_expert_groups
    if not groups_fit_nodes(G, nodes):
        raise ConfigError(
            f"model.n_expert_groups ({G}) and the EP group's nodes ({nodes} = parallel.ep {ep} / "
            f"parallel.ranks_per_node {per_node}): one must divide the other, so that a node holds whole routing "
            "groups or a group spans whole nodes; choose parallel.ep (or ranks_per_node) to match")


def groups_fit_nodes(groups: int, nodes: int) -> bool:
    """Whether ``groups`` routing groups lie on ``nodes`` EP nodes: a node holds whole groups, or a group spans
    whole nodes (one divides the other)."""
    return groups % nodes == 0 or nodes % groups == 0


def routing_reach(m: ModelConfig, ep: int, ranks_per_node: int) -> tuple[int, int]:
    """(groups, EP nodes) a token's expert copies reach at most: node-limited routing keeps them in
    ``n_limited_groups`` groups (all G when M = G) and K experts; a group spans ``max(1, nodes / G)`` nodes.
    The layout must have passed ``validate_layout``."""
    nodes = ep_split(ep, ranks_per_node)[1] if ep > 1 else 1
    K, G = m.n_activated_experts, m.n_expert_groups
    groups = min(m.n_limited_groups, K)
    return groups, min(nodes, K, groups * max(1, nodes // G))


def _check_schedule(schedule: str, pp: int) -> None:
    from .pipeline.schedules import NO_PIPELINE, SCHEDULES
    if schedule != NO_PIPELINE and schedule not in SCHEDULES:
        raise ConfigError(f"parallel.schedule: {schedule!r} is not one of {', '.join((NO_PIPELINE, *SCHEDULES))}")
    if (pp > 1) != (schedule != NO_PIPELINE):
        raise ConfigError(f"parallel.schedule ({schedule}) with parallel.pp ({pp}): pp > 1 needs a schedule "
                          f"({', '.join(SCHEDULES)}) and pp = 1 needs schedule={NO_PIPELINE}")


def _check_zero(zero: int, backend: str | None, moment_dtype: str | None, world_size: int, pp: int,
                weights: str = "fp32") -> None:
    """The ZeRO stage, and what its backend, the AdamW moment dtype and the weights' dtype allow."""
    if zero not in (0, 1, 2):
        raise ConfigError(f"parallel.zero: must be 0, 1 or 2, got {zero}")
    if backend != "deepspeed":
        return
    if zero == 0:
        raise ConfigError("parallel.zero_backend=deepspeed needs parallel.zero = 1 or 2")
    if world_size < 2:
        raise ConfigError("parallel.zero_backend=deepspeed needs >= 2 data-parallel processes (launch with torchrun "
                          "--nproc_per_node >= 2); in one process use parallel.zero=0 or zero_backend=native")
    if pp > 1:
        raise ConfigError(f"parallel.zero_backend=deepspeed with parallel.pp ({pp}): DeepSpeed's ZeRO "
                          "optimizer does not compose with our pipeline executor; use zero_backend=native")
    if moment_dtype == "bf16":
        raise ConfigError("optim.moment_dtype=bf16 with parallel.zero_backend=deepspeed: DeepSpeed's ZeRO-1/2 "
                          "keeps the wrapped AdamW's moments in fp32; use fp32 (or auto) or zero_backend=native")
    if weights != "fp32":
        raise ConfigError(f"train.precision: {weights} weights (train.precision=bf16|fp8) are not supported with "
                          "parallel.zero_backend=deepspeed; use parallel.zero_backend=native (BF16 weights, FP32 "
                          "master) or train.precision=fp32")


@dataclass
class ParallelDims:
    world_size: int
    rank: int = 0
    pp: int = 1
    ep: int = 1
    ranks_per_node: int = 1
    timeout_s: float | None = None   # every group's collective timeout (None: the world group's default)
    groups: dict[str, Any] = field(default_factory=dict, repr=False)   # filled by build_groups()

    def __post_init__(self):
        validate_layout(self.world_size, self.pp, self.ep, self.ranks_per_node)

    # ---- sizes and coordinates --------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.world_size // self.pp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: replicas of each expert shard."""
        return self.dp // self.ep

    @property
    def ep_ranks_per_node(self) -> int:
        return ep_split(self.ep, self.ranks_per_node)[0]

    @property
    def ep_nodes(self) -> int:
        return ep_split(self.ep, self.ranks_per_node)[1]

    @property
    def pp_rank(self) -> int:
        return self.rank // self.dp

    @property
    def dp_rank(self) -> int:
        return self.rank % self.dp

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def check_model(self, m: ModelConfig) -> None:
        """Layout-dependent model checks (one-line ConfigError naming the keys)."""
        _check_model(m, self.ep, self.ranks_per_node)

    def routing_reach(self, m: ModelConfig) -> tuple[int, int]:
        """(groups, EP nodes) one token's expert copies reach at most (``routing_reach``)."""
        return routing_reach(m, self.ep, self.ranks_per_node)

    # ---- process groups -----------------------------------------------------------------------------
    def build_groups(self, device_type: str = "cpu") -> "ParallelDims":
        """Create every process group once (all ranks call ``new_group`` in the same order)."""
        w, dp, ep, rpn = self.world_size, self.dp, self.ep, self.ep_ranks_per_node
        layouts = {
            "pp": [list(range(i, w, dp)) for i in range(dp)],
            "dp": [list(range(p * dp, (p + 1) * dp)) for p in range(self.pp)],
            "ep": [list(range(b, b + ep)) for b in range(0, w, ep)],
            "edp": [list(range(p * dp + e, (p + 1) * dp, ep)) for p in range(self.pp) for e in range(ep)],
            # Hierarchical all-to-all: the same local index across the EP group's nodes, and one node's ranks.
            "ep_inter": [list(range(b + l, b + ep, rpn)) for b in range(0, w, ep) for l in range(rpn)],
            "ep_intra": [list(range(b + n * rpn, b + (n + 1) * rpn)) for b in range(0, w, ep) for n in range(ep // rpn)],
        }
        for name, rank_lists in layouts.items():
            for ranks in rank_lists:
                g = self.new_group(ranks, name)
                if self.rank in ranks:
                    self.groups[name] = g
                    self.groups[name + "_ranks"] = ranks
        self._build_pipeline_channels()
        # The (pp, edp, ep) mesh for DTensor checkpoints, over the groups above (so it has their timeout).
        import torch
        from torch.distributed.device_mesh import DeviceMesh
        self.groups["mesh"] = DeviceMesh.from_group(
            [self.groups["pp"], self.groups["edp"], self.groups["ep"]], device_type,
            mesh=torch.arange(w).view(self.pp, self.edp, self.ep), mesh_dim_names=("pp", "edp", "ep"))
        return self

    def new_group(self, ranks: list[int], desc: str):
        """``dist.new_group`` with ``timeout_s``: torch gives subgroups its own default (10 min on gloo, 30
        on NCCL), not the world group's, so a hung peer would otherwise block a subgroup for that long.
        ``desc`` names the group in NCCL's errors and flight-recorder dumps. Every rank must call it for
        every group, in the same order."""
        import torch.distributed as dist
        from datetime import timedelta
        timeout = timedelta(seconds=self.timeout_s) if self.timeout_s else None
        return dist.new_group(ranks, timeout=timeout, group_desc=desc)

    def _build_pipeline_channels(self) -> None:
        """One two-rank group per direction between adjacent pipeline ranks of every pipeline
        (``parallel/pipeline/p2p.py`` says why): ``pp_send`` / ``pp_recv`` map the peer's pipeline rank
        to (group, the peer's global rank)."""
        self.groups["pp_send"], self.groups["pp_recv"] = {}, {}
        for d in range(self.dp):
            ranks = [p * self.dp + d for p in range(self.pp)]
            for p in range(self.pp - 1):
                a, b = ranks[p], ranks[p + 1]
                down, up = self.new_group([a, b], f"pp {p}->{p + 1}"), self.new_group([a, b], f"pp {p + 1}->{p}")
                if self.rank == a:
                    self.groups["pp_send"][p + 1], self.groups["pp_recv"][p + 1] = (down, b), (up, b)
                elif self.rank == b:
                    self.groups["pp_send"][p], self.groups["pp_recv"][p] = (up, a), (down, a)

    def expert_mesh(self):
        """2-D (edp, ep) device mesh of this rank's pipeline stage: expert shards are Shard(0) over ep."""
        return self.group("mesh")["edp", "ep"]

    def group(self, name: str):
        if name not in self.groups:
            raise RuntimeError(f"process group {name!r} not built; call ParallelDims.build_groups() after init_process_group")
        return self.groups[name]
