"""MoE-layer throughput under expert parallelism on CPU processes (gloo).

    python bench/moe_ep.py [--ep 1 2 4] [--tokens 2048] [--iters 5]

For each EP size, ``ep`` processes each run forward+backward of one MoE layer on their own
``--tokens`` tokens (weak scaling: every rank brings a full micro-batch) and report aggregate
tokens/s and the share of step time spent in dispatch+combine (the dispatcher's ``DispatchStats``:
planning, launching and waiting for the all-to-alls, forward and backward). On a 2-core machine EP=4
oversubscribes the cores; compare numbers only within one machine.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.latency import add_latency  # noqa: E402
from models import ModelConfig  # noqa: E402
from models.moe import MoE  # noqa: E402
from parallel.dims import ParallelDims  # noqa: E402
from parallel.ep import apply_ep  # noqa: E402


def layer_config(ep: int, rpn: int) -> ModelConfig:
    nodes = max(1, ep // rpn)
    return ModelConfig(dim=256, moe_inter_dim=128, n_routed_experts=16, n_activated_experts=4, n_shared_experts=1,
                       n_expert_groups=nodes, n_limited_groups=min(2, nodes), route_scale=2.5)


def worker(rank, world, store, args, out):
    torch.set_num_threads(1)   # one thread per rank: comparable across EP sizes on a small machine
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    dims = ParallelDims(world_size=world, rank=rank, ep=world, ranks_per_node=args.ranks_per_node).build_groups()
    cfg = layer_config(world, args.ranks_per_node)
    torch.manual_seed(0)
    moe = MoE(cfg)
    moe.init_weights(0.02)
    for p in moe.shared_experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    moe = add_latency(apply_ep(moe, dims), args.latency_ms / 1e3) if world > 1 else moe
    moe.train()
    x = torch.randn(1, args.tokens, cfg.dim, generator=torch.Generator().manual_seed(rank))
    times = []
    for i in range(args.warmup + args.iters):
        if i == args.warmup and hasattr(moe.dispatcher, "stats"):
            moe.dispatcher.stats.reset()
        dist.barrier()
        t0 = time.perf_counter()
        moe(x).square().mean().backward()
        times.append(time.perf_counter() - t0)
    step = sum(times[args.warmup:]) / args.iters
    comm = 0.0
    if hasattr(moe.dispatcher, "stats"):
        s = moe.dispatcher.stats
        comm = (s.dispatch_s + s.combine_s) / args.iters
    res = torch.tensor([step, comm], dtype=torch.float64)
    dist.all_reduce(res, op=dist.ReduceOp.MAX)
    if rank == 0:
        out[world] = (res[0].item(), res[1].item())
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=1)
    ap.add_argument("--latency-ms", type=float, default=0.0, help="injected latency per all-to-all")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = mp.Manager().dict()
    for ep in args.ep:
        store = Path(tempfile.mkdtemp()) / "store"
        mp.spawn(worker, args=(ep, str(store), args, results), nprocs=ep, join=True)
    print(f"MoE layer: dim 256, 16 experts (top-4, 1 shared), expert dim 128, {args.tokens} tokens/rank, fwd+bwd")
    print("| EP | step (ms, slowest rank) | aggregate tokens/s | dispatch+combine share |")
    print("|---|---|---|---|")
    for ep in args.ep:
        step, comm = results[ep]
        print(f"| {ep} | {step * 1e3:.1f} | {ep * args.tokens / step:,.0f} | {comm / step:.0%} |")


if __name__ == "__main__":
    main()
