"""``python -m bench.gpu_suite --out REPORT.md``: the GPU acceptance suite.

One command for every GPU session (about 8 minutes on one H100, ``--quick`` about 5). Without CUDA it
refuses with one line on stderr and exit code 2. With CUDA it runs the parts below in order, writes the
markdown report (and ``REPORT.json`` beside it) after every part, so a killed run leaves the finished
parts on disk, records a part that fails and goes on, prints a summary table last, and exits 1 if any part
failed or did not run for lack of time (0 otherwise; ``--strict-targets``: also 1 if a target is missed).

Parts (``--parts engines,kernels,quant,gemm,grouped,trainer,step``; default all, in this order; what each
measures and its target: docs/gpu.md, thresholds in ``bench/gpu_suite_ctx.py``): (a) the engines' self-checks
and the kernel tests compiled on the GPU, (b) the FP8 benches (``bench.fp8_*``, no Hydra), (c) the tiny trainer
on CUDA vs the CPU (``bench/train_check.py``; needs Hydra: the suite installs ``.whl/*.whl`` into a temp dir when
it is missing), (d) one ``v3_small`` step cut to 4 layers, bf16 vs fp8. Every kernel is checked against
``kernels/reference.py`` before it is timed, every baseline runs in the same process. The parts are in
``bench/gpu_suite_parts.py``.

Options: ``--quick``, ``--deadline-s N`` (parts not started within N s are listed as not run), ``--append``
(keep the other parts of an earlier report at the same ``--out``: run the suite in several calls),
``--strict-targets``. On the lent GPU machine: docs/gpu.md.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench import suite_report as rep
from bench.gpu_suite_ctx import PART_KEYS, ROOT, TITLES, TRAINER_PRECISIONS, Ctx, declared_marks, run_cmd
from bench.gpu_suite_parts import (part_engines, part_gemm, part_grouped, part_kernels, part_quant, part_step,
                                   part_trainer)
from bench.suite_report import Part


def _chosen(text: str | None, allowed: tuple[str, ...], what: str) -> list[str]:
    """A comma list of ``allowed`` names in ``allowed``'s order (``all`` or None: every one)."""
    if text is None or text.strip() in ("", "all"):
        return list(allowed)
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(allowed)}")
    return [k for k in allowed if k in names]


def parse_parts(text: str | None) -> list[str]:
    """``"gemm,kernels"`` -> ``["kernels", "gemm"]`` (suite order; ``all`` or None: every part)."""
    return _chosen(text, PART_KEYS, "part(s)")


def parse_precisions(text: str | None) -> list[str]:
    """``"fp8"`` -> ``["fp8"]``: the trainer part's GPU runs (``TRAINER_PRECISIONS`` order)."""
    return _chosen(text, TRAINER_PRECISIONS, "precision(s)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_suite", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="markdown report path (a JSON sidecar is written beside it)")
    p.add_argument("--parts", type=parse_parts, default=list(PART_KEYS), help=f"comma list of {','.join(PART_KEYS)}")
    p.add_argument("--quick", action="store_true", help="fewer shapes and steps (~5 min)")
    p.add_argument("--deadline-s", type=float, default=None, help="do not start parts after this many seconds")
    p.add_argument("--append", action="store_true", help="keep the other parts of an existing report at --out")
    p.add_argument("--strict-targets", action="store_true", help="exit 1 if a target is not met")
    p.add_argument("--wheels", default=str(ROOT / ".whl"), help="folder of carried wheels (hydra & co.)")
    p.add_argument("--trainer-overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help="config overrides for the trainer part's GPU runs (e.g. train.compile=off to bisect)")
    p.add_argument("--trainer-precisions", type=parse_precisions, default=list(TRAINER_PRECISIONS),
                   help=f"the trainer part's GPU runs, a comma list of {','.join(TRAINER_PRECISIONS)} (the CPU "
                        "fp32 reference always runs)")
    p.add_argument("--smoke-cpu", action="store_true", help=argparse.SUPPRESS)   # developer check: CPU, tiny shapes
    return p


def refusal() -> str | None:
    """Why the suite cannot run here (one line), or None."""
    import torch
    if not torch.cuda.is_available():
        return (f"gpu_suite: no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False); this "
                f"suite times compiled kernels on a GPU, so nothing was run and no report was written.")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return "gpu_suite: TRITON_INTERPRET=1 is set; unset it so the kernels compile for the GPU."
    return None


# ---------------------------------------------------------------------------------------------- metadata
def device_meta(args: argparse.Namespace, argv: list[str]) -> dict:
    import torch
    meta = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "commands": ["python -m bench.gpu_suite " + shlex.join(argv)],
            "mode": ("smoke (CPU)" if args.smoke_cpu else "quick" if args.quick else "full"), "smoke": args.smoke_cpu}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = "not installed"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        meta["device_line"] = (f"{p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                               f"{p.total_memory / 2**30:.1f} GiB")
    else:
        meta["device_line"] = f"CPU only ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    try:
        smi = run_cmd(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit", "--format=csv,noheader"],
                      timeout=20)
        fields = [f.strip() for f in smi.stdout.strip().splitlines()[0].split(",")] if smi.returncode == 0 \
            and smi.stdout.strip() else []
        meta["driver"] = (fields[0] + (f" (max SM clock {fields[1]}, power limit {fields[2]})" if len(fields) > 2
                                       else "")) if fields else "n/a"
    except (OSError, subprocess.SubprocessError):
        meta["driver"] = "n/a (no nvidia-smi)"
    meta["fingerprint"] = source_fingerprint()
    try:
        head = run_cmd(["git", "rev-parse", "--short", "HEAD"], timeout=20)
        dirty = run_cmd(["git", "status", "--porcelain", "--untracked-files=no"], timeout=20)
        meta["commit"] = (head.stdout.strip() + (" (+ local changes)" if dirty.stdout.strip() else "")) \
            if head.returncode == 0 else "n/a (no git checkout)"
    except (OSError, subprocess.SubprocessError):
        meta["commit"] = "n/a (no git)"
    return meta


def source_fingerprint(dirs=("kernels", "parallel", "models", "trainer", "configs", "bench")) -> str:
    """sha256 (12 hex) over the ``*.py``/``*.yaml`` files under ``dirs``, by relative path and content: the
    device machine has no git history, so this names the code a report measured (compute it in a checkout
    with ``python -c "from bench.gpu_suite import source_fingerprint as f; print(f())"``)."""
    import hashlib
    h = hashlib.sha256()
    files = sorted(p for d in dirs for ext in ("*.py", "*.yaml") for p in (ROOT / d).rglob(ext)
                   if "__pycache__" not in p.parts)
    for p in files:
        h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


PART_FUNCS = {"engines": part_engines, "kernels": part_kernels, "quant": part_quant, "gemm": part_gemm, "grouped": part_grouped,
              "trainer": part_trainer, "step": part_step}


# ---------------------------------------------------------------------------------------------- driver
def run_part(ctx: Ctx, key: str) -> Part:
    part = Part(key, TITLES[key], status="running", marks=declared_marks(key))
    t0 = time.monotonic()
    print(f"== {key}: {TITLES[key]}", flush=True)
    try:
        PART_FUNCS[key](ctx, part)
    except Exception as e:     # noqa: BLE001 - a failing part is recorded, the suite goes on
        part.error = (part.error + "\n" if part.error else "") + f"{type(e).__name__}: {e}"
        part.log = (part.log + "\n" if part.log else "") + traceback.format_exc(limit=8)
        print(traceback.format_exc(), file=sys.stderr, flush=True)
    part.seconds = time.monotonic() - t0
    part.finish()
    for t in part.tables:
        from bench.common import print_table
        print_table([str(h) for h in t.headers], [[str(c) for c in r] for r in t.rows])
    print(f"== {key}: {part.status} in {part.seconds:.0f} s: {part.headline}", flush=True)
    return part


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if not args.smoke_cpu:
        why = refusal()
        if why:
            print(why, file=sys.stderr)
            return 2
    else:
        from bench import common
        common.DEVICE = "cpu"
    start = time.monotonic()
    meta = device_meta(args, argv)
    parts = {k: Part(k, TITLES[k], marks=declared_marks(k)) for k in PART_KEYS}
    if args.append and rep.sidecar(args.out).exists():
        old_meta, old_parts = rep.load(args.out)
        parts.update({p.key: p for p in old_parts if p.key in parts and p.key not in args.parts})
        meta["commands"] = old_meta.get("commands", []) + meta["commands"]
    for k in PART_KEYS:
        if k not in args.parts and parts[k].status == "not run":
            parts[k].headline = "not requested"
    ctx = Ctx(args, Path(tempfile.mkdtemp(prefix="gpu_suite_")), start,
              None if args.deadline_s is None else start + args.deadline_s)
    print(f"gpu_suite: {meta['device_line']}; torch {meta['torch']}, triton {meta['triton']}; parts "
          f"{','.join(args.parts)}; report {args.out}", flush=True)
    for key in args.parts:
        parts[key] = Part(key, TITLES[key], marks=declared_marks(key), headline="not started yet")
    rep.write(args.out, meta, list(parts.values()))
    for key in args.parts:
        if ctx.deadline is not None and time.monotonic() > ctx.deadline - 20:
            parts[key].headline = "not run: --deadline-s reached"
            continue
        parts[key].status, parts[key].headline = "running", "started, did not finish (killed or still running)"
        rep.write(args.out, meta, list(parts.values()))
        parts[key] = run_part(ctx, key)
        rep.write(args.out, meta, list(parts.values()))
    final = list(parts.values())
    rep.write(args.out, meta, final)
    print()
    print("\n".join(rep.summary_lines(final)))
    print(rep.verdict_line(final))
    print(f"report: {args.out} (+ {rep.sidecar(args.out).name})")
    o = rep.overall(final)
    incomplete = [k for k in args.parts if parts[k].status == "not run"]
    missed = args.strict_targets and o["targets_met"] < o["targets"]
    return 1 if o["failed"] or incomplete or missed else 0


if __name__ == "__main__":
    sys.exit(main())
