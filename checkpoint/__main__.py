"""``python -m checkpoint <step dir | checkpoint.dir> ...``: verify checkpoints from the shell (exit 1 if one is
damaged)."""
from __future__ import annotations

import sys
from pathlib import Path

from .integrity import STEP_DIR, verify_local
from .manager import CheckpointManager


def main(argv: list[str] | None = None) -> int:
    """``python -m checkpoint PATH...``: verify step dirs (or every step dir of a checkpoint.dir)."""
    paths = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print("usage: python -m checkpoint <step dir | checkpoint.dir> ...", file=sys.stderr)
        return 2
    bad = 0
    for p in paths:
        targets = [p] if STEP_DIR.match(p.name) or (p / ".metadata").exists() else \
            CheckpointManager(p, is_writer=False).step_dirs()
        for t in targets:
            v = verify_local(t)
            if v.ok:
                print(f"ok       {t}")
            else:
                bad += 1
                print(f"DAMAGED  {t}: {v.first()}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
