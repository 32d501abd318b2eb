"""Calibrate a GPU hardware profile of ``tools.plan`` from this project's own GEMM measurements.

    python -m tools.plan --hardware h100 --gpu-report runs/gpu/gpu_report.json [--save-profile h100_measured.yaml] ...

``python -m bench.gpu_suite`` writes a report with a JSON sidecar. Its ``grouped`` part times the Triton FP8
grouped GEMMs at DeepSeek-V3's expert shapes (fprop, dgrad, wgrad); its ``gemm`` part times the dense FP8
GEMMs and torch's BF16 GEMMs. A profile's efficiencies come from the datasheet and public kernels (DeepGEMM,
cuBLAS). With a report they come from what this trainer's kernels reached instead:

- ``gemm_efficiency`` (FP8 Fprop/Dgrad; most FLOPs are expert GEMMs): the median of the grouped fprop and
  dgrad rows' Triton FP8 TFLOP/s over the profile's FP8 peak;
- ``wgrad_efficiency``: the same for the grouped wgrad rows;
- ``bf16_efficiency`` (the head's BF16 GEMMs, and every GEMM under ``--precision bf16``): the median BF16
  TFLOP/s of the dense rows at large shapes (M >= 8192, N and K >= 7168; all rows if none) over the BF16 peak.

Only these three change. Peaks, links and the attention share stay as the profile has them. A report of a CPU
smoke run (``--smoke-cpu``) or one without timings is refused. Plain Python: no torch.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import yaml

from tools.plan_costs import Hardware

LARGE = (8192, 7168, 7168)   # the suite's "large shapes" (bench.gpu_suite_parts.is_large): M, N, K at least


class ReportError(ValueError):
    """The report cannot calibrate a profile; the message names the file and what is missing."""


def _number(cell: str) -> float | None:
    try:
        v = float(str(cell).split()[0])
    except (ValueError, IndexError):
        return None   # "n/a", "" (a row the time budget cut), "FAIL"
    return v if v > 0 else None


def _table(report: dict, key: str, path: str) -> list[dict[str, str]]:
    part = next((p for p in report.get("parts", []) if p.get("key") == key), None)
    if part is None or not part.get("tables"):
        raise ReportError(f"{path}: no '{key}' part with a table (run the suite with that part: "
                          f"python -m bench.gpu_suite --parts {key} ...)")
    t = part["tables"][0]
    return [dict(zip(t["headers"], row)) for row in t["rows"]]


def gemm_rates(report: dict, path: str = "report") -> dict[str, list[float]]:
    """TFLOP/s from a suite report: ``fprop``, ``dgrad``, ``wgrad`` (grouped, Triton FP8) and ``bf16`` (dense,
    torch BF16, large shapes when there are any)."""
    meta = report.get("meta", {})
    if meta.get("smoke"):
        raise ReportError(f"{path}: a CPU smoke run ({meta.get('device_line', 'no GPU')}) has no GPU timings; "
                          f"calibrate from a report of a GPU run")
    rates: dict[str, list[float]] = {"fprop": [], "dgrad": [], "wgrad": [], "bf16": []}
    for row in _table(report, "grouped", path):
        v = _number(row.get("triton fp8 TFLOP/s", ""))
        if v is not None and row.get("pass") in ("fprop", "dgrad", "wgrad"):
            rates[row["pass"]].append(v)
    dense = []
    for row in _table(report, "gemm", path):
        v = _number(row.get("bf16 TFLOP/s", ""))
        if v is not None:
            m, n, k = (int(x) for x in row["shape MxNxK"].split("x"))
            dense.append((v, m >= LARGE[0] and n >= LARGE[1] and k >= LARGE[2]))
    rates["bf16"] = [v for v, large in dense if large] or [v for v, _ in dense]
    empty = [k for k, v in rates.items() if not v]
    if empty:
        raise ReportError(f"{path}: no timings for {', '.join(empty)} (cut by the time budget, or failed: see the "
                          f"report's grouped and gemm parts)")
    return rates


def calibrate(hw: Hardware, report: dict, path: str = "report") -> tuple[Hardware, list[str]]:
    """``hw`` with its GEMM efficiencies from the report (module doc); returns it and one line per change."""
    if not (hw.peak_fp8_tflops and hw.peak_bf16_tflops):
        raise ReportError(f"{path}: profile {hw.name!r} has no FP8 and BF16 peaks to scale GEMM rates by (a GPU profile, "
                          f"such as h100, is needed)")
    rates = gemm_rates(report, path)
    med = {k: statistics.median(v) for k, v in rates.items()}
    new = {"gemm_efficiency": statistics.median(rates["fprop"] + rates["dgrad"]) / hw.peak_fp8_tflops,
           "wgrad_efficiency": med["wgrad"] / hw.peak_fp8_tflops,
           "bf16_efficiency": med["bf16"] / hw.peak_bf16_tflops}
    what = {"gemm_efficiency": f"grouped FP8 fprop + dgrad, median of {len(rates['fprop']) + len(rates['dgrad'])} rows",
            "wgrad_efficiency": f"grouped FP8 wgrad, median {med['wgrad']:.0f} TFLOP/s of {len(rates['wgrad'])} rows",
            "bf16_efficiency": f"dense BF16, median {med['bf16']:.0f} TFLOP/s of {len(rates['bf16'])} rows"}
    lines = [f"{k} {getattr(hw, k):.3f} -> {v:.3f} ({what[k]})" for k, v in new.items()]
    meta = report.get("meta", {})
    source = (f"GEMM efficiencies from {path}: bench.gpu_suite on {meta.get('device_line', '?')}, {meta.get('date', '?')}, "
              f"commit {meta.get('commit', '?')} ({'; '.join(lines)})")
    name = hw.name if hw.name.endswith("(calibrated)") else f"{hw.name} (calibrated)"
    return dataclasses.replace(hw, name=name, sources=[*hw.sources, source], **{k: round(v, 4) for k, v in new.items()}), lines


def load_report(path: str) -> dict:
    p = Path(path)
    if p.suffix == ".md":
        p = p.with_suffix(".json")   # the sidecar beside the markdown report
    try:
        return json.loads(p.read_text())
    except OSError as e:
        raise ReportError(f"--gpu-report {path}: cannot read {p}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise ReportError(f"--gpu-report {path}: {p} is not JSON ({e.msg} at line {e.lineno}); pass the report's "
                          f".json sidecar") from e


def save_profile(hw: Hardware, path: str) -> None:
    """Write ``hw`` as a profile YAML that ``--hardware <path>`` loads back."""
    data = dataclasses.asdict(hw)
    data["elementwise_passes"] = list(data["elementwise_passes"])
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))


def from_cli(hw: Hardware, report_path: str | None, save_path: str | None) -> Hardware:
    """``--gpu-report`` (calibrate ``hw`` from it, printing each change) and ``--save-profile`` (write the profile
    used); raises ``ReportError``."""
    if report_path:
        hw, lines = calibrate(hw, load_report(report_path), report_path)
        print(f"{hw.name}: " + "; ".join(lines))
    if save_path:
        save_profile(hw, save_path)
        print(f"wrote {save_path} (use it with --hardware {save_path})")
    return hw
