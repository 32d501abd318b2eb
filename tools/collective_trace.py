"""Compare the per-rank collective traces of a run: ``python -m tools.collective_trace <dir>``.

``DSV3_TRACE_COLLECTIVES=<step>`` makes every rank of a trainer run append the collectives it issues in
that step to ``<run dir>/collective_trace/rank<r>.jsonl`` (``parallel/collective_trace.py``). The run
checks them itself at the end of the step; after a hang it never gets there, and this command compares
the files instead: it prints the first group whose members issued different collectives (or whose
point-to-point sends and receives do not pair up) and exits 1, or prints a summary and exits 0.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from parallel.collective_trace import CollectiveOrderError, compare


def load(directory: Path) -> dict[int, dict]:
    traces: dict[int, dict] = {}
    for path in sorted(directory.glob("rank*.jsonl")):
        m = re.fullmatch(r"rank(\d+)\.jsonl", path.name)
        if not m:
            continue
        calls, members = [], {}
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                members[rec["group"]] = rec.pop("members")
                calls.append(rec)
        traces[int(m.group(1))] = {"calls": calls, "members": members}
    return traces


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="a run's collective_trace/ directory (rank<r>.jsonl files)")
    args = ap.parse_args(argv)
    traces = load(args.dir)
    if not traces:
        print(f"error: no rank<r>.jsonl files in {args.dir}", file=sys.stderr)
        return 2
    # A rank that wrote nothing (it hung or died before its first collective) has no file; name it too.
    expected = set(range(max(traces) + 1))
    if set(traces) != expected:
        print(f"note: no trace file from ranks {sorted(expected - set(traces))}", file=sys.stderr)
    try:
        print(compare(traces))
    except CollectiveOrderError as e:
        print(f"divergence: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
