"""How much expert all-to-all time DualPipe's overlapped F&B hides, measured on CPU processes.

    python bench/pipeline_overlap.py [--ep 1] [--latency-ms 10] [--steps 3]

pp=2 (DualPipe) x ep gloo processes, small model, 8 micro-batches. Every expert all-to-all on the
inter-node path sleeps ``--latency-ms`` (injected wire time). With ``--ep 1`` each rank's experts stay
local but still go through an all-to-all dispatcher over a one-rank group, so the injected latency
is there while the 2 processes do not oversubscribe a 2-core machine. For overlap off/on and latency 0/L it
times the F&B actions (the only place overlap can act) and the whole step on the slowest rank:

    hidden = 1 - (FB_on(L) - FB_on(0)) / (FB_off(L) - FB_off(0))

i.e. the share of the injected latency inside F&B actions that no longer adds to their time.
"""
from __future__ import annotations

import argparse
import sys
import time
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import ModelConfig, build  # noqa: E402
from parallel.dims import ParallelDims  # noqa: E402
from parallel.ep import AllToAllDispatcher, apply_ep  # noqa: E402
from parallel.pipeline.runner import PipelineRunner  # noqa: E402
from parallel.pipeline.schedules.actions import Kind  # noqa: E402

N_MB = 8


def worker(rank, world, store, args, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    dims = ParallelDims(world_size=world, rank=rank, pp=2, ep=args.ep).build_groups()
    solo = {r: (dist.new_group([r]), dist.new_group([r])) for r in range(world)}[rank]   # every rank creates all
    cfg = ModelConfig(vocab_size=256, dim=64, n_layers=4, inter_dim=128, n_heads=4, q_lora_rank=32, kv_lora_rank=32,
                      qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_inter_dim=32, n_routed_experts=8,
                      n_activated_experts=2, n_expert_groups=2, n_limited_groups=1, mtp_depth=1)
    ids = torch.randint(0, cfg.vocab_size, (N_MB * 2, 65), generator=torch.Generator().manual_seed(rank % 2))
    mbs = [(ids[i * 2:(i + 1) * 2, :-1], ids[i * 2:(i + 1) * 2, 1:]) for i in range(N_MB)]
    for overlap in (False, True):
        for latency in (0.0, args.latency_ms):
            model = apply_ep(build(cfg, seed=0), dims, latency_s=latency / 1e3).train()
            if args.ep == 1:
                for moe in model.moe_layers():
                    moe.dispatcher = AllToAllDispatcher(cfg.n_routed_experts, solo[0], 1, latency / 1e3, solo[1])
            runner = PipelineRunner(model, dims, "dualpipe", N_MB, overlap=overlap)
            fb, step = [], []
            for i in range(1 + args.steps):
                dist.barrier()
                start = time.perf_counter()
                runner.forward_backward(mbs, 1.0 / N_MB, 0.3, 1e-4)
                t0 = time.perf_counter() - start
                model.zero_grad(set_to_none=True)
                if i:   # skip the warm-up step
                    fb.append(sum(runner.executor.durations.get(Kind.FB, [])))
                    step.append(t0)
            res = torch.tensor([sum(fb) / len(fb), sum(step) / len(step)], dtype=torch.float64)
            dist.all_reduce(res, op=dist.ReduceOp.MAX)
            if rank == 0:
                out[(overlap, latency)] = tuple(res.tolist())
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latency-ms", type=float, default=10.0)
    ap.add_argument("--ep", type=int, default=1, choices=(1, 2))
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    out = mp.Manager().dict()
    store = Path(tempfile.mkdtemp()) / "store"
    world = 2 * args.ep
    mp.spawn(worker, args=(world, str(store), args, out), nprocs=world, join=True)
    L = args.latency_ms
    print(f"DualPipe pp=2 x EP={args.ep} ({world} CPU processes), {N_MB} micro-batches, "
          f"injected latency {L} ms per all-to-all")
    print("| overlap | latency (ms) | F&B time per step (s) | step time (s) |")
    print("|---|---|---|---|")
    for (overlap, lat), (fb, step) in sorted(out.items()):
        print(f"| {'on' if overlap else 'off'} | {lat:g} | {fb:.3f} | {step:.3f} |")
    injected = out[(False, L)][0] - out[(False, 0.0)][0]
    exposed = out[(True, L)][0] - out[(True, 0.0)][0]
    print(f"latency added to F&B actions: {injected:.3f} s without overlap, {exposed:.3f} s with overlap "
          f"-> hidden {1 - exposed / injected:.0%}")


if __name__ == "__main__":
    main()
