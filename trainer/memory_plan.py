"""Per-rank memory of a parallel layout, without running it: ``plan_memory`` (the trainer's pre-flight, and
``python -m tools.size`` / ``tools.plan``, which print it).

The config is composed like the trainer's, but only the model and the layout are validated
(``parallel.dims.validate_layout``: the sizes, the model against EP, the schedule, ``parallel.zero`` in
0/1/2), not whether the trainer implements the layout yet, so planned layouts can be sized.

Memory per rank (bytes): the optimizer's own formula (``parallel/zero/memory.py``) over P_d = dense
parameters of the stages on the rank (replicated over dp) and P_e = their routed-expert parameters / ep
(each expert-parallel rank holds E/ep experts per layer):
  recipe v3 (DeepSeek-V3): BF16 compute weights 2 (P_d + P_e); FP32 gradients 4 (P_d + P_e);
      optimizer: FP32 master weights + BF16 AdamW moments = 4 + 2 + 2 = 8 (P_d + P_e)
  recipe trainer (this trainer): train.precision=fp32: FP32 weights 4, FP32 gradients 4; optimizer: AdamW
      moments in ``optim.moment_dtype`` (without ZeRO fp32, 8, the weights being the master copy; under
      ZeRO an FP32 master shard too: 4 + 2 + 2 with the default BF16 moments); bf16 / fp8: BF16 weights 2
      and an FP32 master always (without ZeRO 4 + 8 for the master and moments), as v3
  ZeRO-1 divides the optimizer state: P_d's by dp, P_e's by edp = dp/ep (the replicas of an expert
  shard); ZeRO-2 divides the gradients the same way.
Pipeline stages: layers split by ``parallel.pipeline.stages.layer_split`` (``parallel.pp_layout`` or
even, extra layers to the middle stages); stage 0 holds the embedding, the last stage the final norm,
the head and the MTP modules (plus a tied copy of the embedding for MTP when stage 0 lives on another
rank: 1F1B, ZB1P). 1F1B/ZB1P: rank r holds stage r. DualPipe: stages r and pp-1-r (every stage twice,
so 2x parameters; rank 0 holds both ends). DualPipeV: 2*pp stages, r and 2*pp-1-r.
Activations: ``trainer/activations.py`` (saved bytes per token and layer, by ``train.recompute`` mode).
A stage's activations per micro-batch are micro_batch_size x seq_len tokens times the sum over its
layers (+ the head and MTP on the last stage). The peak per rank walks the schedule's action list
through ``parallel.pipeline.simulator.peak_live`` (an activation lives from its F to the end of its backward),
weighting each live activation by its stage's size; without a pipeline one micro-batch is live.
With ``--recipe trainer train.precision=fp8`` the FP8 layers' inputs are counted as their FP8 copies.
Not modelled: temporary buffers (all-to-all, logits before the loss), the FP8 weight copies and expert tile
padding (``trainer/activations.py``), autocast's weight copies and the gate's fp32 input copy under bf16,
fragmentation; the headroom stands for them. The heads: ``train.head_loss=fused`` on a CUDA device keeps the
logits in their dtype and a log-sum-exp per token (``trainer.activations.HEAD_KEEPS``); off CUDA it runs
``F.cross_entropy`` as ``plain`` does, and both keep FP32 log-probabilities; ``chunked`` is counted as plain (an upper
bound). The plan is for ``device`` (``plan_memory``: CUDA unless told); ``--recipe v3`` counts the heads as plain.
"""
from __future__ import annotations

from dataclasses import dataclass, field


import models
from configs.schema import Config
from data import micro_batches
from errors import ConfigError
from models.config import ModelError
from models.moe import GroupedExperts
from parallel.dims import ParallelDims, validate_layout
from parallel.pipeline.schedules import Schedule, get_schedule
from parallel.pipeline.simulator import Costs, peak_live, simulate
from parallel.recompute import MODES as RECOMPUTE
from parallel.precision import Precision
from parallel.zero import MOMENT_DTYPES, moment_dtype
from parallel.zero.memory import formula
from .activations import FLOOR, V3_RECIPE, stage_activations, stage_wgrad_held

GB = 1e9
RECIPES = {  # bytes per (weight, AdamW moment); None: the trainer's weight / moment dtype (recipe_bytes)
    "v3": (2, 2),
    "trainer": (None, None),
}


# ---- parameters per stage ------------------------------------------------------------------------
@dataclass
class Parts:
    """Parameter counts of the model's pieces, from a meta-device build."""
    layer_dense: list[int]    # per layer: everything but the routed experts
    layer_expert: list[int]   # per layer: routed experts (all E)
    embed: int
    head: int                 # output head + final norm
    mtp_dense: int
    mtp_expert: int


def model_parts(model) -> Parts:
    def split(module) -> tuple[int, int]:
        expert = sum(p.numel() for m in module.modules() if isinstance(m, GroupedExperts) for p in m.parameters())
        return sum(p.numel() for p in module.parameters()) - expert, expert

    layers = [split(layer) for layer in model.layers]
    mtp = split(model.mtp)
    return Parts([d for d, _ in layers], [e for _, e in layers], model.embed.weight.numel(),
                 model.head.weight.numel() + model.norm.weight.numel(), *mtp)


def stages_of_rank(schedule: Schedule | None, pp_rank: int) -> list[int]:
    """Stages on pipeline rank ``pp_rank`` of ``schedule`` (None: no pipeline, the one stage)."""
    return [0] if schedule is None else sorted(set(schedule.stages_of(pp_rank).values()))


def n_stages(schedule: str, pp: int) -> int:
    return 1 if pp == 1 else get_schedule(schedule, pp).n_stages


def split_layers(n_layers: int, stages: int, layout: list[int] | None) -> list[range]:
    if stages == 1:
        return [range(n_layers)]
    from parallel.pipeline.stages import layer_split
    return layer_split(n_layers, stages, layout)


# ---- the plan --------------------------------------------------------------------------------------
@dataclass
class RankMemory:
    pp_rank: int
    stages: list[int]
    layers: list[int]
    params_dense: int          # replicated over dp
    params_expert: int         # this rank's routed experts (already / ep)
    weights: float             # bytes
    grads: float
    optim: float
    act_microbatch: float      # the largest held stage, one micro-batch (+ act_recompute)
    act_peak: float            # in flight at the schedule's peak (+ act_recompute)
    act_recompute: float       # recomputed tensors held at once in backward (train.recompute)
    notes: list[str] = field(default_factory=list)

    @property
    def params(self) -> int:
        return self.params_dense + self.params_expert

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optim + self.act_peak


@dataclass
class Plan:
    world_size: int
    pp: int
    dp: int
    ep: int
    edp: int
    schedule: str
    zero: int
    recipe: str
    recompute: str
    act_bytes: int
    tokens_per_microbatch: int
    n_microbatches: int
    ranks: list[RankMemory]
    notes: list[str] = field(default_factory=list)
    bubble_fraction: float | None = None

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)


def check_layout(cfg: Config, world_size: int) -> ParallelDims:
    """Validate the model and the layout only (not whether the trainer implements it yet); the layout's
    sizes, without process groups."""
    try:
        cfg.model.validate("model")
    except ModelError as e:
        raise ConfigError(str(e)) from None
    p = cfg.parallel
    validate_layout(world_size, p.pp, p.ep, p.ranks_per_node, model=cfg.model, zero=p.zero, schedule=p.schedule)
    return ParallelDims(world_size=world_size, pp=p.pp, ep=p.ep, ranks_per_node=p.ranks_per_node)


def recipe_bytes(cfg: Config, recipe: str) -> tuple[int, int]:
    """(bytes per weight, per AdamW moment) under ``recipe``: v3 is DeepSeek-V3's BF16 weights and moments,
    trainer this trainer's weights (FP32 with train.precision=fp32, else BF16 beside an FP32 master) and the
    moment dtype ``optim.moment_dtype`` resolves to."""
    if recipe not in RECIPES:
        raise ConfigError(f"--recipe: {recipe!r} is not one of {', '.join(RECIPES)}")
    weight, moment = RECIPES[recipe]
    if weight is None:
        weight = Precision(cfg.train.precision).weight_dtype.itemsize
    if moment is None:
        p = cfg.parallel
        moment = MOMENT_DTYPES[moment_dtype(cfg.optim.moment_dtype, p.zero, p.zero_backend,
                                            Precision(cfg.train.precision).weights)].itemsize
    return weight, moment


def _pipeline(p, n_micro: int, notes: list[str]):
    """(micro-batches, the schedule, its simulation at unit costs), or (n_micro, None, None) without a pipeline."""
    sim = schedule = None
    if p.pp > 1:
        try:
            schedule = get_schedule(p.schedule, p.pp, n_micro)
        except ValueError as e:
            schedule = get_schedule(p.schedule, p.pp)   # the fewest micro-batches it accepts
            n_micro = schedule.n_microbatches
            notes.append(f"{e}; sized with {n_micro} micro-batches (set train.global_batch_size for the real count)")
        sim = simulate(schedule, Costs(f=1.0, b=1.0, w=1.0))
    return n_micro, schedule, sim


def rank_params(parts: Parts, split: list[range], held: list[int], mtp_depth: int) -> tuple[int, int, list[str]]:
    """(dense, routed-expert parameters of all E experts, notes) of the stages ``held`` by one rank."""
    layers = [i for s in held for i in split[s]]
    dense = sum(parts.layer_dense[i] for i in layers)
    expert = sum(parts.layer_expert[i] for i in layers)
    notes = []
    if 0 in held:
        dense += parts.embed
    if len(split) - 1 in held:
        dense += parts.head + parts.mtp_dense
        expert += parts.mtp_expert
        if mtp_depth and 0 not in held:
            dense += parts.embed
            notes.append("tied embedding copy for MTP")
    return dense, expert, notes


def plan_memory(cfg: Config, world_size: int | None = None, recipe: str = "v3", recompute: str | None = None,
                model=None, dims: ParallelDims | None = None, math_attention: bool = False,
                device: str = "cuda") -> Plan:
    """Per-pipeline-rank memory of ``cfg``'s layout on ``world_size`` ranks (default pp x ep); ``dims``: a
    layout already validated (the trainer's own) in place of ``world_size``; ``recompute``: a
    ``train.recompute`` mode (default: ``cfg``'s); ``math_attention``: size the attention core of PyTorch's
    math SDPA (the CPU path) instead of a flash kernel's; ``device``: the device type the run uses (the heads'
    loss: module doc)."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    recompute = t.recompute if recompute is None else recompute
    if recompute not in (*RECOMPUTE, FLOOR, V3_RECIPE):
        raise ConfigError(f"--recompute: {recompute!r} is not one of {', '.join(RECOMPUTE)}")
    dims = dims or check_layout(cfg, world_size or p.pp * p.ep)
    w_b, m_b = recipe_bytes(cfg, recipe)
    parts = model_parts(model if model is not None else models.build(m, "meta"))
    a = 2 if recipe == "v3" else Precision(t.precision).activation_bytes
    fp8 = recipe == "trainer" and Precision(t.precision).fp8   # FP8 layers cache their inputs in FP8
    notes = []
    n_micro, schedule, sim = _pipeline(p, max(1, micro_batches(t.global_batch_size, t.micro_batch_size, dims.dp)), notes)
    split = split_layers(m.n_layers, n_stages(p.schedule, p.pp), p.pp_layout)
    tokens = t.micro_batch_size * cfg.data.seq_len
    deferred = schedule is not None and schedule.splits_backward   # the runner's wgrad_queue rule
    expert_dw = 3 * m.n_routed_experts // p.ep * m.moe_inter_dim * m.dim * a   # dW1, dW2, dW3 of the local experts
    kept = recipe == "trainer" and t.head_loss in ("fused", "inplace") and device == "cuda"   # the Triton heads' keeps
    head_loss = t.head_loss if kept else "plain"
    acts = stage_activations(m, split, a, tokens, recompute, cfg.data.seq_len, math_attention, deferred, expert_dw,
                             fp8, head_loss)
    # held from B to W where the schedule splits them; tools.plan's models of V3's recipe leave it out
    wgrad = stage_wgrad_held(m, split, a, tokens) if recompute not in (FLOOR, V3_RECIPE) else [0.0] * len(split)
    ranks = []
    for r in range(p.pp):
        held = stages_of_rank(schedule, r)
        dense, expert, rnotes = rank_params(parts, split, held, m.mtp_depth)
        expert //= p.ep
        state = formula(dense, expert, dims.dp, dims.edp, p.zero, m_b, w_b, p.pp,
                        2 if cfg.optim.master == "split" else 4)
        saved, working = {s: acts[s][0] for s in held}, max(acts[s][1] for s in held)
        peak = saved[0] if sim is None else peak_live(sim.spans[r], saved.__getitem__, wgrad.__getitem__)
        ranks.append(RankMemory(
            pp_rank=r, stages=held, layers=[i for s in held for i in split[s]], params_dense=dense,
            params_expert=expert, weights=state["params"], grads=state["grads"], optim=state["master"] + state["optim"],
            act_microbatch=max(saved.values()) + working, act_peak=peak + working, act_recompute=working,
            notes=rnotes))
    return Plan(dims.world_size, p.pp, dims.dp, p.ep, dims.edp, p.schedule, p.zero, recipe, recompute, a, tokens,
                n_micro, ranks, notes, sim.max_bubble / sim.makespan if sim else None)
