"""Step-time cost of a checkpoint save, synchronous vs ``checkpoint.async_save``, on this machine.

Trains ``+exp=tiny`` (plus any ``key=value`` overrides) in-process with ``checkpoint.async_save=true`` and
drives the saves itself: the run is cut into cycles of ``--every`` steps, and the boundary before each cycle
does, in turn, nothing, a synchronous save, or a background save of the step just finished. A cycle's time runs
from its boundary to the next one, so it holds its save (or, in the background, the write overlapping its
steps) and its ``--every`` steps. Interleaving the three in one run puts them under the same machine load (the
machine may be shared: the load average before and after is printed; compare numbers from one invocation only).

Per kind: the median cycle; the cost of a save, the median over rounds (a round: one cycle of each kind, in
a row) of its cycle minus the round's cycle without a save; and how long the save held the training loop (the
synchronous save; the background save's staging).

    python -m bench.checkpoint_async [--cycles 20] [--every 2] [--threads 1] [key=value ...]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_module

from configs.schema import register, to_object, validate

KINDS = ("none", "sync", "async")


def config(overrides: list[str]):
    register()
    with initialize_config_module("configs", version_base=None):
        return validate(to_object(compose("config", overrides=["+exp=tiny", *overrides])), 1)


def measure(tmp: Path, overrides: list[str], every: int, cycles: int) -> dict[str, dict[str, list[float]]]:
    """{kind: {"cycle": seconds per cycle, "held": seconds the save held the loop}}; the first round is left out."""
    from trainer.train import Trainer
    trainer = Trainer(config([*overrides, f"train.max_steps={every * len(KINDS) * (cycles + 1) + 1}"]), tmp / "run")
    out = {k: {"cycle": [], "held": []} for k in KINDS}
    marks: list[tuple[str, float, int]] = []   # (kind, when its cycle began, at which step)
    warm = every * len(KINDS)                   # the first round warms up
    train_step = trainer.train_step

    def step():
        if trainer.step % every == 0:
            t0 = time.perf_counter()
            kind = KINDS[(trainer.step // every) % len(KINDS)]
            if kind != "none":
                trainer._save_once(background=kind == "async")
            if marks and marks[-1][2] >= warm:
                k, began, _ = marks[-1]
                out[k]["cycle"].append(t0 - began)
            if trainer.step >= warm and kind != "none":
                out[kind]["held"].append(time.perf_counter() - t0)
            marks.append((kind, t0, trainer.step))
        return train_step()
    trainer.train_step = step
    trainer.train()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=20, help="cycles of each kind measured")
    p.add_argument("--every", type=int, default=2, help="steps per cycle")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steady on a shared machine)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        common = [f"data.cache_dir={tmp / 'cache'}", "logging.wandb.mode=disabled", "logging.progress=false",
                  "logging.log_every=0", "train.eval_every=0", "checkpoint.save_final=false", "checkpoint.keep=2",
                  "checkpoint.async_save=true", *args.overrides]
        out = measure(tmp, common, args.every, args.cycles)
        ck = tmp / "run" / "checkpoints"
        state_mb = sum(f.stat().st_size for f in ck.glob("step_*/*")) / len(list(ck.glob("step_*"))) / 2**20
    load1 = os.getloadavg()
    cycle = {k: statistics.median(out[k]["cycle"]) for k in KINDS}
    cost = {k: statistics.median(c - n for c, n in zip(out[k]["cycle"], out["none"]["cycle"]))
            for k in ("sync", "async")}
    step = cycle["none"] / args.every
    print(f"a cycle: {args.every} steps; {len(out['none']['cycle'])} rounds; checkpoint {state_mb:.1f} MiB; torch "
          f"threads {args.threads}; load average {load0[0]:.1f} -> {load1[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"step without a save: {step * 1e3:.0f} ms (median cycle {cycle['none']:.3f} s)")
    for k in ("sync", "async"):
        print(f"{k:>5}: median cycle {cycle[k]:.3f} s, a save costs {cost[k] * 1e3:.0f} ms "
              f"({cost[k] / step:.2f} steps), held the loop {statistics.median(out[k]['held']) * 1e3:.0f} ms")
    print(f"async / sync: {cost['async'] / cost['sync']:.2f}")


if __name__ == "__main__":
    main()
