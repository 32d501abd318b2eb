"""Zero-bubble B/W split on CPU: deferred weight-gradient GEMMs (``parallel/wgrad.py``) vs re-traversal.

    python bench/wgrad_split.py [--dim 512] [--seq 256] [--micro-batch 2] [--repeats 9] [--threads 1]

One middle pipeline stage (input activation in, activation out) of the tiny preset scaled up: a dense
block and a MoE block (MLA, 8 routed experts top-2 + 1 shared, FP32). Per repeat, a fresh forward and
then one backward variant, round-robin so that a shared machine's load drifts over all alike; medians:

- ``full``     plain backward of the unconverted stage (``torch.autograd.backward``);
- ``full*``    the same on the converted stage outside ``collect`` (the modules' own cost);
- ``B``, ``W`` ``queue.backward`` (input gradient + norms + gate, dW GEMMs queued), ``queue.run``;
- ``old B``, ``old W``  re-traversal: ``inputs=[x], retain_graph=True``, then ``inputs=params``;
- ``dW GEMMs`` the queued closures alone (no accumulation): what W cannot do without.

The target: ``(B + W) / full <= 1.10`` and W close to the dW GEMMs. Each part is timed on
the wall clock and on this thread's CPU clock (``time.thread_time``; with ``--threads 1`` all compute is on
this thread): on a shared machine the CPU clock does not count the time other jobs held the core.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import ModelConfig, build  # noqa: E402
from models.steps import drive  # noqa: E402
from parallel.pipeline.stages import Stage  # noqa: E402
from parallel.wgrad import WeightGradQueue, apply_deferred_wgrad  # noqa: E402

MODES = ("full", "full*", "B+W", "old B+W", "dW GEMMs")


def model_config(d: int) -> ModelConfig:
    """The tiny preset (dim 128) scaled by d/128, two layers: dense, then MoE; no MTP."""
    k = d // 128
    return ModelConfig(vocab_size=1024, dim=d, n_layers=2, first_k_dense=1, inter_dim=3 * d, n_heads=4,
                       q_lora_rank=d // 2, kv_lora_rank=d // 4, qk_nope_head_dim=32 * k, qk_rope_head_dim=16 * k,
                       v_head_dim=32 * k, max_seq_len=4096, moe_inter_dim=d // 2, n_routed_experts=8,
                       n_shared_experts=1, n_activated_experts=2, n_expert_groups=2, n_limited_groups=1,
                       route_scale=2.5, mtp_depth=0, init_std=0.02)


class Bench:
    def __init__(self, args):
        cfg = model_config(args.dim)
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq), generator=g)
        self.x = torch.randn(args.micro_batch, args.seq, cfg.dim, generator=g)
        self.dy = torch.randn(args.micro_batch, args.seq, cfg.dim, generator=g)
        self.plain = Stage(build(cfg, seed=0).train(), 1, 3, range(0, 2))     # a middle stage: layers 0, 1
        self.queue = WeightGradQueue()
        model = build(cfg, seed=0).train()
        apply_deferred_wgrad(model, self.queue)
        self.deferred = Stage(model, 1, 3, range(0, 2))

    def forward(self, stage: Stage):
        stage.zero_grad(set_to_none=True)
        x = self.x.clone().requires_grad_()
        out, _, aux = drive(stage.steps(x, self.ids, self.ids))
        return x, [out, 1e-3 * aux], [self.dy, None]

    def run(self, mode: str) -> dict[str, tuple[float, float]]:
        """One repeat of ``mode``; returns the timed parts as (wall s, CPU s)."""
        stage = self.plain if mode in ("full", "old B+W") else self.deferred
        x, tensors, grads = self.forward(stage)
        params = [p for p in stage.parameters() if p.requires_grad]
        if mode in ("full", "full*"):
            return {mode: timed(torch.autograd.backward, tensors, grads)}
        if mode == "old B+W":
            return {"old B": timed(torch.autograd.backward, tensors, grads, inputs=[x], retain_graph=True),
                    "old W": timed(torch.autograd.backward, tensors, grads, inputs=params)}
        if mode == "B+W":
            return {"B": timed(self.queue.backward, "mb", tensors, grads, [x], params),
                    "W": timed(self.queue.run, "mb")}
        with self.queue.collect("mb") as segment:                      # dW GEMMs alone
            torch.autograd.backward(tensors, grads, inputs=self.queue.b_inputs([x], params))
        t = timed(lambda: [compute() for _, compute in segment])
        self.queue.run("mb")                                          # not timed: clears the key
        return {"dW GEMMs": t}


def timed(fn, *args, **kwargs) -> tuple[float, float]:
    """``fn(*args, **kwargs)``'s (wall, this thread's CPU) seconds."""
    w0, c0 = time.perf_counter(), time.thread_time()
    fn(*args, **kwargs)
    return time.perf_counter() - w0, time.thread_time() - c0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    bench = Bench(args)
    for mode in MODES:                                                # warm-up
        bench.run(mode)
    times: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.repeats):
        for mode in MODES:
            for part, t in bench.run(mode).items():
                times.setdefault(part, []).append(t)
    report(args, {part: [1e3 * statistics.median(t[i] for t in ts) for i in (0, 1)] for part, ts in times.items()})


def report(args, ms: dict[str, list[float]]) -> None:
    """A markdown table (wall and CPU ms, each / full backward) and the acceptance ratios."""
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"middle stage (dense + MoE block), dim {args.dim}, seq {args.seq}, micro-batch {args.micro_batch}, "
          f"fp32, {args.threads} thread(s), median of {args.repeats}; loadavg {load}")
    print("| part | wall ms | / full | CPU ms | / full |\n|---|---|---|---|---|")
    for part in ("full", "full*", "B", "W", "old B", "old W", "dW GEMMs"):
        cells = " | ".join(f"{ms[part][i]:.1f} | {ms[part][i] / ms['full'][i]:.2f}" for i in (0, 1))
        print(f"| {part} | {cells} |")
    for i, clock in enumerate(("wall", "CPU")):
        new = (ms["B"][i] + ms["W"][i]) / ms["full"][i]
        old = (ms["old B"][i] + ms["old W"][i]) / ms["full"][i]
        print(f"{clock}: (B + W) / full: deferred GEMMs {new:.3f}, re-traversal {old:.3f}; "
              f"W / dW GEMMs {ms['W'][i] / ms['dW GEMMs'][i]:.2f}")


if __name__ == "__main__":
    main()
