"""Training-state memory per rank with BF16 weights + FP32 master vs FP32 weights (CPU processes, gloo).

    python bench/master_memory.py [--dim 512] [--world 2] [--zero 0 1]

For each ZeRO stage and weight dtype, ``world`` data-parallel ranks build the tiny preset widened to
``--dim``, build the optimizer as the trainer does (``build_optimizer(..., weights=Precision(precision).weights)``),
run two micro-batches (BF16 autocast as the trainer's bf16 runs) and stop before the update, when the
gradients of the step are all held. Rank 0 reports, in MiB: the live tensors by role (parameters,
gradients as held then, the FP32 master, the AdamW moments), the optimizer's own ``memory()`` formula
(``parallel/zero/memory.py``), and the process RSS growth from start-up to that point (activations and
allocator slack included; on CPU the closest thing to a per-rank memory measurement).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models  # noqa: E402
from configs.presets import model_preset  # noqa: E402
from configs.schema import OptimConfig  # noqa: E402
from parallel.dims import ParallelDims  # noqa: E402
from parallel.ep import apply_ep  # noqa: E402
from parallel.zero import build_optimizer  # noqa: E402

MiB = 2**20


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _live(opt) -> dict[str, int]:
    """Bytes of the tensors each role holds now (the optimizer's internals, read directly)."""
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts if t is not None)  # noqa: E731
    params = [p for p in opt.model.parameters()]
    grads = [p.grad for p in params] + list(getattr(opt, "fp32_grads", None) and opt.fp32_grads.grads.values() or [])
    if hasattr(opt, "buckets"):   # native ZeRO
        grads += [b.grad for b in opt.buckets]
        master, moments = [b.master for b in opt.buckets], [t for b in opt.buckets for t in (b.exp_avg, b.exp_avg_sq)]
    else:                          # Replicated
        master = [t for _, t in opt.named] if opt.fp32_grads is not None else []
        moments = [s[k] for s in opt.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    return {"params": nbytes(params), "grads": nbytes(grads), "master": nbytes(master), "optim": nbytes(moments)}


def worker(rank, world, store, args, zero, weights, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    rss0 = _rss()
    cfg = dataclasses.replace(model_preset("tiny"), dim=args.dim)
    dims = ParallelDims(world_size=world, rank=rank).build_groups()
    model = apply_ep(models.build(cfg, seed=0), dims)
    opt = build_optimizer(model, OptimConfig(), dims, zero, weights=weights)   # default moments (auto)
    ids = torch.randint(0, cfg.vocab_size, (2, 128), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model.compute_loss(ids, ids, mtp_weight=0.3, aux_alpha=1e-4).loss / 2
        opt.backward(loss)
    live, rss = _live(opt), _rss() - rss0
    opt.step(1.0)
    rep = opt.memory()
    if rank == 0:
        out.put((zero, weights, live, rep.measured, rep.formula, rss, rep.dense_params + rep.expert_params))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--zero", type=int, nargs="+", default=[0, 1])
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    print(f"dim {args.dim}, dp {args.world}; MiB per rank (live tensors before the update | memory() formula); "
          "RSS growth to that point")
    for zero in args.zero:
        for weights in ("fp32", "bf16"):
            q = ctx.Queue()
            with tempfile.TemporaryDirectory() as tmp:
                mp.spawn(worker, args=(args.world, f"{tmp}/store", args, zero, weights, q), nprocs=args.world)
            _, _, live, measured, formula, rss, n = q.get()
            cells = "  ".join(f"{k} {live[k] / MiB:7.1f} | {formula[k] / MiB:7.1f}" for k in live)
            print(f"zero={zero} {weights} weights ({n / 1e6:.1f}M params): {cells}  state {sum(live.values()) / MiB:7.1f}"
                  f" | {sum(formula.values()) / MiB:7.1f}  RSS +{rss / MiB:.0f}")


if __name__ == "__main__":
    main()
