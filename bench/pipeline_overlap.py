"""How much expert all-to-all time DualPipe's overlapped F&B hides, measured on CPU processes.

    python bench/pipeline_overlap.py [--ep 1] [--latency-ms 2 4 8] [--steps 8] [--dim 128] [--rows 4]

pp=2 (DualPipe) x ep gloo processes, 8 micro-batches of ``--rows`` sequences of ``--seq`` tokens, a 5-layer
all-MoE model with MTP depth 1 (layout 3+2: both stages hold three MoE blocks). Every expert all-to-all is in
flight for ``--latency-ms`` of injected wire time (a deadline, ``bench/latency.py``), forward and backward; with
``--ep 2`` over the hierarchical dispatcher's two EP nodes. ``--ep 1`` (the default) keeps each rank's experts
local so 2 processes fit a 2-core machine: the single-device dispatcher with the latency on its two cuts
(``--ep1-route solo``: an all-to-all dispatcher over a one-rank group, whose worker thread competes with the
compute). For overlap off/on and latency 0/L it times the F&B actions and the whole step on the slowest rank,
best of ``--steps``, the configurations round-robin in an order reversed every other round, so a shared
machine's load drifts over all alike (the L = 0 overhead also as the median of each round's on / off ratio):

    hidden = 1 - (FB_on(L) - FB_on(0)) / (FB_off(L) - FB_off(0))

the share of the injected latency inside F&B actions that no longer adds to their time. Cross-check from
inside the overlapped F&Bs: ``1 - (wait_on(L) - wait_on(0)) / injected_on(L)``, the time blocked in waits for
transfers over the latency injected into them. It also reports the compute time of one piece of an overlapped
F&B at latency 0 (what one transfer can hide behind: 10th, 50th, 90th percentile) for each half.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.latency import add_latency  # noqa: E402
from models import ModelConfig, build  # noqa: E402
from parallel.dims import ParallelDims  # noqa: E402
from parallel.ep import AllToAllDispatcher, apply_ep  # noqa: E402
from parallel.pipeline import executor  # noqa: E402
from parallel.pipeline.overlap import run, run_pair  # noqa: E402
from parallel.pipeline.runner import PipelineRunner  # noqa: E402
from parallel.pipeline.schedules.actions import Kind  # noqa: E402

N_MB = 8
SEQ = ("on, halves in sequence", 0.0)   # the --sequential-halves configuration


def _in_sequence(a, b, timings=None):
    """``run_pair``'s stand-in for --sequential-halves: the same cut tapes, the halves not interleaved."""
    return run(a), run(b)


def worker(rank, world, store, args, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    dims = ParallelDims(world_size=world, rank=rank, pp=2, ep=args.ep).build_groups()
    solo = [dist.new_group([r]) for r in range(world)][rank]   # every rank creates every group
    d = args.dim
    cfg = ModelConfig(vocab_size=256, dim=d, n_layers=5, first_k_dense=0, inter_dim=2 * d, n_heads=4,
                      q_lora_rank=d // 2, kv_lora_rank=d // 2, qk_nope_head_dim=d // 8, qk_rope_head_dim=d // 16,
                      v_head_dim=d // 8, moe_inter_dim=args.moe_inter or d, n_routed_experts=8, n_activated_experts=2,
                      n_expert_groups=2, n_limited_groups=1, mtp_depth=1)
    ids = torch.randint(0, cfg.vocab_size, (N_MB * args.rows, args.seq + 1),
                        generator=torch.Generator().manual_seed(rank % 2))
    mbs = [(ids[i * args.rows:(i + 1) * args.rows, :-1], ids[i * args.rows:(i + 1) * args.rows, 1:])
           for i in range(N_MB)]
    runners = {}
    for overlap in (False, True):
        for latency in [0.0] + args.latency_ms:
            model = apply_ep(build(cfg, seed=0), dims).train()
            if args.ep == 1 and args.ep1_route == "solo":
                for moe in model.moe_layers():
                    moe.dispatcher = AllToAllDispatcher(cfg.n_routed_experts, solo, 1)
            add_latency(model, latency / 1e3)
            runners[(overlap, latency)] = (model, PipelineRunner.from_model(model, dims, "dualpipe", N_MB, layout=[3, 2],
                                                                 overlap=overlap))
    if args.sequential_halves:   # overlap on at L = 0, but each F&B's halves run one after the other
        model = apply_ep(build(cfg, seed=0), dims).train()
        runners[SEQ] = (model, PipelineRunner.from_model(model, dims, "dualpipe", N_MB, layout=[3, 2], overlap=True))
    # Round robin over the configurations, one step each, so that the load of a shared machine drifts
    # over all of them alike; the best of the timed steps counts (the first round is warm-up). The order is
    # reversed every other round, so that no configuration always runs first after the barrier.
    fb, step, pieces, waits = ({k: [] for k in runners} for _ in range(4))
    for i in range(1 + args.steps):
        order = list(runners.items())
        for key, (model, runner) in order if i % 2 else order[::-1]:   # alternate: no configuration always first
            dist.barrier()
            executor.run_pair = _in_sequence if key == SEQ else run_pair
            start = time.perf_counter()
            runner.forward_backward(mbs, 1.0 / N_MB, 0.3, 1e-4)
            fbp = runner.executor.state.fb_pieces
            t = torch.tensor([sum(runner.executor.durations.get(Kind.FB, [])), time.perf_counter() - start,
                              sum(w for *_, w, _ in fbp), sum(inj or 0.0 for *_, inj in fbp)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)   # the slowest rank (the same counts on both)
            model.zero_grad(set_to_none=True)
            if i:
                fb[key].append(float(t[0]))
                step[key].append(float(t[1]))
                waits[key].append((float(t[2]), float(t[3])))
                pieces[key] += fbp
    if rank == 0:
        for key in runners:
            med = [statistics.quantiles([c for h, c, *_ in pieces[key] if h == half], n=10)[::4] if pieces[key]
                   else [0.0, 0.0, 0.0] for half in (0, 1)]   # 10th, 50th, 90th percentile
            out[key] = (min(fb[key]), min(step[key]), min(w for w, _ in waits[key]), waits[key][0][1], *med)
        out["rounds"] = [on / off - 1 for on, off in zip(fb[(True, 0.0)], fb[(False, 0.0)])]
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[4.0])
    ap.add_argument("--ep", type=int, default=1, choices=(1, 2))
    ap.add_argument("--ep1-route", choices=("local", "solo"), default="local",
                    help="with --ep 1: the single-device dispatcher with latency on its cuts (local), or an all-to-all "
                         "dispatcher over a one-rank gloo group (solo: its worker thread copies the rows, competing "
                         "with the compute for the 2 cores when overlapped)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--moe-inter", type=int, default=0, help="expert hidden size (default: --dim)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rows", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--sequential-halves", action="store_true",
                    help="also time overlap on at L = 0 with each F&B's halves run one after the other on their cut "
                         "tapes: splits the L = 0 overhead into the cuts' share and the interleaving's")
    args = ap.parse_args()
    out = mp.Manager().dict()
    store = Path(tempfile.mkdtemp()) / "store"
    world = 2 * args.ep
    mp.spawn(worker, args=(world, str(store), args, out), nprocs=world, join=True)
    route = f", EP=1 route {args.ep1_route}" if args.ep == 1 else ""
    print(f"DualPipe pp=2 x EP={args.ep}{route} ({world} CPU processes), {N_MB} micro-batches of {args.rows}x{args.seq} "
          f"tokens, dim {args.dim}, expert dim {args.moe_inter or args.dim}, injected latency {args.latency_ms} ms "
          "per all-to-all")
    fwd, bwd = (" / ".join(f"{t * 1e3:.1f}" for t in q) for q in out[(True, 0.0)][4:])
    print(f"compute per piece of an overlapped F&B at latency 0, 10th / 50th / 90th percentile: forward half "
          f"{fwd} ms, backward half {bwd} ms")
    print("| overlap | latency (ms) | F&B time per step (s) | step time (s) |")
    print("|---|---|---|---|")
    for (overlap, lat), (fb, step, *_) in sorted((k, v) for k, v in out.items() if k not in (SEQ, "rounds")):
        print(f"| {'on' if overlap else 'off'} | {lat:g} | {fb:.3f} | {step:.3f} |")
    if SEQ in out:
        print(f"| {SEQ[0]} | 0 | {out[SEQ][0]:.3f} | {out[SEQ][1]:.3f} |")
    base = out[(False, 0.0)][0]
    print(f"L = 0 overhead of overlap on vs off (F&B time): {out[(True, 0.0)][0] / base - 1:+.1%}"
          + (f"; the cuts alone (halves in sequence): {out[SEQ][0] / base - 1:+.1%}" if SEQ in out else ""))
    q = statistics.quantiles(out["rounds"], n=4) if len(out["rounds"]) > 1 else out["rounds"] * 3
    print(f"the same, paired: median of the per-round ratios {q[1]:+.1%} (quartiles {q[0]:+.1%} .. {q[2]:+.1%}, "
          f"{len(out['rounds'])} rounds)")
    print("hidden = 1 - (FB_on(L) - FB_on(0)) / (FB_off(L) - FB_off(0)); cross-check from inside the overlapped "
          "F&Bs: 1 - (wait_on(L) - wait_on(0)) / injected_on(L), wait = time blocked on transfers per step, "
          "injected_on = the latency injected into the transfers waited for")
    print("| latency (ms) | injected into F&Bs, overlap off (s) | exposed, overlap on (s) | hidden | "
          "injected_on (s) | wait_on (s) | hidden (waits) |")
    print("|---|---|---|---|---|---|---|")
    for L in args.latency_ms:
        injected = out[(False, L)][0] - out[(False, 0.0)][0]
        exposed = out[(True, L)][0] - out[(True, 0.0)][0]
        wait_exposed = out[(True, L)][2] - out[(True, 0.0)][2]
        n = out[(True, L)][3]
        print(f"| {L:g} | {injected:.3f} | {exposed:.3f} | {1 - exposed / injected:.0%} | {n:.3f} | "
              f"{out[(True, L)][2]:.3f} | " + (f"{1 - wait_exposed / n:.0%} |" if n else "– |"))


if __name__ == "__main__":
    main()
