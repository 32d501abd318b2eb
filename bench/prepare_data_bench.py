"""Throughput of ``python -m tools.prepare_data`` on a synthetic corpus, and the kill-midway + re-run check.

    python bench/prepare_data_bench.py --mb 200 --workers 2          # corpus and outputs under /tmp

Generates (once; reused while the settings match) ``--mb`` MB of jsonl documents in ``--dir``: sentences of
pseudo-words drawn Zipf-like from a 50k-word vocabulary, 8 files. Trains a byte-level BPE (``--vocab``) on
the first 20 MB. Then, each as a subprocess: (1) an uninterrupted run, whose own summary line gives MB/s of
text and tokens/s (wall time from start to manifest, Arrow conversion of the inputs included); (2) a run
SIGKILLed once half of its shards are recorded, then (3) the same command again, which must produce
``manifest.json`` byte-identical to run (1)'s (every shard's sha256 is in it). Prints one line per run and
a verdict. CPU only; needs the project's venv, not a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
N_FILES, SEED = 8, 0


def make_corpus(d: Path, mb: int) -> list[str]:
    stamp = d / "corpus.json"
    files = [str(d / f"part-{i:02d}.jsonl") for i in range(N_FILES)]
    if stamp.exists() and json.loads(stamp.read_text()) == {"mb": mb, "seed": SEED}:
        return files
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    vocab = np.array(["".join(rng.choice(letters, n)) for n in rng.integers(2, 11, 50_000)])
    p = 1.0 / np.arange(1, len(vocab) + 1)
    p /= p.sum()
    per_file = mb * 1_000_000 // N_FILES
    for f in files:
        written = 0
        with open(f, "w") as out:
            while written < per_file:
                words = vocab[rng.choice(len(vocab), 200_000, p=p)]
                cuts = np.cumsum(rng.integers(8, 30, 20_000))             # sentence lengths
                sentences = [" ".join(words[a:b]).capitalize() + "."
                             for a, b in zip(cuts[:-1], cuts[1:]) if b <= len(words)]
                for k in range(0, len(sentences) - 20, 20):               # ~20 sentences a document
                    line = json.dumps({"text": " ".join(sentences[k:k + int(rng.integers(3, 40))])}) + "\n"
                    out.write(line)
                    written += len(line)
    stamp.write_text(json.dumps({"mb": mb, "seed": SEED}))
    return files


def train_tokenizer(files: list[str], vocab_size: int, path: Path) -> None:
    if path.exists():
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def sample():
        budget = 20_000_000
        with open(files[0]) as f:
            for line in f:
                budget -= len(line)
                if budget < 0:
                    return
                yield json.loads(line)["text"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(sample(), trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                          show_progress=False))
    tok.save(str(path))


def run(args: list[str], kill_when=None) -> tuple[float, str, int]:
    """-> (wall seconds, stdout, return code); ``kill_when()`` true -> SIGKILL the run."""
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tools.prepare_data", *args, "--no-progress"], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    if kill_when is not None:
        while proc.poll() is None and not kill_when():
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    out = proc.communicate()[0]
    return time.perf_counter() - t, out.strip(), proc.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=200, help="corpus size in MB (default 200)")
    ap.add_argument("--dir", default="/tmp/prepare_data_bench", help="corpus and outputs (default /tmp/...)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--docs-per-shard", type=int, default=4000)
    ap.add_argument("--vocab", type=int, default=32768)
    a = ap.parse_args()
    d = Path(a.dir)
    t = time.perf_counter()
    files = make_corpus(d / "corpus", a.mb)
    tok = d / f"tokenizer-{a.vocab}.json"
    train_tokenizer(files, a.vocab, tok)
    in_mb = sum(os.path.getsize(f) for f in files) / 1e6
    print(f"corpus: {in_mb:.0f} MB of jsonl in {len(files)} files, tokenizer vocab {a.vocab} "
          f"(ready in {time.perf_counter() - t:.0f} s); cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}")
    common = ["--input", str(d / "corpus" / "*.jsonl"), "--tokenizer", str(tok), "--workers", str(a.workers),
              "--docs-per-shard", str(a.docs_per_shard)]
    full, cut = d / "out-full", d / "out-killed"
    for p in (full, cut):
        shutil.rmtree(p, ignore_errors=True)

    secs, line, rc = run([*common, "--output", str(full)])
    assert rc == 0, line
    print(f"uninterrupted: {secs:.1f} s wall, {in_mb / secs:.2f} MB/s of jsonl; {line}")
    n_shards = len(json.loads((full / "manifest.json").read_text())["shards"])

    secs_k, _, rc_k = run([*common, "--output", str(cut)],
                          kill_when=lambda: len(list(cut.glob("*.done.json"))) >= n_shards // 2)
    done = len(list(cut.glob("*.done.json")))
    print(f"killed: SIGKILL after {secs_k:.1f} s (rc {rc_k}), {done}/{n_shards} shards recorded, "
          f"manifest written: {(cut / 'manifest.json').exists()}")
    secs_r, line_r, rc_r = run([*common, "--output", str(cut)])
    assert rc_r == 0, line_r
    same = (full / "manifest.json").read_bytes() == (cut / "manifest.json").read_bytes()
    print(f"re-run: {secs_r:.1f} s; {line_r}")
    print(f"kill + re-run: {secs_k + secs_r:.1f} s vs {secs:.1f} s uninterrupted; manifest byte-identical: {same}")
    m = re.search(r"([\d.]+) MB/s of text, ([\d,]+) tokens/s", line)
    print(f"RESULT prepare_data workers={a.workers}: {m.group(1)} MB/s of text, {m.group(2)} tokens/s; "
          f"resume identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
