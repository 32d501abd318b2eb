"""Calibrate a measured CPU profile for ``tools.plan`` from one process, then (``--check``) compare its
predictions with trainer runs of three layouts.

    python bench/plan_calibrate.py [--out configs/hardware/cpu.yaml] [--reps 5] [--check]

One process, one thread (as the tests' torchrun ranks): the tiny model (``+exp=tiny``: micro-batch 2 x
128 tokens) cut into single-component stages with ``parallel.pipeline.stages.Stage``: the embedding alone,
each layer alone, the head + MTP alone. Its GEMM modules defer their weight gradients
(``parallel.wgrad.apply_deferred_wgrad``), as the trainer's zero-bubble schedules do, and each component is
timed as the pipeline executor runs it: forward (F), B (``WeightGradQueue.backward``: the stage input's and
the non-GEMM parameters' gradients, dW GEMMs queued, graph freed) and W (``WeightGradQueue.run``: the queued
GEMMs only), median of ``--reps``; seconds per token per component go into the profile's ``measured``, and
the trainer's optimizer step (one rank: norm, clipping, AdamW) per parameter into ``optimizer_s_per_param``.
The link (latency and bandwidth of every collective and p2p in the profile) is a 2-process gloo all-reduce
of one float and of 16 MB.
``--check`` runs pp=2 DualPipe, pp=4 1F1B and pp=2 x ep=2 DualPipe with
torchrun for ``--steps`` steps and prints predicted vs measured (median step_time_s after the first two),
with ``os.getloadavg()`` before and after.
"""
from __future__ import annotations

import argparse
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

LAYOUTS = {
    "pp2 dualpipe": ["parallel.pp=2", "parallel.schedule=dualpipe"],
    "pp4 1f1b": ["parallel.pp=4", "parallel.schedule=1f1b"],
    "pp2 x ep2 dualpipe": ["parallel.pp=2", "parallel.schedule=dualpipe", "parallel.ep=2"],
}


def measure(reps: int) -> dict:
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
    out = {}
    for name, stages in pieces.items():
        times = {"f": [], "b": [], "w": []}
        for st in stages:
            params = [p for p in st.parameters() if p.requires_grad]
            for r in range(reps + 1):
                x = None if st.is_first else torch.randn(B, T, m.dim, requires_grad=True)
                t0 = time.perf_counter()
                y, _ = st(x, ids, ids, 0.3)
                t1 = time.perf_counter()
                queue.backward(r, [y], [torch.ones_like(y)], [x], params)
                t2 = time.perf_counter()
                queue.run(r)
                t3 = time.perf_counter()
                model.zero_grad(set_to_none=True)
                if r:   # the first is a warm-up
                    for k, dt in zip("fbw", (t1 - t0, t2 - t1, t3 - t2)):
                        times[k].append(dt)
        n = len(stages)
        out[name] = {k: statistics.median(v) / (B * T) for k, v in times.items()} if n else {"f": 0, "b": 0, "w": 0}
    return out


def measure_optimizer(reps: int) -> float:
    """Seconds per parameter of the trainer's optimizer step on the tiny model in one process (``parallel.zero``'s
    single-rank optimizer: gradient norm, clipping, AdamW), median of ``reps``."""
    import models
    from configs.schema import compose
    from parallel.dims import ParallelDims
    from parallel.zero import build_optimizer
    cfg = compose(["+exp=tiny"])
    model = models.build(cfg.model, "cpu", seed=0)
    opt = build_optimizer(model, cfg.optim, ParallelDims(world_size=1))
    params = [p for p in model.parameters() if p.requires_grad]
    times = []
    for _ in range(reps + 2):
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        t0 = time.perf_counter()
        opt.step(cfg.optim.grad_clip)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) / sum(p.numel() for p in params)


def _link_worker(rank: int, store: str, reps: int, out) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    res = {}
    for n in (1, 4 * 2**20):   # one float (latency); 16 MB (bandwidth)
        t = torch.ones(n)
        times = []
        for _ in range(reps + 2):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        res[n] = statistics.median(times[2:])
    if rank == 0:
        out.update(res)
    dist.destroy_process_group()


def measure_link(reps: int) -> tuple[float, float]:
    """(latency in us, GB/s) of a 2-rank gloo all-reduce on this machine, the planner's model of it:
    latency + bytes / bandwidth."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        out = mp.Manager().dict()
        mp.spawn(_link_worker, args=(str(Path(tmp) / "store"), reps, out), nprocs=2, join=True)
    small, big = out[1], out[4 * 2**20]
    return small * 1e6, 16 * 2**20 / max(big - small, 1e-9) / 1e9


def run_layout(over: list[str], steps: int, tmp: Path) -> float:
    nproc = 1
    for o in over:
        if o.startswith(("parallel.pp=", "parallel.ep=")):
            nproc *= int(o.split("=")[1])
    run_dir = tmp / str(abs(hash(tuple(over))))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "trainer",
           "+exp=tiny", f"train.max_steps={steps}", "logging.wandb.mode=disabled", "logging.progress=false",
           "checkpoint.save_final=false", f"hydra.run.dir={run_dir}", f"data.cache_dir={tmp}/cache", *over]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r][2:]
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "configs" / "hardware" / "cpu.yaml"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    import yaml
    load0 = os.getloadavg()
    measured = measure(args.reps)
    optimizer = measure_optimizer(args.reps)
    latency_us, gb_s = measure_link(max(args.reps, 10))
    prof = {"name": "CPU (this machine, measured)", "cores": os.cpu_count(), "ib_gb_s": round(gb_s, 3),
            "nvlink_gb_s": round(gb_s, 3), "gpus_per_node": 1, "a2a_latency_us": round(latency_us, 1),
            "p2p_latency_us": round(latency_us, 1), "hbm_gb": 24,
            "measured": measured, "optimizer_s_per_param": optimizer,
            "sources": [f"bench/plan_calibrate.py, one process, 1 thread, load {load0[0]:.2f} at start"]}
    Path(args.out).write_text(yaml.safe_dump(prof, sort_keys=False))
    print(f"load {load0}; wrote {args.out}")
    for k, v in measured.items():
        print(f"  {k:<12} " + "  ".join(f"{x} {1e6 * v[x]:.2f} us/token" for x in "fbw"))
    print(f"  optimizer    {1e9 * optimizer:.2f} ns/parameter")
    print(f"  gloo link    {latency_us:.0f} us + bytes / {gb_s:.2f} GB/s (2-rank all-reduce)")
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
            pred = predict(cfg, hw, world, "bf16", "none")
            before = os.getloadavg()[0]
            got = run_layout(over, args.steps, Path(tmp))
            print(f"{name:<40} predicted {pred.step_s:.3f} s  measured {got:.3f} s  "
                  f"({100 * (pred.step_s / got - 1):+.1f}%)  load {before:.2f} -> {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
