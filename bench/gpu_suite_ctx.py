"""What ``bench.gpu_suite`` and its parts (``bench.gpu_suite_parts``) share: the part keys and titles, the
targets' thresholds and the marks each part declares, the time budgets, the run context and a subprocess
helper. No torch, no Hydra."""
from __future__ import annotations

import argparse
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bench.suite_report import Mark

ROOT = Path(__file__).resolve().parents[1]
PART_KEYS = ("engines", "kernels", "quant", "gemm", "grouped", "trainer", "step")

# Thresholds of the targets (H100, baselines measured in the same run).
DENSE_MIN = 1.50      # dense FP8 GEMM (auto) vs torch BF16 at large shapes
DENSE_VS_TORCH_MIN = 0.97   # dense FP8 GEMM (auto) vs torch's blockwise scaled_mm, every shape: never slower than the best
GROUPED_MIN = 1.20    # grouped FP8 forward vs torch._grouped_mm BF16
QUANT_MIN = 0.80      # quantisation GB/s vs a device-to-device copy
STEP_MIN = 1.00       # FP8 step time < BF16 step time (speed-up > 1)
QUANT_TARGET_KERNELS = ("act 1x128", "act 128x1 (T)", "weight 128x128")
QUANT_TARGET_ELEMS = 1 << 25   # target judged on tensors of >= 32 Mi elements (64 MiB in BF16, past the 50 MB L2)

TITLES = {
    "engines": "(a) Self-checks on this device: every launch variant and engine vs the reference",
    "kernels": "(a) Kernel tests compiled on the GPU",
    "quant": "(b) FP8 quantisation vs device copy",
    "gemm": "(b) Dense blockwise FP8 GEMM vs torch BF16 / _scaled_mm",
    "grouped": "(b) Grouped FP8 GEMM (routed experts) vs torch._grouped_mm / _scaled_grouped_mm",
    "trainer": "(c) Tiny trainer end to end: CUDA bf16 / fp8 vs CPU fp32",
    "step": "(d) One training step of v3_small (4 layers), bf16 vs fp8",
}
TRAINER_PRECISIONS = ("fp32", "bf16", "fp8")   # the trainer part's GPU runs, each against the CPU fp32 run

# Part budgets in seconds (full, quick): measuring loops stop there; subprocesses are killed there.
BUDGETS = {"engines": (60, 45), "kernels": (240, 180), "quant": (90, 45), "gemm": (200, 100), "grouped": (120, 60),
           "trainer": (300, 240), "step": (180, 120)}


def declared_marks(key: str) -> list[Mark]:
    """The marks a part reports, unmeasured (what a report shows for a part that did not run)."""
    if key == "engines":
        return [Mark("default engines right on this device", "every op has a self-checked engine", kind="check")]
    if key == "kernels":
        return [Mark("kernel tests pass compiled on the GPU", "0 failed, 0 errors", kind="check")]
    if key == "quant":
        return [Mark(f"quantisation {k} vs device copy", f">= {QUANT_MIN:.2f} of copy GB/s")
                for k in QUANT_TARGET_KERNELS] + [Mark("quantisers bit-exact vs reference", "all", kind="check")]
    if key == "gemm":
        return [Mark(f"dense FP8 GEMM {lay} (auto) vs torch BF16, large shapes", f">= {DENSE_MIN:.2f}x")
                for lay in ("fprop", "dgrad", "wgrad")] + [
            Mark("dense FP8 GEMM (auto) vs torch blockwise scaled_mm", f">= {DENSE_VS_TORCH_MIN:.2f}x"),
            Mark("dense FP8 GEMM matches reference (auto, triton)", "rel. err <= 1e-2 everywhere", kind="check")]
    if key == "grouped":
        return [Mark("grouped FP8 GEMM fwd vs torch._grouped_mm BF16", f">= {GROUPED_MIN:.2f}x"),
                Mark("grouped FP8 GEMM matches reference", "rel. err <= 1e-2 everywhere", kind="check")]
    if key == "trainer":
        return [Mark(f"tiny {r} losses vs CPU fp32", "within tolerance", kind="check")
                for r in ("cuda fp32", "cuda bf16", "cuda fp8")]
    if key == "step":
        return [Mark("FP8 training step faster than BF16", f"> {STEP_MIN:.2f}x"),
                Mark("training step losses finite", "bf16 and fp8", kind="check")]
    raise KeyError(key)


@dataclass
class Ctx:
    args: argparse.Namespace
    tmp: Path
    start: float
    deadline: float | None

    @property
    def quick(self) -> bool:
        return self.args.quick

    @property
    def smoke(self) -> bool:
        return self.args.smoke_cpu

    def part_deadline(self, key: str) -> float:
        full, quick = BUDGETS[key]
        end = time.monotonic() + (quick if self.quick else full)
        return end if self.deadline is None else min(end, self.deadline)


def run_cmd(cmd: list[str], env: dict | None = None, timeout: float | None = None) -> subprocess.CompletedProcess:
    """``cmd`` in the repository root, output captured as text."""
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def tail(text: str, n: int = 30) -> str:
    """The last ``n`` lines of ``text``."""
    return "\n".join((text or "").strip().splitlines()[-n:])
