"""Cluster planner: predicted step time, bubble, exposed communication, MFU, tokens/s/GPU and memory of a
layout, without running it (docs/planner.md).

    python -m tools.plan model=v3_671b parallel.pp=16 parallel.schedule=dualpipe parallel.ep=64 \\
        parallel.ranks_per_node=8 parallel.zero=1 data.seq_len=4096 train.micro_batch_size=1 \\
        train.global_batch_size=15360 --world-size 2048 --hardware h800 [--out timeline.png]
    python -m tools.plan --v3-check                      # the layout above vs DeepSeek's published step
    python -m tools.plan model=v3_671b data.seq_len=4096 train.global_batch_size=15360 \\
        --world-size 2048 --hardware h800 --search      # rank layouts by tokens/s/GPU

Arguments are Hydra overrides (as for ``tools.size``) plus the options below. Pipeline: the layout's
schedule (``parallel.pipeline.schedules``) run through ``parallel.pipeline.simulator.simulate`` with
per-stage action costs from ``tools.plan_costs.action_costs`` (the cost model is in that module's doc);
the step is the simulated makespan plus the step end (ZeRO reduce-scatter / all-gather and the optimizer,
``tools.plan_costs.step_end``). Memory is ``trainer.memory_plan.plan_memory``. A profile with ``action_cv`` varies each
action's time at random (seeded) and takes the median of several simulations: ranks wait for late peers.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from dataclasses import dataclass, field


import models
from configs.schema import compose
from data import micro_batches
from models.moe import GroupedExperts
from models.params import flops_per_token
from parallel.dims import groups_fit_nodes
from parallel.pipeline.replicas import holders
from parallel.pipeline.schedules import SCHEDULES, Kind, get_schedule
from parallel.pipeline.simulator import Costs, Simulation, simulate
from tools.plan_costs import (EPTraffic, Hardware, StageCost, StageCosts, action_costs, load_hardware,
                              simulate_layout, step_end)
from tools.schedule import draw
from trainer.activations import V3_RECIPE
from trainer.memory_plan import GB, check_layout, model_parts, plan_memory


# ---- the prediction --------------------------------------------------------------------------------
@dataclass
class Prediction:
    layout: str
    world_size: int
    n_microbatches: int
    tokens_per_step: int
    stage_costs: list[StageCost]
    p2p_s: float
    pipeline_s: float        # simulated makespan
    bubble_s: float          # rank 0's idle time inside its span (the schedule's bubble)
    exposed_a2a_s: float     # all-to-all time not hidden, on the busiest rank
    step_end_s: float        # ZeRO collectives + optimizer
    step_s: float
    mfu: float               # against the BF16 peak, like DeepSeek's and trainer.metrics' MFU
    tokens_per_s_gpu: float
    tflops_per_gpu: float
    memory_gb: float         # worst rank, trainer.memory_plan.plan_memory
    fits: bool
    phases: dict             # rank 0: seconds in F-only, B-only, W-only, F&B actions, bubble, step end
    traffic: EPTraffic
    sim: Simulation | None = None
    notes: list[str] = field(default_factory=list)


def _rank0_phases(sim: Simulation, costs: StageCosts) -> tuple[dict, float]:
    """Seconds rank 0 spends in each action kind, and the busiest rank's exposed all-to-all."""
    phases = {"F": 0.0, "B": 0.0, "W": 0.0, "F&B": 0.0}
    names = {Kind.F: "F", Kind.B: "B", Kind.BW: "B", Kind.W: "W", Kind.FB: "F&B"}
    for s in sim.spans[0]:
        if s.action.is_compute:
            phases[names[s.action.kind]] += s.end - s.start
    exposed = max(sum(costs.split(s.action)[1] for s in spans if s.action.is_compute) for spans in sim.spans)
    return phases, exposed


def _single_stage(c: StageCost, n_micro: int) -> tuple[float, float, dict]:
    """pp 1: (step compute, exposed all-to-all, phases) of ``n_micro`` micro-batches back to back."""
    per_mb = c.f + c.b + c.w + c.a2a_f + c.a2a_b
    phases = {"F": n_micro * c.f, "B": n_micro * (c.b + c.a2a_b), "W": n_micro * c.w, "F&B": 0.0}
    return n_micro * per_mb, n_micro * (c.a2a_f + c.a2a_b), phases


def predict(cfg, hw: Hardware, world_size: int, precision: str = "fp8", recompute: str = "none",
            model=None) -> Prediction:
    """Predicted step of ``cfg``'s layout on ``world_size`` ranks of ``hw`` (module doc)."""
    p, t = cfg.parallel, cfg.train
    dims = check_layout(cfg, world_size)
    model = model if model is not None else models.build(cfg.model, "meta")
    stage_costs, _, traffic, p2p = action_costs(cfg, hw, model_parts(model), precision, recompute)
    n_micro = max(1, micro_batches(t.global_batch_size, t.micro_batch_size, dims.dp))
    overlap = True   # DeepSeek's F&B overlap: the plans are for layouts whose all-to-alls cross nodes
    if p.pp > 1:
        sim, sc, notes = simulate_layout(cfg, hw, world_size, n_micro, StageCosts(stage_costs, p2p, overlap))
        pipeline, bubble = sim.makespan, sim.bubble[0]
        phases, exposed = _rank0_phases(sim, sc)
    else:
        sim, notes, bubble = None, [], 0.0
        pipeline, exposed, phases = _single_stage(stage_costs[0], n_micro)
    # v3: an itemized estimate of what DeepSeek-V3's recipe (partial recompute, FP8-cached activations) keeps
    # (trainer.activations.v3_recipe_bytes); none and full are this trainer's train.recompute modes
    mem = plan_memory(cfg, world_size, "v3", V3_RECIPE if recompute == "v3" else recompute, model=model)
    end = step_end(cfg, hw, mem, dims, replicated_params(cfg, n_micro, model))
    step = pipeline + end
    tokens = t.global_batch_size * cfg.data.seq_len
    fpt = flops_per_token(cfg.model, cfg.data.seq_len, model).per_token
    tflops = tokens * fpt / step / world_size / 1e12
    mfu = tflops * 1e12 / (hw.peak_bf16_tflops * 1e12) if hw.peak_bf16_tflops else float("nan")
    worst = mem.worst.total / GB
    phases = {**phases, "bubble": bubble, "step end": end}
    layout = (f"pp{p.pp} {p.schedule} ep{p.ep} dp{dims.dp} mbs{t.micro_batch_size} zero{p.zero}"
              + (f" {precision}" if precision != "fp8" else ""))
    return Prediction(layout, world_size, n_micro, tokens, stage_costs, p2p, pipeline, bubble, exposed, end, step,
                      mfu, tokens / step / world_size, tflops, worst, worst <= hw.hbm_gb * 0.9, phases, traffic,
                      sim, notes + mem.notes)


def replicated_params(cfg, n_micro: int, model) -> dict[int, int]:
    """Per pipeline rank: the parameters another pipeline rank holds too (DualPipe's twin stages, a tied
    embedding), its routed-expert shard counted; the trainer sums their gradients every step."""
    p = cfg.parallel
    if p.pp == 1:
        return {}
    expert = {id(q) for m in model.modules() if isinstance(m, GroupedExperts) for q in m.parameters()}
    size = {n: q.numel() // (p.ep if id(q) in expert else 1) for n, q in model.named_parameters()}
    out = dict.fromkeys(range(p.pp), 0)
    for name, ranks in _holders(cfg.model, p.schedule, p.pp, n_micro, p.pp_layout).items():
        if len(ranks) > 1 and name in size:
            for r in ranks:
                out[r] += size[name]
    return out


_HOLDERS: dict[tuple, dict] = {}


def _holders(m, schedule: str, pp: int, n_micro: int, layout) -> dict[str, tuple[int, ...]]:
    """``parallel.pipeline.replicas.holders``, memoised for the search (it builds the model once per pipeline
    rank). Which ranks hold a tensor does not depend on how the router groups the experts, which the search
    varies with EP, so those fields are left out of the key."""
    key = (repr(dataclasses.replace(m, n_expert_groups=1, n_limited_groups=1, group_topk=0)), schedule, pp,
           tuple(layout) if layout else None)
    if key not in _HOLDERS:
        _HOLDERS[key] = holders(m, get_schedule(schedule, pp, n_micro), layout)
    return _HOLDERS[key]


# ---- DeepSeek-V3's published step --------------------------------------------------------------------
V3_LAYOUT = ["model=v3_671b", "parallel.pp=16", "parallel.schedule=dualpipe", "parallel.ep=64",
             "parallel.ranks_per_node=8", "parallel.zero=1", "data.seq_len=4096", "train.micro_batch_size=1",
             "train.global_batch_size=15360"]
V3_WORLD = 2048
# ISCA'25 "Insights into DeepSeek-V3", Table 4 (MPFT column): the step on rank 0's timeline by phase.
V3_PUBLISHED = {"F": 1.13, "B": 1.99, "W": 0.48, "F&B": 13.95, "bubble": 2.06, "step end": 0.29, "step": 19.93,
                "mfu": 0.3894, "tokens/s/GPU": 15360 * 4096 / 19.93 / 2048}


def v3_check(hw: str | Hardware = "h800", recompute: str = "v3") -> tuple[Prediction, list[tuple[str, float, float]]]:
    """Predict DeepSeek-V3's production step (``hw``: a profile or its name); returns the prediction and (row,
    predicted, published)."""
    pred = predict(compose(V3_LAYOUT), load_hardware(hw) if isinstance(hw, str) else hw, V3_WORLD, "fp8", recompute)
    ph = pred.phases
    rows = [("1F   (rank 0, forward-only actions)", ph["F"], V3_PUBLISHED["F"]),
            ("1B   (rank 0, backward-only actions)", ph["B"], V3_PUBLISHED["B"]),
            ("1W   (rank 0, weight-only actions)", ph["W"], V3_PUBLISHED["W"]),
            ("1F1B (rank 0, overlapped F&B actions)", ph["F&B"], V3_PUBLISHED["F&B"]),
            ("bubble (rank 0 idle)", ph["bubble"], V3_PUBLISHED["bubble"]),
            ("optimizer / step end", ph["step end"], V3_PUBLISHED["step end"]),
            ("step", pred.step_s, V3_PUBLISHED["step"]),
            ("MFU (causal, BF16 peak)", pred.mfu, V3_PUBLISHED["mfu"]),
            ("tokens/s/GPU", pred.tokens_per_s_gpu, V3_PUBLISHED["tokens/s/GPU"])]
    return pred, rows


def published_schedule_bubble(hw_name: str = "h800") -> dict:
    """What DualPipe's schedule alone makes of the published rows: per-chunk F, B, W and F&B times read off
    Table 4 with rank 0's action counts (``23 F, 15 B + 8 BW, 15 W, 97 F&B`` for PP16, 120 micro-batches),
    equal on every stage, simulated with the profile's p2p. Returns the chunk times, rank 0's bubble and
    the step (makespan + the published optimizer row): the bubble a deterministic schedule produces from
    the published costs themselves, to set against the published 2.06 s (docs/planner.md)."""
    cfg, hw = compose(V3_LAYOUT), load_hardware(hw_name)
    dims = check_layout(cfg, V3_WORLD)
    schedule = get_schedule(cfg.parallel.schedule, cfg.parallel.pp, cfg.train.global_batch_size // dims.dp)
    n = {k: 0 for k in Kind}
    for a in schedule.actions[0]:
        n[a.kind] += a.is_compute
    w = V3_PUBLISHED["W"] / n[Kind.W]
    b = (V3_PUBLISHED["B"] - n[Kind.BW] * w) / (n[Kind.B] + n[Kind.BW])
    chunk = {"f": V3_PUBLISHED["F"] / n[Kind.F], "b": b, "w": w, "fb": V3_PUBLISHED["F&B"] / n[Kind.FB]}
    p2p = action_costs(cfg, hw, model_parts(models.build(cfg.model, "meta")), "fp8", "v3")[3]
    sim = simulate(schedule, Costs(**chunk, p2p=p2p))
    return {"chunk": chunk, "counts": {k.name: v for k, v in n.items() if v}, "bubble": sim.bubble[0],
            "step": sim.makespan + V3_PUBLISHED["step end"]}


# ---- search ----------------------------------------------------------------------------------------
@dataclass
class Candidate:
    overrides: list[str]
    pred: Prediction | None
    why_not: str = ""


def candidates(cfg, world_size: int, rpn: int) -> list[list[str]]:
    """Layouts to try: pp x schedule x ep x micro-batch size, ZeRO-1, for the model as it is (its routing groups
    are part of it: an EP layout whose node count neither divides nor is divided by them is skipped). Every
    candidate has a pipeline, and under a pipeline ZeRO-2 keeps full gradients as ZeRO-1 does (docs/zero.md):
    the same step and memory, so it is not tried."""
    m, out = cfg.model, []
    for pp in (4, 8, 16, 32):
        if world_size % pp or m.n_layers < pp:
            continue
        for schedule in SCHEDULES:
            for ep in (8, 16, 32, 64, 128, 256):
                if (world_size // pp) % ep or m.n_routed_experts % ep:
                    continue
                if not groups_fit_nodes(m.n_expert_groups, max(1, ep // rpn)):
                    continue
                for mbs in (1, 2):
                    out.append([f"parallel.pp={pp}", f"parallel.schedule={schedule}", f"parallel.ep={ep}",
                                f"parallel.ranks_per_node={rpn}", "parallel.zero=1", f"train.micro_batch_size={mbs}"])
    return out


def search(base: list[str], hw: Hardware, world_size: int, precision: str = "fp8", recompute: str = "v3"
           ) -> list[Candidate]:
    """Every candidate layout, predicted; the fitting ones first, by tokens/s/GPU."""
    cfg0 = compose(base)
    model = models.build(cfg0.model, "meta")
    out = []
    for over in candidates(cfg0, world_size, hw.gpus_per_node):
        cfg = copy.deepcopy(cfg0)
        for o in over:
            key, value = o.split("=")
            group, name = key.split(".")
            node = getattr(cfg, group)
            setattr(node, name, type(getattr(node, name))(value) if not isinstance(getattr(node, name), str) else value)
        try:
            pred = predict(cfg, hw, world_size, precision, recompute, model=model)
        except (ValueError, AssertionError) as e:
            out.append(Candidate(over, None, f"invalid: {str(e)[:90]}"))
            continue
        c = Candidate(over, pred)
        if not pred.fits:
            c.why_not = f"OOM: {pred.memory_gb:.0f} GB > {0.9 * hw.hbm_gb:.0f} GB usable"
        out.append(c)
    ok = sorted((c for c in out if c.pred and c.pred.fits), key=lambda c: -c.pred.tokens_per_s_gpu)
    if ok:
        best = ok[0].pred
        for c in ok[1:]:
            c.why_not = _loses(c.pred, best)
    return ok + [c for c in out if not (c.pred and c.pred.fits)]


def _diffs(p: Prediction, q: Prediction) -> dict[str, float]:
    """Seconds per step ``p`` spends more than ``q``, by cause (they sum to the step difference)."""
    return {"bubble": p.bubble_s - q.bubble_s, "exposed all-to-all": p.exposed_a2a_s - q.exposed_a2a_s,
            "step end (gradient syncs + optimizer)": p.step_end_s - q.step_end_s,
            "compute": (p.pipeline_s - p.bubble_s - p.exposed_a2a_s) - (q.pipeline_s - q.bubble_s - q.exposed_a2a_s)}


def _loses(p: Prediction, best: Prediction) -> str:
    """The biggest of the differences that make ``p`` slower than ``best``."""
    diffs = _diffs(p, best)
    worst = max(diffs, key=diffs.get)
    return f"{100 * (1 - p.tokens_per_s_gpu / best.tokens_per_s_gpu):.1f}% slower: +{diffs[worst]:.2f} s {worst}"


def versus(p: Prediction, ref: Prediction) -> str:
    """Why ``p`` is faster (or slower) than the reference layout: tokens/s/GPU, then each cause in seconds per
    step (ranks differ in step time per token: both steps cover the same global batch), and memory."""
    causes = sorted(_diffs(p, ref).items(), key=lambda kv: kv[1])
    parts = [f"{name} {d:+.3g} s" for name, d in causes if abs(d) >= 1e-3 * ref.step_s]
    gain = 100 * (p.tokens_per_s_gpu / ref.tokens_per_s_gpu - 1)
    return (f"{gain:+.1f}% tokens/s/GPU vs the reference ({', '.join(parts) or 'same time'}; "
            f"memory {p.memory_gb:.3g} vs {ref.memory_gb:.3g} GB)")


# ---- CLI -------------------------------------------------------------------------------------------
def report(pred: Prediction) -> list[str]:
    lines = [f"layout: {pred.layout} on {pred.world_size} ranks; {pred.n_microbatches} micro-batches per step",
             f"per micro-batch and stage (s): " + ", ".join(
                 f"s{i}: F {c.f:.3f} b {c.b:.3f} W {c.w:.3f} a2a {c.a2a_f:.3f}/{c.a2a_b:.3f}"
                 for i, c in enumerate(pred.stage_costs[:3])) + (" ..." if len(pred.stage_costs) > 3 else ""),
             f"EP: {pred.traffic.nodes_per_token:.2f} nodes per token ({pred.traffic.remote_nodes:.2f} remote), "
             f"{pred.traffic.inter_bytes['fwd'] / 1e6:.1f} MB inter-node per MoE layer forward; p2p {1e3 * pred.p2p_s:.2f} ms",
             f"step {pred.step_s:.3f} s = pipeline {pred.pipeline_s:.3f} + step end {pred.step_end_s:.3f}; bubble "
             f"{pred.bubble_s:.3f} s ({100 * pred.bubble_s / pred.step_s:.1f}%); exposed all-to-all {pred.exposed_a2a_s:.3f} s",
             f"MFU {100 * pred.mfu:.1f}% ({pred.tflops_per_gpu:.0f} TFLOP/s/GPU); {pred.tokens_per_s_gpu:,.0f} tokens/s/GPU; "
             f"memory {pred.memory_gb:.1f} GB on the worst rank ({'fits' if pred.fits else 'does NOT fit'})"]
    return lines + [f"note: {n}" for n in pred.notes]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", default="h800", help="profile name in configs/hardware or a YAML path")
    ap.add_argument("--world-size", type=int, default=None)
    ap.add_argument("--precision", choices=("fp8", "bf16"), default="fp8")
    ap.add_argument("--recompute", choices=("none", "v3", "full"), default="v3",
                    help="v3: RMSNorm + MLA up-projections recomputed in B (report §3.2.2)")
    ap.add_argument("--v3-check", action="store_true", help="DeepSeek-V3's layout vs its published step")
    ap.add_argument("--search", action="store_true", help="rank layouts by tokens/s/GPU")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--out", default=None, help="timeline PNG (tools.schedule's renderer)")
    ap.add_argument("--gpu-report", default=None, help="bench.gpu_suite report (.json sidecar): the profile's GEMM "
                    "efficiencies from this project's measured kernels (tools.plan_profile)")
    ap.add_argument("--save-profile", default=None, help="write the profile used (calibrated) as YAML for --hardware")
    return ap


def _print_v3_check(args, hw: Hardware) -> None:
    pred, rows = v3_check(hw, args.recompute)
    print("\n".join(report(pred)))
    print(f"\n{'DeepSeek-V3, 2048 ' + hw.name:<40} {'predicted':>10} {'published':>10} {'error':>7}")
    for name, got, want in rows:
        print(f"{name:<40} {got:>10.3f} {want:>10.3f} {100 * (got / want - 1):>+6.1f}%")
    implied = published_schedule_bubble(args.hardware)
    c = implied["chunk"]
    print(f"\nThe published rows as per-chunk costs (rank 0's {implied['counts']}): F {c['f']:.3f}, B {c['b']:.3f}, "
          f"W {c['w']:.3f}, F&B {c['fb']:.3f} s. DualPipe's schedule with them: rank 0 bubble "
          f"{implied['bubble']:.2f} s (predicted {pred.bubble_s:.2f}), step {implied['step']:.2f} s; the published "
          f"{V3_PUBLISHED['bubble']:.2f} s bubble and {V3_PUBLISHED['step']:.2f} s step hold "
          f"{V3_PUBLISHED['bubble'] - implied['bubble']:.2f} s of idle time the schedule does not produce.")


def _print_reference(ref: Prediction, ranked: list[Candidate], top: int) -> None:
    """Where the layout given on the command line ranks, and what makes each of the top ones faster."""
    fitting = [c for c in ranked if c.pred and c.pred.fits]
    place = next((i + 1 for i, c in enumerate(fitting) if c.pred.layout == ref.layout), None)
    where = f"#{place} of {len(fitting)} that fit" if place else ("does not fit" if not ref.fits else "not a candidate")
    print(f"\nreference (the layout given): {ref.layout}: {where}; step {ref.step_s:.2f} s, bubble {ref.bubble_s:.2f} s, "
          f"{ref.tokens_per_s_gpu:,.0f} tokens/s/GPU, {ref.memory_gb:.1f} GB")
    for i, c in enumerate(fitting[:top]):
        if c.pred.layout != ref.layout:
            print(f"  #{i + 1} {c.pred.layout}: {versus(c.pred, ref)}")


def _print_search(args, hw: Hardware, overrides: list[str]) -> None:
    ranked = search(overrides, hw, args.world_size or 2048, args.precision, args.recompute)
    print(f"{'#':>3} {'layout':<40} {'step s':>7} {'bubble':>7} {'a2a':>6} {'end':>5} {'MFU':>6} {'tok/s/GPU':>9} "
          f"{'mem GB':>7}  why not first")
    for i, c in enumerate(ranked[:args.top]):
        p = c.pred
        print(f"{i + 1:>3} {p.layout:<40} {p.step_s:>7.2f} {p.bubble_s:>7.2f} {p.exposed_a2a_s:>6.2f} "
              f"{p.step_end_s:>5.2f} {100 * p.mfu:>5.1f}% {p.tokens_per_s_gpu:>9,.0f} {p.memory_gb:>7.1f}  {c.why_not}")
    losers = ranked[args.top:]
    reasons: dict[str, int] = {}
    for c in losers:
        key = c.why_not.split(":")[0] if not c.why_not[0].isdigit() else "slower"
        reasons[key] = reasons.get(key, 0) + 1
    print(f"{len(losers)} more: " + ", ".join(f"{n} {k}" for k, n in sorted(reasons.items())))
    if any(o.startswith("parallel.") for o in overrides):   # a layout was given: compare the winners with it
        ref = predict(compose(overrides), hw, args.world_size or 2048, args.precision, args.recompute)
        _print_reference(ref, ranked, args.top)


def _print_layout(args, hw: Hardware, overrides: list[str]) -> None:
    cfg = compose(overrides)
    world = args.world_size or cfg.parallel.pp * cfg.parallel.ep
    pred = predict(cfg, hw, world, args.precision, args.recompute)
    print("\n".join(report(pred)))
    if args.out and pred.sim is not None:
        c = pred.stage_costs[0]
        draw(pred.sim, f"{pred.layout} on {hw.name}: predicted step {pred.step_s:.2f} s", args.out,
             Costs(f=c.f, b=c.b, w=c.w))
        print(f"wrote {args.out}")


def main(argv: list[str]) -> int:
    args, overrides = _parser().parse_known_args(argv)
    if [o for o in overrides if o.startswith("--")]:
        print(f"error: unknown option {[o for o in overrides if o.startswith('--')][0]}", file=sys.stderr)
        return 2
    hw = load_hardware(args.hardware)
    if args.gpu_report or args.save_profile:
        from tools.plan_profile import ReportError, from_cli
        try:
            hw = from_cli(hw, args.gpu_report, args.save_profile)
        except ReportError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.v3_check:
        _print_v3_check(args, hw)
    elif args.search:
        _print_search(args, hw, overrides)
    else:
        _print_layout(args, hw, overrides)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
