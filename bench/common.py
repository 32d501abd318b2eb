"""Shared helpers for the FP8 kernel benchmarks (GPU only): device check, timing, tables.

Run from the repository root, e.g. ``python -m bench.fp8_gemm``. Every script refuses to run without
CUDA (the Triton interpreter on CPU is for correctness tests; its timings mean nothing). The measuring
functions (``measure`` in ``fp8_quant``, ``fp8_gemm``, ``fp8_grouped_gemm``) return plain rows so that
``bench.gpu_suite`` reports the same figures the scripts print.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

DEVICE = "cuda"     # the scripts allocate here; a CPU smoke run (interpreter) may override it


def require_cuda() -> None:
    if not torch.cuda.is_available():
        sys.exit("bench: no CUDA device found. These scripts time the Triton FP8 kernels on a GPU "
                 "(e.g. an H100); on CPU use the tests instead (python -m pytest tests/test_fp8_kernels.py).")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("bench: TRITON_INTERPRET=1 is set; unset it to time compiled kernels.")
    print(f"device: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))}), "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}, triton {_triton_version()}")


def _triton_version() -> str:
    import triton
    return triton.__version__


def on_cuda() -> bool:
    return torch.device(DEVICE).type == "cuda"


def sync() -> None:
    if on_cuda():
        torch.cuda.synchronize()


def time_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds per call. CUDA: ``triton.testing.do_bench`` (CUDA events, L2 flushed before
    every call, ``warmup``/``rep`` in ms). Elsewhere (CPU smoke runs only): host clock, median of 3."""
    if on_cuda():
        import triton.testing
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def first_line(e: BaseException, width: int = 120) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {(text[0] if text else '')[:width]}"


def try_time(fn) -> tuple[float | None, str]:
    """``(ms, "")`` or ``(None, reason)`` when ``fn`` is unsupported on this device/torch build."""
    try:
        fn()
        sync()
        return time_ms(fn), ""
    except Exception as e:             # noqa: BLE001 - report any backend refusal and go on
        return None, first_line(e)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``‖got − want‖ / ‖want‖`` in FP32 (NaN if ``got`` holds NaN: never passes a ``<=`` check)."""
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def tflops(flop: float, ms: float | None) -> str:
    return "n/a" if ms is None else f"{flop / ms / 1e9:.0f}"


def ratio(a: float | None, b: float | None) -> str:
    """How many times faster ``a`` (ms) is than ``b`` (ms), as text."""
    return "n/a" if a is None or b is None else f"{b / a:.2f}x"


def fmt(x: float | None, spec: str = ".0f", suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    for r in [headers, ["-" * w for w in widths], *rows]:
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))


def parse_config(text: str | None) -> dict | None:
    """``"BLOCK_M=128,BLOCK_N=256,num_warps=8,num_stages=3"`` -> dict for the kernels' ``config=``."""
    if not text:
        return None
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}


def parse_shapes(items: list[str] | None, default: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """``["4096x7168x7168", ...]`` -> ``[(4096, 7168, 7168), ...]`` (``default`` if none given)."""
    return [tuple(map(int, s.lower().split("x"))) for s in items] if items else list(default)


def past(deadline: float | None) -> bool:
    """True once ``time.monotonic()`` has passed ``deadline`` (None: never)."""
    return deadline is not None and time.monotonic() > deadline


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config", help="kernel tile config, e.g. BLOCK_M=128,BLOCK_N=256,num_warps=8,num_stages=3")
    p.add_argument("--pow2", action="store_true", help="power-of-2 scales")
    return p
