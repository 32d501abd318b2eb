"""Memory-mapped token data at scale (CPU): start-up time and resident memory of the trainer on a large
synthetic corpus vs a 1M-token one, and the loader's random-window rate vs the tiny trainer's token rate.

    python -m bench.data_loader_bench --tokens 1e9 --dir /tmp/dsv3-bench-tokens

The corpus is generated directly as token shards (Megatron .bin/.idx via data.shards.write_shard: random
ids below the tiny model's vocabulary, documents of 500-4,000 tokens, EOS-terminated), not tokenized. Each
trainer run is a fresh process (``+exp=tiny``, ``data.blend=[{path: ...}]``, 3 steps, no validation, no
checkpoint): it reports the seconds from process start to a built Trainer, VmRSS then, and the peak RSS after
the steps. The loader rate is ``BlendedBatches.next_batch`` of the tiny batch (16 x 128 tokens) over the
large corpus, single process, compared with the tiny trainer's median tokens/s in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
VOCAB, EOS = 1024, 0

CHILD = r"""
import json, resource, sys, time
t0 = float(sys.argv[1])
from configs.schema import compose, validate
from trainer.train import Trainer
cfg = validate(compose(sys.argv[3:]))
tr = Trainer(cfg, sys.argv[2])
built = time.time() - t0
def rss(key="VmRSS:"):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
rss_built = rss()
tr.train()
rows = [json.loads(l) for l in open(sys.argv[2] + "/metrics.jsonl")]
print("RESULT " + json.dumps({"startup_s": built, "rss_built_mb": rss_built / 2**20,
      "rss_anon_mb": rss("RssAnon:") / 2**20, "rss_file_mb": rss("RssFile:") / 2**20,
      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
      "tokens_per_s": sorted(r["tokens_per_s"] for r in rows[1:])[len(rows[1:]) // 2]}))
"""


def make_corpus(prefix_dir: Path, n_tokens: int, n_shards: int, seed: int = 0) -> Path:
    """``n_shards`` Megatron shards totalling about ``n_tokens`` (skipped when already there)."""
    from data.shards import write_shard
    prefix_dir.mkdir(parents=True, exist_ok=True)
    done = prefix_dir / "done.json"
    if done.exists() and json.loads(done.read_text())["target"] == n_tokens:
        return prefix_dir
    rng = np.random.default_rng(seed)
    per_shard = n_tokens // n_shards

    def docs():
        left = per_shard
        while left > 0:
            n = int(min(left, rng.integers(500, 4000)))
            doc = rng.integers(1, VOCAB, n, dtype=np.uint16)
            doc[-1] = EOS
            left -= n
            yield doc
    total = 0
    for k in range(n_shards):
        total += write_shard(prefix_dir / f"shard-{k:05d}", docs(), np.uint16)["tokens"]
    done.write_text(json.dumps({"target": n_tokens, "tokens": total}))
    return prefix_dir


def run_trainer(corpus: Path, run_dir: Path) -> dict:
    overrides = ["+exp=tiny", f"data.blend=[{{path: {corpus}}}]", "train.max_steps=3", "train.eval_every=0",
                 "logging.wandb.mode=disabled", "logging.progress=false", "checkpoint.save_final=false",
                 f"checkpoint.dir={run_dir}/ck"]
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, repr(time.time()), str(run_dir), *overrides], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])


def loader_rate(corpus: Path, seconds: float = 5.0) -> float:
    from data.blend import BlendedBatches
    from data.shards import open_tokens
    b = BlendedBatches([open_tokens(str(corpus))], [1.0], ["big"], seq_len=128, seed=0)
    b.next_batch(16)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        b.next_batch(16)
        n += 16 * 128
    return n / (time.perf_counter() - t0)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=float, default=1e9)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/dsv3-bench-tokens"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    big = make_corpus(args.dir / f"big-{int(args.tokens)}", int(args.tokens), args.shards)
    small = make_corpus(args.dir / "small-1000000", 1_000_000, 1)
    gen_s = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in big.glob("*.bin"))
    out = {"corpus_tokens": json.loads((big / "done.json").read_text())["tokens"], "corpus_bytes": size,
           "generate_s": gen_s, "load_avg_1min": os.getloadavg()[0]}
    out["small"] = run_trainer(small, args.dir / "run-small")
    out["big"] = run_trainer(big, args.dir / "run-big")
    out["loader_tokens_per_s"] = loader_rate(big)
    out["loader_over_trainer"] = out["loader_tokens_per_s"] / out["big"]["tokens_per_s"]
    out["rss_delta_mb"] = out["big"]["peak_rss_mb"] - out["small"]["peak_rss_mb"]
    print(json.dumps(out, indent=1))
    print(f"{out['corpus_tokens'] / 1e9:.2f}B tokens ({size / 2**30:.1f} GiB, {args.shards} shards): start-up "
          f"{out['big']['startup_s']:.1f} s (1M corpus: {out['small']['startup_s']:.1f} s); peak RSS "
          f"{out['big']['peak_rss_mb']:.0f} MB vs {out['small']['peak_rss_mb']:.0f} MB (delta {out['rss_delta_mb']:+.0f} MB); "
          f"loader {out['loader_tokens_per_s']:.3g} tok/s = {out['loader_over_trainer']:.0f}x the tiny trainer "
          f"({out['big']['tokens_per_s']:.0f} tok/s); 1-min load {out['load_avg_1min']:.2f}")
    return out


if __name__ == "__main__":
    main()
