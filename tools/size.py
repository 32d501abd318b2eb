"""Model size, FLOPs per token and per-rank memory of a parallel layout, without running it.

    python -m tools.size +exp=v3_small
    python -m tools.size model=v3_671b parallel.pp=16 parallel.schedule=dualpipe parallel.ep=64 \\
        parallel.ranks_per_node=8 parallel.zero=1 data.seq_len=4096 train.micro_batch_size=1 \\
        train.global_batch_size=15360 --world-size 2048 --gpu-mem-gb 80

Arguments are Hydra overrides, as for the trainer, plus these options (anywhere on the line):
  --world-size N      ranks (default pp x ep, the smallest world for the layout)
  --gpu-mem-gb G      memory per GPU for the verdict (default 80)
  --headroom F        fraction of it kept free for the CUDA context, NCCL buffers and fragmentation (0.1)
  --recipe v3|trainer precision of the model state (default v3, see below)
  --recompute none|selective|full  activation recomputation (default: the config's train.recompute, none)

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
Activations: ``tools/activations.py`` (saved bytes per token and layer, by ``train.recompute`` mode).
A stage's activations per micro-batch are micro_batch_size x seq_len tokens times the sum over its
layers (+ the head and MTP on the last stage). The peak per rank walks the schedule's action list
through ``parallel.pipeline.simulator.peak_live`` (an activation lives from its F to the end of its backward),
weighting each live activation by its stage's size; without a pipeline one micro-batch is live.
With ``--recipe trainer train.precision=fp8`` the FP8 layers' inputs are counted as their FP8 copies.
Not modelled: temporary buffers (all-to-all, logits before the loss), the FP8 weight copies and expert tile
padding (``tools/activations.py``), autocast's weight copies and the gate's fp32 input copy under bf16,
fragmentation; the headroom stands for them.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field


import models
from configs.schema import Config, compose
from errors import ConfigError
from models.config import ModelError
from models.moe import GroupedExperts
from models.params import count_params, flops_per_token
from parallel.dims import ParallelDims, validate_layout
from parallel.pipeline.schedules import Schedule, get_schedule
from parallel.pipeline.simulator import Costs, peak_live, simulate
from parallel.recompute import MODES as RECOMPUTE
from parallel.zero import MOMENT_DTYPES, WEIGHT_DTYPES, moment_dtype, weights_for
from parallel.zero.memory import formula
from tools.activations import (FLOOR, V3_RECIPE, activation_bytes_per_token, stage_activations,  # noqa: F401
                               stage_wgrad_held)

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
        weight = WEIGHT_DTYPES[weights_for(cfg.train.precision)].itemsize
    if moment is None:
        p = cfg.parallel
        moment = MOMENT_DTYPES[moment_dtype(cfg.optim.moment_dtype, p.zero, p.zero_backend)].itemsize
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
                model=None, dims: ParallelDims | None = None, math_attention: bool = False) -> Plan:
    """Per-pipeline-rank memory of ``cfg``'s layout on ``world_size`` ranks (default pp x ep); ``dims``: a
    layout already validated (the trainer's own) in place of ``world_size``; ``recompute``: a
    ``train.recompute`` mode (default: ``cfg``'s); ``math_attention``: size the attention core of PyTorch's
    math SDPA (the CPU path) instead of a flash kernel's."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    recompute = t.recompute if recompute is None else recompute
    if recompute not in (*RECOMPUTE, FLOOR, V3_RECIPE):
        raise ConfigError(f"--recompute: {recompute!r} is not one of {', '.join(RECOMPUTE)}")
    dims = dims or check_layout(cfg, world_size or p.pp * p.ep)
    w_b, m_b = recipe_bytes(cfg, recipe)
    parts = model_parts(model if model is not None else models.build(m, "meta"))
    a = 2 if recipe == "v3" or t.precision != "fp32" else 4
    fp8 = recipe == "trainer" and t.precision == "fp8"   # FP8 layers cache their inputs in FP8
    notes = []
    n_micro, schedule, sim = _pipeline(p, max(1, t.global_batch_size // (t.micro_batch_size * dims.dp)), notes)
    split = split_layers(m.n_layers, n_stages(p.schedule, p.pp), p.pp_layout)
    tokens = t.micro_batch_size * cfg.data.seq_len
    deferred = schedule is not None and schedule.splits_backward   # the runner's wgrad_queue rule
    expert_dw = 3 * m.n_routed_experts // p.ep * m.moe_inter_dim * m.dim * a   # dW1, dW2, dW3 of the local experts
    acts = stage_activations(m, split, a, tokens, recompute, cfg.data.seq_len, math_attention, deferred, expert_dw,
                             fp8)
    # held from B to W where the schedule splits them; tools.plan's models of V3's recipe leave it out
    wgrad = stage_wgrad_held(m, split, a, tokens) if recompute not in (FLOOR, V3_RECIPE) else [0.0] * len(split)
    ranks = []
    for r in range(p.pp):
        held = stages_of_rank(schedule, r)
        dense, expert, rnotes = rank_params(parts, split, held, m.mtp_depth)
        expert //= p.ep
        state = formula(dense, expert, dims.dp, dims.edp, p.zero, m_b, w_b, p.pp)
        saved, working = {s: acts[s][0] for s in held}, max(acts[s][1] for s in held)
        peak = saved[0] if sim is None else peak_live(sim.spans[r], saved.__getitem__, wgrad.__getitem__)
        ranks.append(RankMemory(
            pp_rank=r, stages=held, layers=[i for s in held for i in split[s]], params_dense=dense,
            params_expert=expert, weights=state["params"], grads=state["grads"], optim=state["master"] + state["optim"],
            act_microbatch=max(saved.values()) + working, act_peak=peak + working, act_recompute=working,
            notes=rnotes))
    return Plan(dims.world_size, p.pp, dims.dp, p.ep, dims.edp, p.schedule, p.zero, recipe, recompute, a, tokens,
                n_micro, ranks, notes, sim.max_bubble / sim.makespan if sim else None)


# ---- CLI ---------------------------------------------------------------------------------------------
def _ranges(ids: list[int]) -> str:
    out, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ",".join(out) or "-"


def report(cfg: Config, plan: Plan, flops, gpu_mem_gb: float, headroom: float) -> list[str]:
    m = cfg.model
    weight, moment = recipe_bytes(cfg, plan.recipe)
    per = formula(1, 0, 1, 1, plan.zero, moment, weight)   # bytes per parameter, unsharded
    w_b, g_b, o_b = per["params"], per["grads"], per["master"] + per["optim"]
    chunks = len(get_schedule(plan.schedule, plan.pp).stages_of(0)) if plan.pp > 1 else 1
    per_stage = f"{chunks} stage{'s' if chunks > 1 else ''}/rank"
    fp8_caches = " (FP8 caches)" if plan.recipe == "trainer" and cfg.train.precision == "fp8" else ""
    zero = {0: "no ZeRO", 1: "ZeRO-1 (optimizer / dp, experts' / edp)", 2: "ZeRO-2 (optimizer and grads / dp, "
            "experts' / edp)"}[plan.zero]
    lines = [
        f"FLOPs per token (train, fwd+bwd, seq {cfg.data.seq_len}): 6 x {flops.matmul_params / 1e9:.3f} B matmul params"
        f" + attention {flops.attention / 1e9:.2f} G = {flops.per_token / 1e9:.2f} GFLOP"
        f"   [6*N + 3*(L+D)*H*(d_qk+d_v)*T, N without embedding, MTP included]",
        f"layout: world {plan.world_size} = pp {plan.pp} x dp {plan.dp} (ep {plan.ep} x edp {plan.edp}), "
        f"{cfg.parallel.ranks_per_node} ranks/node; schedule {plan.schedule}"
        + (f" ({per_stage})" if plan.pp > 1 else "") + f"; {zero}",
        f"recipe {plan.recipe}: weights {w_b} B, grads {g_b} B, optimizer {o_b} B per parameter; activations "
        f"{'bf16' if plan.act_bytes == 2 else 'fp32'}{fp8_caches}, recompute {plan.recompute}; micro-batch "
        f"{cfg.train.micro_batch_size} x {cfg.data.seq_len} = {plan.tokens_per_microbatch} tokens, "
        f"{plan.n_microbatches} micro-batches per step",
    ]
    if plan.bubble_fraction is not None:
        lines.append(f"simulated bubble ({plan.schedule}, unit costs): {100 * plan.bubble_fraction:.1f}% of the step")
    lines += [f"note: {n}" for n in plan.notes]
    lines.append(f"{'pp rank':>7}  {'stages':<8} {'layers':<12} {'params':>9}   "
                 f"{'weights':>8} {'grads':>8} {'optim':>8} {'act/mb':>8} {'act peak':>8} {'total':>8}  (GB)")
    for r in plan.ranks:
        lines.append(f"{r.pp_rank:>7}  {_ranges(r.stages):<8} {_ranges(r.layers):<12} {r.params / 1e9:>8.3f}B   "
                     f"{r.weights / GB:>8.2f} {r.grads / GB:>8.2f} {r.optim / GB:>8.2f} {r.act_microbatch / GB:>8.2f} "
                     f"{r.act_peak / GB:>8.2f} {r.total / GB:>8.2f}" + "".join(f"  ({n})" for n in r.notes))
    worst = plan.worst
    usable = gpu_mem_gb * (1 - headroom)
    verdict = "fits" if worst.total / GB <= usable else "does NOT fit"
    lines.append(f"worst rank: pp rank {worst.pp_rank} needs {worst.total / GB:.2f} GB of {gpu_mem_gb:g} GB "
                 f"({usable:.1f} GB usable with {100 * headroom:.0f}% headroom): {verdict}")
    return lines


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(prog="python -m tools.size", description="Model size, FLOPs per token and "
                                 "per-rank memory of a layout. Other arguments are Hydra overrides.")
    ap.add_argument("--world-size", type=int, default=None, help="ranks (default: pp x ep)")
    ap.add_argument("--gpu-mem-gb", type=float, default=80.0, help="GPU memory for the verdict (default 80)")
    ap.add_argument("--headroom", type=float, default=0.1, help="fraction of GPU memory kept free (default 0.1)")
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="v3", help="model-state precision (default v3)")
    ap.add_argument("--recompute", choices=RECOMPUTE, default=None,
                    help="activation recomputation (default: train.recompute, itself none by default)")
    return ap.parse_known_args(argv)


def main(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    unknown = [o for o in overrides if o.startswith("--")]
    if unknown:
        print(f"error: unknown option {unknown[0]} (options: --world-size, --gpu-mem-gb, --headroom, --recipe, "
              f"--recompute; everything else is a Hydra override)", file=sys.stderr)
        return 2
    try:
        cfg = compose(overrides)
        dims = check_layout(cfg, args.world_size or cfg.parallel.pp * cfg.parallel.ep)   # fail fast, before the build
        model = models.build(cfg.model, "meta")
        plan = plan_memory(cfg, recipe=args.recipe, recompute=args.recompute, model=model, dims=dims)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    c = count_params(model)
    rows = [
        ("total (no MTP)", c.total),
        ("activated per token (no MTP)", c.activated),
        ("activated, without embedding", c.activated - c.embedding),
        ("MTP modules (unique)", c.mtp),
        ("total with MTP", c.total_with_mtp),
        ("embedding", c.embedding),
        ("output head", c.head),
        ("routed experts", c.routed_experts),
    ]
    m = cfg.model
    print(f"model: dim={m.dim} layers={m.n_layers} (dense {m.first_k_dense}) experts={m.n_routed_experts} "
          f"top-{m.n_activated_experts} groups={m.n_expert_groups} M={m.n_limited_groups} mtp_depth={m.mtp_depth}")
    for name, n in rows:
        print(f"  {name:<32} {n:>16,d}  ({n / 1e9:.3f} B)")
    for line in report(cfg, plan, flops_per_token(cfg.model, cfg.data.seq_len, model), args.gpu_mem_gb, args.headroom):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
