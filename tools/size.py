"""Model size, FLOPs per token and per-rank memory of a parallel layout, without running it.

    python -m tools.size +exp=v3_small
    python -m tools.size model=v3_671b parallel.pp=16 parallel.schedule=dualpipe parallel.ep=64 \\
        parallel.ranks_per_node=8 parallel.zero=1 data.seq_len=4096 train.micro_batch_size=1 \\
        train.global_batch_size=15360 --world-size 2048 --gpu-mem-gb 80

Arguments are Hydra overrides, as for the trainer, plus the options of ``parse_args`` (anywhere on the line;
``--headroom``: the share of GPU memory kept free for the CUDA context, NCCL buffers and fragmentation).
The config is composed like the trainer's, but only the model and the layout are validated, so planned layouts
can be sized. The memory model (per-rank weights, gradients, optimizer state, activations; what each recipe
counts): ``trainer/memory_plan.py``, which the trainer's pre-flight check uses too.
"""
from __future__ import annotations

import argparse
import sys

import models
from configs.schema import Config, compose
from errors import ConfigError
from models.params import count_params, flops_per_token
from parallel.pipeline.schedules import get_schedule
from parallel.recompute import MODES as RECOMPUTE
from parallel.zero.memory import formula
from trainer.memory_plan import GB, RECIPES, Plan, check_layout, plan_memory, recipe_bytes


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
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="the device type the run uses: the heads' loss keeps less on CUDA (default cuda)")
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
        plan = plan_memory(cfg, recipe=args.recipe, recompute=args.recompute, model=model, dims=dims,
                           device=args.device)
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
