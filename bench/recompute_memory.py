"""Peak activation memory per rank with ``train.recompute`` none / selective / full, measured on CPU
processes, next to ``tools.size``'s prediction for the same layout.

    python bench/recompute_memory.py [--modes none selective full] [--seq 128] [--rows 2] [--micro 8] [--time N]

The tiny model scaled to dim 512 (``SCALED``: inter 1536, MoE inter 256, q/kv latents 256/128, 8 heads of
64+32 / 64; 4 layers, 8 experts top-2, MTP 1; fp32), DualPipe pp=2 (2 gloo processes, F&B overlap on),
``--micro`` micro-batches of ``--rows`` x ``--seq`` tokens. Each rank builds its model as the trainer does
(``trainer.startup.build_model``, which applies ``train.recompute``), runs one step to create the
gradients, then measures a second step two ways:

- saved: bytes of the distinct storages that autograd keeps for backward (``saved_tensors_hooks``: a
  storage counts from the first time it is saved until the last graph holding it lets go), peak over the
  step. What ``tools.size`` models without the recomputation working set.
- alive: bytes of every storage created during the step and still alive (a ``TorchDispatchMode`` sees
  each op's outputs; ``StorageWeakRef`` tells when a storage is freed), peak over the step. The
  allocator's view: saved tensors plus recomputed ones, gradients of activations, logits, p2p buffers.

Predicted: ``trainer.memory_plan.plan_memory(recipe="trainer", math_attention=True)`` (PyTorch's math SDPA on CPU
keeps the attention probabilities) for the same config: ``act_peak`` (with the recomputation working set)
and ``act_peak`` less that working set (to compare with ``saved``).

``--time N`` also times the recomputation (``time_modes``): one forward + backward of the main model per
mode, with the backward whole or split into B and W (W recomputes the regions B recomputed).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models  # noqa: E402
from configs.schema import compose  # noqa: E402
from models.layers import rope_cos_sin  # noqa: E402
from parallel.dims import ParallelDims  # noqa: E402
from parallel.recompute import apply_recompute  # noqa: E402
from trainer.memory_plan import plan_memory  # noqa: E402
from trainer.startup import build_model  # noqa: E402

SCALED = ["model.dim=512", "model.inter_dim=1536", "model.moe_inter_dim=256", "model.q_lora_rank=256",
          "model.kv_lora_rank=128", "model.n_heads=8", "model.qk_nope_head_dim=64", "model.qk_rope_head_dim=32",
          "model.v_head_dim=64"]
MB = 2 ** 20


class SavedBytes:
    """Peak bytes of the distinct storages held by autograd's saved tensors (parameters excluded)."""

    def __init__(self, exclude: set[int]):
        self.exclude, self.count, self.size = exclude, {}, {}
        self.cur = self.peak = 0

    def pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.exclude or ptr == 0:
            return t
        if ptr not in self.count:
            self.count[ptr], self.size[ptr] = 0, t.untyped_storage().nbytes()
            self.cur += self.size[ptr]
            self.peak = max(self.peak, self.cur)
        self.count[ptr] += 1
        return _Held(t, ptr, self)

    @staticmethod
    def unpack(held):
        return held.t if isinstance(held, _Held) else held

    def release(self, ptr: int) -> None:
        self.count[ptr] -= 1
        if not self.count[ptr]:
            del self.count[ptr]
            self.cur -= self.size.pop(ptr)


class _Held:
    def __init__(self, t, ptr, owner):
        self.t, self.ptr, self.owner = t, ptr, owner

    def __del__(self):
        self.owner.release(self.ptr)


class AliveBytes(TorchDispatchMode):
    """Peak bytes of the storages that ops return while the mode is on and that are still alive, but for
    ``exclude`` (the storages that were there before: parameters, gradients, buffers)."""

    def __init__(self, exclude: set[int]):
        super().__init__()
        self.exclude = exclude
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.cur = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for ptr in [p for p, (ref, _) in self.refs.items() if ref.expired()]:
            self.cur -= self.refs.pop(ptr)[1]
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                s = t.untyped_storage()
                if s.data_ptr() and s.data_ptr() not in self.refs and s.data_ptr() not in self.exclude:
                    self.refs[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
                    self.cur += s.nbytes()
        self.peak = max(self.peak, self.cur)
        return out


def config(mode: str, args):
    return compose(["+exp=tiny", *SCALED, "parallel.pp=2", "parallel.schedule=dualpipe", f"train.recompute={mode}",
                    f"data.seq_len={args.seq}", f"train.micro_batch_size={args.rows}",
                    f"train.global_batch_size={args.rows * args.micro}"])


def worker(rank: int, world: int, store: str, args, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    dims = ParallelDims(world_size=world, rank=rank, pp=2).build_groups()
    for mode in args.modes:
        cfg = config(mode, args)
        model, pipe = build_model(cfg, dims, torch.device("cpu"), on_meta=False)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.model.vocab_size, (args.micro, args.rows, args.seq + 1), generator=g)
        mbs = [(m[:, :-1], m[:, 1:]) for m in ids]
        pipe.forward_backward(mbs, 1.0 / args.micro, 0.3, 1e-4)   # creates the gradients
        state = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None)]
        before = {t.untyped_storage().data_ptr() for t in state}
        saved = SavedBytes(before)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            pipe.forward_backward(mbs, 1.0 / args.micro, 0.3, 1e-4)
        alive = AliveBytes(before)
        with alive:
            pipe.forward_backward(mbs, 1.0 / args.micro, 0.3, 1e-4)
        out[(rank, mode)] = (saved.peak, alive.peak)
        del model, pipe
    dist.barrier()
    dist.destroy_process_group()


def predicted(mode: str, args) -> list[tuple[float, float]]:
    """Per pipeline rank: (act_peak, act_peak less the recomputation working set), bytes."""
    plan = plan_memory(config(mode, args), world_size=2, recipe="trainer", math_attention=True)
    return [(r.act_peak, r.act_peak - r.act_recompute) for r in plan.ranks]


def measure(args) -> list[dict]:
    """One row per (mode, pipeline rank): measured and predicted bytes (keys in ``main``'s table)."""
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(2, f"{tmp}/store", args, out), nprocs=2, join=True)
        got = dict(out)
    rows = []
    for mode in args.modes:
        for r, (peak, peak_saved) in enumerate(predicted(mode, args)):
            saved, alive = got[(r, mode)]
            rows.append({"mode": mode, "rank": r, "saved": saved, "saved_predicted": peak_saved, "alive": alive,
                         "alive_predicted": peak})
    return rows


def time_modes(args) -> dict[tuple[str, str], float]:
    """One process, one thread, the main model's layers + head on one micro-batch: best seconds of ``--time``
    forward + backward runs per (mode, backward): ``BW`` one backward; ``B+W`` an input-gradient backward
    (``retain_graph``) then a weight-gradient one, as the zero-bubble split runs them. Round-robin."""
    torch.set_num_threads(1)
    best: dict[tuple[str, str], float] = {}
    setups = {}
    for mode in args.modes:
        model = models.build(config(mode, args).model, seed=0).train()
        apply_recompute(model, mode)
        setups[mode] = model
    ids = torch.randint(0, 1024, (args.rows, args.seq), generator=torch.Generator().manual_seed(0))
    for _ in range(args.time):
        for mode, model in setups.items():
            for split in ("BW", "B+W"):
                x = model.embed(ids).detach().requires_grad_()
                params = [p for p in model.parameters() if p.requires_grad]
                t0 = time.perf_counter()
                loss = _layers_loss(model, x, ids)
                if split == "BW":
                    loss.backward()
                else:
                    torch.autograd.backward([loss], inputs=[x], retain_graph=True)
                    torch.autograd.backward([loss], inputs=params)
                t = time.perf_counter() - t0
                best[(mode, split)] = min(best.get((mode, split), t), t)
    return best


def _layers_loss(model, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    rope = rope_cos_sin(model.cfg, ids.shape[1], x.device)
    for layer in model.layers:
        x = layer(x, rope)
    return F.cross_entropy(model.head(model.norm(x)).flatten(0, 1), ids.flatten())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["none", "selective", "full"])
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--time", type=int, default=0, help="also time N forward+backward runs per mode (one process)")
    return ap.parse_args(argv)


def main() -> int:
    args = parse_args()
    rows = measure(args)
    print(f"DualPipe pp=2, tiny scaled to dim 512, fp32, {args.micro} micro-batches of {args.rows} x {args.seq} "
          f"tokens; MiB per rank")
    print(f"{'recompute':<10} {'rank':>4} {'saved':>8} {'predicted':>9} {'err':>7}   {'alive':>8} "
          f"{'predicted':>9} {'err':>7}")
    for x in rows:
        print(f"{x['mode']:<10} {x['rank']:>4} {x['saved'] / MB:>8.1f} {x['saved_predicted'] / MB:>9.1f} "
              f"{x['saved_predicted'] / x['saved'] - 1:>+7.1%}   {x['alive'] / MB:>8.1f} "
              f"{x['alive_predicted'] / MB:>9.1f} {x['alive_predicted'] / x['alive'] - 1:>+7.1%}")
    if args.time:
        best = time_modes(args)
        base = best[(args.modes[0], "BW")]
        print(f"forward + backward of one micro-batch ({args.rows} x {args.seq} tokens, main model, one thread), "
              f"best of {args.time}, relative to {args.modes[0]} BW ({base * 1e3:.0f} ms):")
        for (mode, split), t in best.items():
            print(f"  {mode:<10} {split:<4} {t * 1e3:7.0f} ms  x{t / base:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
