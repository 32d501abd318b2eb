"""One variant of ``bench.step_variants`` timed in several source trees, alternating, one process per run:
``python -m bench.ab_step --trees main=.,exp=trees/exp [--rounds 2] [--variant G] [--layers 12] [--json out.json]``.

Code against code on one GPU (``docs/gpu.md``, step 5). Two processes of one tree differ by up to 1.5 ms, so each
tree runs ``--rounds`` times, in the order ``a b a b ...`` (``--warmup``: after one untimed run per tree; each run
already warms up and compiles before it times, so that only moves inductor's compile time out of the first
rounds' wall time). Each run is ``python3 -m bench.step_variants --variants V --json``
in the tree's directory, with this process's environment (``PYTHONPATH`` as set for the carried wheels, with the
tree itself first). Prints one row per run and a summary per tree (median step, GPU busy, launches); a run that
fails or times out is a row that says so, and the others go on. Prepare a tree here, where git is:
``git archive <ref> | tar -x -C trees/<name>`` (untracked folders travel to the device).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def parse_trees(spec: str) -> dict[str, Path]:
    """``name=dir,name=dir`` -> ordered ``{name: Path}``; a name or directory given twice is an error."""
    trees: dict[str, Path] = {}
    for item in spec.split(","):
        name, sep, where = item.partition("=")
        if not sep or not name or not where:
            raise ValueError(f"--trees: {item!r} is not name=dir")
        if name in trees:
            raise ValueError(f"--trees: {name!r} given twice")
        trees[name] = Path(where)
    return trees


def schedule(names: list[str], rounds: int, warmup: bool) -> list[tuple[str, bool]]:
    """``(tree, timed)`` in run order: each tree once untimed (``warmup``), then ``rounds`` passes over the trees."""
    return [(n, False) for n in names if warmup] + [(n, True) for _ in range(rounds) for n in names]


def summary(rows: list[dict]) -> list[str]:
    """Per tree, over its timed runs that finished: median step and GPU busy (ms), launches, the runs' steps."""
    out = []
    for name in dict.fromkeys(r["tree"] for r in rows):
        done = [r for r in rows if r["tree"] == name and r["timed"] and r.get("step_ms") is not None]
        if not done:
            out.append(f"{name}: no timed run finished")
            continue
        busy = [r["busy_ms"] for r in done if r.get("busy_ms") is not None]
        steps = ", ".join(f"{r['step_ms']:.1f}" for r in done)
        out.append(f"{name}: step {statistics.median(r['step_ms'] for r in done):.1f} ms (runs {steps})"
                   + (f", GPU busy {statistics.median(busy):.1f} ms" if busy else "")
                   + f", launches {done[-1].get('launches')}")
    return out


def run_one(tree: Path, variant: str, layers: int, timeout_s: float) -> dict:
    """One ``bench.step_variants`` process in ``tree``; its JSON's step, host, busy and launches, or the error."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree.resolve()), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "bench.step_variants", "--layers", str(layers), "--variants", variant,
               "--json", str(out)]
        try:
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout_s:.0f} s"}
        r = json.loads(out.read_text()).get(variant) if out.exists() else None
        if proc.returncode != 0 or not r:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
            return {"error": f"exit code {proc.returncode}: {tail[0][:200]}"}
        p = r.get("profile") or {}
        return {"step_ms": r["step_s"] * 1e3, "host_ms": r["host_s"] * 1e3, "tokens_per_s": r["tokens_per_s"],
                "mfu": r["mfu"], "peak_gb": r["peak_gb"], "busy_ms": p.get("busy_ms"), "launches": p.get("launches"),
                "loss": r["loss"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ab_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", required=True, help="name=dir,name=dir (the first is the baseline)")
    ap.add_argument("--variant", default="G")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", action="store_true", help="one untimed run per tree first")
    ap.add_argument("--timeout-s", type=float, default=150.0, help="per run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        trees = parse_trees(args.trees)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    missing = [f"{n}={p}" for n, p in trees.items() if not (p / "bench" / "step_variants.py").exists()]
    if missing:
        print(f"error: not a source tree (no bench/step_variants.py): {', '.join(missing)}", file=sys.stderr)
        return 2
    rows = []
    for name, timed in schedule(list(trees), args.rounds, args.warmup):
        r = {"tree": name, "timed": timed, **run_one(trees[name], args.variant, args.layers, args.timeout_s)}
        rows.append(r)
        what = r["error"] if "error" in r else (f"step {r['step_ms']:.1f} ms, host {r['host_ms']:.1f}, "
                                                 f"busy {r['busy_ms']} ms, launches {r['launches']}, "
                                                 f"tok/s {r['tokens_per_s']:.0f}, peak {r['peak_gb']:.1f} GB")
        print(f"{name} ({'timed' if timed else 'warm-up'}): {what}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
