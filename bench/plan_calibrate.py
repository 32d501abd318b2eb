"""Calibrate a measured CPU profile for ``tools.plan`` from one process, then (``--check``) compare its
predictions with trainer runs of four layouts.

    python bench/plan_calibrate.py [--out configs/hardware/cpu.yaml] [--reps 5] [--check]

One process, one thread (as the tests' torchrun ranks): the tiny model (``+exp=tiny``: micro-batch 2 x
128 tokens) cut into single-component stages with ``parallel.pipeline.stages.Stage``: the embedding alone,
each layer alone, the head + MTP alone. Its GEMM modules defer their weight gradients
(``parallel.wgrad.apply_deferred_wgrad``), as the trainer's zero-bubble schedules do, and each component is
timed as the pipeline executor runs it: forward (F), B (``WeightGradQueue.backward``: the stage input's and
the non-GEMM parameters' gradients, dW GEMMs queued, graph freed) and W (``WeightGradQueue.run``: the queued
GEMMs only), in a pipeline's order (the forwards of a few micro-batches, then their backwards in
reverse), median over ``--reps`` rounds; seconds per token per component go into the profile's ``measured``, their
spread between micro-batches into ``action_cv``, and
the trainer's step end (one rank: non-finite check, norm, clipping, AdamW) per parameter into
``optimizer_s_per_param``.
The link (latency and bandwidth of every collective and p2p in the profile) is a 2-process gloo all-reduce
of one float and of 16 MB; the expert all-to-all's cost per call (waiting, and host work) is the trainer's dispatcher at ep = 2
on 2 gloo processes against the same MoE layer with every expert local (``measure_dispatch``). On a machine
with fewer cores than the largest ``--check`` layout has ranks, both are measured again with that many processes
(pairs at once) into the profile's ``oversubscribed``, which the planner uses for layouts with more ranks than cores.
``--check`` runs pp=2 DualPipe, pp=4 1F1B, pp=2 x ep=2 DualPipe and ep=2 with
torchrun for ``--steps`` steps and prints predicted vs measured (median step_time_s after the first two),
with ``os.getloadavg()`` before and after.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

IN_FLIGHT = 2   # micro-batches whose forwards run before their backwards, per calibration round

LAYOUTS = {
    "pp2 dualpipe": ["parallel.pp=2", "parallel.schedule=dualpipe"],
    "pp4 1f1b": ["parallel.pp=4", "parallel.schedule=1f1b"],
    "pp2 x ep2 dualpipe": ["parallel.pp=2", "parallel.schedule=dualpipe", "parallel.ep=2"],
    "ep2": ["parallel.ep=2"],   # no pipeline: the expert all-to-all over gloo, 2 ranks on 2 cores
}


def measure(reps: int) -> tuple[dict, float]:
    import models
    from parallel.pipeline.stages import Stage
    from parallel.wgrad import WeightGradQueue, apply_deferred_wgrad
    from configs.schema import compose
    torch.set_num_threads(1)
    cfg = compose(["+exp=tiny"])
    m, B, T = cfg.model, cfg.train.micro_batch_size, cfg.data.seq_len
    model = models.build(m, "cpu", seed=0)
    ids = torch.randint(0, m.vocab_size, (B, T))
    L = m.n_layers
    pieces = {"embed": [Stage(model, 0, 3, range(0, 0))], "head": [Stage(model, 2, 3, range(L, L))],
              "dense_layer": [], "moe_layer": []}
    for i in range(L):
        pieces["moe_layer" if m.is_moe_layer(i) else "dense_layer"].append(Stage(model, 1, 3, range(i, i + 1)))
    queue = WeightGradQueue()
    apply_deferred_wgrad(model, queue)
    comps = [(name, st) for name, stages in pieces.items() for st in stages]
    order = sorted(comps, key=lambda c: (not c[1].is_first, c[1].is_last, c[1].layer_ids))   # the model's order
    gen = torch.Generator().manual_seed(0)
    times = {name: {k: [] for k in "fbw"} for name in pieces}
    # As a pipeline runs them: each round, the forwards of IN_FLIGHT micro-batches (fresh token ids each) through
    # every component in the model's order, then their B and W in reverse. Timing one component's F, B, W back
    # to back instead keeps its activations and weights in the core's cache and reads 10-20 % faster than the
    # trainer's pipeline actions run (measured on the tiny model, 2026-11-24).
    for r in range(reps + 1):
        live = []
        for j in range(IN_FLIGHT):
            ids = torch.randint(0, m.vocab_size, (B, T), generator=gen)
            for name, st in order:
                x = None if st.is_first else torch.randn(B, T, m.dim, requires_grad=True)
                t0 = time.perf_counter()
                y, _ = st(x, ids, ids, 0.3)
                times[name]["f"].append(time.perf_counter() - t0)
                live.append((name, st, x, y, (r, j, len(live))))
        for name, st, x, y, key in reversed(live):
            params = [p for p in st.parameters() if p.requires_grad]
            t1 = time.perf_counter()
            queue.backward(key, [y], [torch.ones_like(y)], [x], params)
            t2 = time.perf_counter()
            queue.run(key)
            times[name]["b"].append(t2 - t1)
            times[name]["w"].append(time.perf_counter() - t2)
        model.zero_grad(set_to_none=True)
        if r == 0:   # the first round is a warm-up
            times = {name: {k: [] for k in "fbw"} for name in pieces}
    # per component: the median over its stages and micro-batches (the MoE layers are alike, as are the dense ones)
    per_token = {name: {k: statistics.median(v) / (B * T) for k, v in t.items()} if pieces[name]
                 else {"f": 0, "b": 0, "w": 0} for name, t in times.items()}
    # how much one action's time varies between micro-batches: the coefficients of variation of the components'
    # F, B and W, weighted by their times (the embedding, a few microseconds, would only add timer noise)
    spread = [(statistics.mean(v), statistics.pstdev(v) / statistics.mean(v))
              for name, t in times.items() if pieces[name] and name != "embed" for v in t.values()]
    cv = sum(m * c for m, c in spread) / sum(m for m, _ in spread)
    return per_token, cv


def measure_optimizer(reps: int) -> float:
    """Seconds per parameter of the trainer's step end on the tiny model in one process (``parallel.zero``'s
    single-rank optimizer): the non-finite check of the gradients, then the optimizer step (gradient norm,
    clipping, AdamW), each time right after a forward + backward of a micro-batch, as in a training step (with
    gradients made up instead, the optimizer's state stays in the cache and times 15-20 % faster); median of
    ``reps``."""
    import models
    from configs.schema import compose
    from parallel.dims import ParallelDims
    from parallel.zero import build_optimizer
    cfg = compose(["+exp=tiny"])
    m, B, T = cfg.model, cfg.train.micro_batch_size, cfg.data.seq_len
    model = models.build(m, "cpu", seed=0)
    opt = build_optimizer(model, cfg.optim, ParallelDims(world_size=1))
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(reps + 2):
        ids = torch.randint(0, m.vocab_size, (B, T), generator=gen)
        opt.backward(model.compute_loss(ids, ids, mtp_weight=0.3).loss)
        t0 = time.perf_counter()
        opt.grads_finite()
        opt.step(cfg.optim.grad_clip)
        times.append(time.perf_counter() - t0)
        opt.zero_grad()
    return statistics.median(times[2:]) / sum(p.numel() for p in model.parameters() if p.requires_grad)


def _link_worker(rank: int, store: str, reps: int, world: int, out) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]   # every pair all-reduces at once
    group = pairs[rank // 2]
    res = {}
    for n in (1, 4 * 2**20):   # one float (latency); 16 MB (bandwidth)
        t = torch.ones(n)
        times = []
        for _ in range(reps + 2):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t, group=group)
            times.append(time.perf_counter() - t0)
        res[n] = statistics.median(times[2:])
    if rank == 0:
        out.update(res)
    dist.destroy_process_group()


def _on_ranks(worker, reps: int, world: int = 2) -> dict:
    """Run ``worker(rank, store, reps, world, out)`` on ``world`` processes (a file rendezvous in a temporary
    directory); returns what rank 0 put in ``out``."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        out = mp.Manager().dict()
        mp.spawn(worker, args=(str(Path(tmp) / "store"), reps, world, out), nprocs=world, join=True)
        return dict(out)


def _dispatch_worker(rank: int, store: str, reps: int, world: int, out) -> None:
    import models
    import torch.distributed as dist
    from configs.schema import compose
    from parallel.dims import ParallelDims
    from parallel.ep import apply_ep
    from parallel.pipeline.stages import Stage
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cfg = compose(["+exp=tiny", "parallel.ep=2"])
    m, p, B, T = cfg.model, cfg.parallel, cfg.train.micro_batch_size, cfg.data.seq_len
    dims = ParallelDims(world_size=world, rank=rank, ep=2, ranks_per_node=p.ranks_per_node).build_groups()
    layer = next(i for i in range(m.n_layers) if m.is_moe_layer(i))
    blocks = {ep: Stage(model, 1, 3, range(layer, layer + 1)) for ep, model in
              ((False, models.build(m, "cpu", seed=0)),
               (True, apply_ep(models.build(m, "cpu", seed=0), dims, p.ep_dispatcher, p.fp8_dispatch)))}
    gen = torch.Generator().manual_seed(rank)
    times = {(ep, d): [] for ep in blocks for d in ("fwd", "bwd", "cpu")}
    for r in range(reps + 2):
        ids = torch.randint(0, m.vocab_size, (B, T), generator=gen)
        for ep, st in blocks.items():   # alternated, so that both see the same load
            x = torch.randn(B, T, m.dim, generator=gen, requires_grad=True)
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()   # CPU time of every thread (gloo's included)
            y, _ = st(x, ids, ids, 0.3)
            t1 = time.perf_counter()
            y.backward(torch.ones_like(y))
            t2, c2 = time.perf_counter(), time.process_time()
            if r >= 2:
                times[(ep, "fwd")].append(t1 - t0)
                times[(ep, "bwd")].append(t2 - t1)
                times[(ep, "cpu")].append(c2 - c0)
    if rank == 0:
        out.update({k: statistics.median(v) for k, v in times.items()})
    dist.destroy_process_group()


def measure_dispatch(reps: int, world: int = 2) -> tuple[float, float]:
    """Seconds one expert all-to-all call of the trainer's dispatcher costs on this machine beyond its bytes,
    ``(waiting, host work)``: a MoE layer of the tiny model run forward and backward by ``world`` gloo ranks at
    ep = 2 (EP groups of 2, all at once)
    (``parallel.ep_dispatcher``: its exchanges, the counts it sends first, its sorting and gathering on the host)
    minus the same layer with every expert local, over the planner's calls per layer (dispatch + combine, each
    direction). The host work is the extra CPU time of the process (all its threads), the waiting the rest of
    the extra wall time. The tokens are few, so these are what the planner adds per call (``a2a_latency_us``,
    hidden by F&B overlap where compute is beside it; ``a2a_host_us``, compute)."""
    from configs.schema import compose
    from tools.plan_costs import ep_traffic
    out = _on_ranks(_dispatch_worker, reps, world)
    cfg = compose(["+exp=tiny", "parallel.ep=2"])
    n = 2 * ep_traffic(cfg.model, 2, cfg.parallel.ranks_per_node, 1, cfg.parallel.fp8_dispatch).calls
    wall = max(0.0, sum(out[(True, d)] - out[(False, d)] for d in ("fwd", "bwd"))) / n
    host = min(wall, max(0.0, out[(True, "cpu")] - out[(False, "cpu")]) / n)
    return wall - host, host


def measure_link(reps: int, world: int = 2) -> tuple[float, float]:
    """(latency in us, GB/s) of a 2-rank gloo all-reduce on this machine, the planner's model of it:
    latency + bytes / bandwidth; with ``world`` > 2, ``world`` / 2 such pairs at once."""
    out = _on_ranks(_link_worker, reps, world)
    small, big = out[1], out[4 * 2**20]
    return small * 1e6, 16 * 2**20 / max(big - small, 1e-9) / 1e9


def _nproc(over: list[str]) -> int:
    """Processes a ``LAYOUTS`` entry runs on: pp x ep."""
    n = 1
    for o in over:
        if o.startswith(("parallel.pp=", "parallel.ep=")):
            n *= int(o.split("=")[1])
    return n


def run_layout(over: list[str], steps: int, tmp: Path) -> dict[str, float]:
    """Median over the steps after the first two of rank 0's ``metrics.jsonl`` numbers (``step_time_s`` and
    the pipeline's per-kind action times, ``pipeline_<kind>_s``, and the phase timers' ``time_<phase>_s``)."""
    nproc = _nproc(over)
    run_dir = tmp / str(abs(hash(tuple(over))))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "trainer",
           "+exp=tiny", f"train.max_steps={steps}", "logging.wandb.mode=disabled", "logging.progress=false",
           "checkpoint.save_final=false", f"hydra.run.dir={run_dir}", f"data.cache_dir={tmp}/cache", *over]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step_time_s" in r][2:]
    keys = [k for k in rows[0] if k == "step_time_s" or (k.startswith(("pipeline_", "time_")) and k.endswith("_s"))]
    return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}


def breakdown(pred, got: dict[str, float]) -> str:
    """Rank 0's step by phase, predicted / measured: its compute action kinds (B counts full backwards too),
    its idle time inside the pipeline, and the step outside it (loss reductions, gradient sync, optimizer).
    Without a pipeline: the predicted phases and the measured phase timers."""
    if "pipeline_span_s" not in got:
        return ("predicted " + "  ".join(f"{k} {1e3 * v:.0f}" for k, v in pred.phases.items()) + " ms; measured "
                + "  ".join(f"{k[5:-2]} {1e3 * v:.0f}" for k, v in got.items() if k.startswith("time_")) + " ms")
    m = {"F": got.get("pipeline_f_s", 0.0), "B": got.get("pipeline_b_s", 0.0) + got.get("pipeline_bw_s", 0.0),
         "W": got.get("pipeline_w_s", 0.0), "F&B": got.get("pipeline_fb_s", 0.0)}
    span = got.get("pipeline_span_s", 0.0)
    m["idle"] = span - sum(m.values())
    m["outside"] = got["step_time_s"] - span
    p = {k: pred.phases.get(k, 0.0) for k in ("F", "B", "W", "F&B")}
    p["idle"] = pred.phases["bubble"]
    p["outside"] = pred.step_s - sum(p.values())
    return "  ".join(f"{k} {1e3 * p[k]:.0f}/{1e3 * m[k]:.0f}" for k in p) + " ms (predicted/measured, rank 0)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "configs" / "hardware" / "cpu.yaml"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    import yaml
    load0 = os.getloadavg()
    measured, cv = measure(args.reps)
    optimizer = measure_optimizer(args.reps)
    latency_us, gb_s = measure_link(max(args.reps, 10))
    a2a_wait, a2a_host = measure_dispatch(max(args.reps, 10))
    crowd = max(_nproc(over) for over in LAYOUTS.values())
    oversubscribed = None
    if (os.cpu_count() or 1) < crowd:   # collectives whose peers the OS has descheduled: measured, not modelled
        lat_n, gb_n = measure_link(max(args.reps, 10), crowd)
        wait_n, host_n = measure_dispatch(max(args.reps, 10), crowd)
        oversubscribed = {"a2a_latency_us": round(1e6 * wait_n, 1), "a2a_host_us": round(1e6 * host_n, 1),
                          "p2p_latency_us": round(lat_n, 1), "ib_gb_s": round(gb_n, 3), "nvlink_gb_s": round(gb_n, 3)}
    prof = {"name": "CPU (this machine, measured)", "cores": os.cpu_count(), "ib_gb_s": round(gb_s, 3),
            "nvlink_gb_s": round(gb_s, 3), "gpus_per_node": 1, "a2a_latency_us": round(1e6 * a2a_wait, 1),
            "a2a_host_us": round(1e6 * a2a_host, 1),
            "p2p_latency_us": round(latency_us, 1), "hbm_gb": 24,
            "action_cv": round(cv, 3), "measured": measured, "optimizer_s_per_param": optimizer,
            "oversubscribed": oversubscribed,
            "sources": [f"bench/plan_calibrate.py, one process, 1 thread, load {load0[0]:.2f} at start"]}
    Path(args.out).write_text(yaml.safe_dump(prof, sort_keys=False))
    print(f"load {load0}; wrote {args.out}")
    for k, v in measured.items():
        print(f"  {k:<12} " + "  ".join(f"{x} {1e6 * v[x]:.2f} us/token" for x in "fbw"))
    print(f"  variation    {cv:.1%} (an action's time between micro-batches, coefficient of variation)")
    print(f"  optimizer    {1e9 * optimizer:.2f} ns/parameter")
    print(f"  gloo link    {latency_us:.0f} us + bytes / {gb_s:.2f} GB/s (2-rank all-reduce)")
    print(f"  expert a2a   {1e6 * a2a_wait:.0f} us waiting + {1e6 * a2a_host:.0f} us host work per call (the trainer's "
          "dispatcher at ep = 2 vs all experts local)")
    if oversubscribed:
        o = oversubscribed
        print(f"  {crowd} processes on {os.cpu_count()} cores (pairs at once): link {o['p2p_latency_us']:.0f} us + bytes / "
              f"{o['ib_gb_s']:.2f} GB/s; expert a2a {o['a2a_latency_us']:.0f} us waiting + {o['a2a_host_us']:.0f} us host "
              "work per call")
    if not args.check:
        return 0
    from configs.schema import compose
    from tools.plan import predict
    from tools.plan_costs import load_hardware
    hw = load_hardware(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        for name, over in LAYOUTS.items():
            cfg = compose(["+exp=tiny", *over])
            world = cfg.parallel.pp * cfg.parallel.ep
            # This machine's speed drifts by up to +-9 % over minutes (the same one-process profile, timed
            # minutes apart, 2026-11-24): the components are timed again right before and after each run
            # and their mean is the profile for that run (the other measurements keep the first calibration)
            pre = measure(args.reps)[0]
            before = os.getloadavg()[0]
            got = run_layout(over, args.steps, Path(tmp))
            post = measure(args.reps)[0]
            mean = {c: {k: (pre[c][k] + post[c][k]) / 2 for k in "fbw"} for c in pre}
            pred = predict(cfg, dataclasses.replace(hw, measured=mean), world, "bf16", "none")
            step = got["step_time_s"]
            drift = _total(post) / _total(pre) - 1
            print(f"{name:<40} predicted {pred.step_s:.3f} s  measured {step:.3f} s  "
                  f"({100 * (pred.step_s / step - 1):+.1f}%)  load {before:.2f} -> {os.getloadavg()[0]:.2f}, "
                  f"profile {100 * drift:+.1f}% after the run vs before\n"
                  f"    {breakdown(pred, got)}", flush=True)
    return 0


def _total(per_token: dict) -> float:
    return sum(v for c in per_token.values() for v in c.values())


if __name__ == "__main__":
    sys.exit(main())
