"""Never run a wrong kernel: each default launch configuration and each engine is checked on the device it
is about to run on, once per process, before its first use.

A check runs the kernel on a small random problem (milliseconds) and compares it with ``reference.py`` on the
same device: GEMMs within ``GEMM_TOL`` relative (Frobenius) error and finite, quantisers bit for bit. The
verdict is cached per (kernel, variant, device, Triton and torch versions), so a new device or a new compiler
is checked again. ``first_verified`` walks a list of variants in order of preference and returns the first
that passes; each one that fails logs one warning line naming the kernel, the variant, the device, the error
and what is used instead. Nothing passes: ``NoVerifiedKernel``, naming every variant and why.

Why: the interpreter checks the algorithm, not the compiler (Triton 3.6 compiles the warp-specialised TMA GEMM
for Hopper into a kernel that returns garbage while every interpreter test passes). Meta tensors (the Hopper
compile gate) are not checked: nothing runs there.
"""
from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("kernels")

GEMM_TOL = 1e-3     # FP32 sums of the same FP8 products in another order differ by ~1e-6; a wrong kernel by >= 0.1


class NoVerifiedKernel(RuntimeError):
    """No variant of a kernel passed its self-check on this device."""


@dataclass(frozen=True)
class Verdict:
    ok: bool
    err: float | None   # relative error (GEMMs) or fraction of differing elements (quantisers); None: did not run
    why: str            # "" when ok


_VERDICTS: dict[tuple, Verdict] = {}     # the process-wide cache the checks exist for


def device_id(device: torch.device | str) -> str:
    """What a verdict holds for: the device model and the compiler and torch versions."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return _cuda_id(dev.index if dev.index is not None else torch.cuda.current_device())
    from . import interpreting
    name = dev.type + (" (Triton interpreter)" if interpreting() else "")
    return f"{name}, triton {_triton_version()}, torch {torch.__version__}"


@functools.lru_cache(maxsize=None)
def _cuda_id(index: int) -> str:        # asked at every GEMM call (the verdict cache's key): once per device
    major, minor = torch.cuda.get_device_capability(index)
    return f"{torch.cuda.get_device_name(index)} (sm_{major}{minor}), triton {_triton_version()}, torch {torch.__version__}"


def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except ImportError:
        return "none"


def verdicts() -> dict[tuple, Verdict]:
    """A copy of the cache: ``{(kernel, variant, device_id): Verdict}``."""
    return dict(_VERDICTS)


def forget() -> None:
    """Drop every cached verdict (tests)."""
    _VERDICTS.clear()


def worst(errs: list[float]) -> float:
    """The largest error; NaN if any is (``max`` passes over a NaN that is not first: ``max(0.1, nan)`` is 0.1)."""
    return math.nan if any(math.isnan(e) for e in errs) else max(errs)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``‖got − want‖ / ‖want‖`` in FP64; NaN when ``got`` holds a non-finite value (never passes)."""
    got, want = got.double(), want.double()
    if not torch.isfinite(got).all():
        return math.nan
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


def mismatch(got: torch.Tensor, want: torch.Tensor) -> float:
    """Fraction of elements whose bits differ (0.0: bit-exact); 1.0 when shapes or dtypes differ."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return 1.0
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    return float((got.contiguous().view(as_int) != want.contiguous().view(as_int)).float().mean()) if got.numel() else 0.0


def check(kernel: str, variant: str, device: torch.device | str, run: Callable[[], float], tol: float) -> tuple[Verdict, bool]:
    """The cached verdict of ``variant`` of ``kernel`` on ``device``, running ``run()`` (-> error) the first time.
    Returns ``(verdict, fresh)``; an exception in ``run`` is a failed verdict with its first line as the reason."""
    key = (kernel, variant, device_id(device))
    if key in _VERDICTS:
        return _VERDICTS[key], False
    try:
        err = float(run())
        ok = math.isfinite(err) and err <= tol
        why = "" if ok else (f"relative error {err:.1e} vs the reference (limit {tol:.0e})" if tol else
                             f"{err:.2%} of the elements differ from the reference (must be bit-exact)")
    except Exception as e:  # noqa: BLE001 - a variant that cannot run on this device fails its check
        text = str(e).strip().splitlines()
        err, ok, why = None, False, f"{type(e).__name__}: {(text[0] if text else '')[:200]}"
    verdict = Verdict(ok, err, why)
    _VERDICTS[key] = verdict
    return verdict, True



def verified(kernel: str, device: torch.device, run: Callable[[], float], tol: float, label: str, instead: str) -> bool:
    """``check``'s verdict for the single-variant kernel ``kernel`` (its ``triton`` variant) on ``device``; a
    fresh failure logs one warning: ``<label> self-check failed on <device>: <why>; using <instead> instead``."""
    verdict, fresh = check(kernel, "triton", device, run, tol)
    if fresh and not verdict.ok:
        log.warning("%s self-check failed on %s: %s; using %s instead", label, device_id(device), verdict.why, instead)
    return verdict.ok

def first_verified(kernel: str, variants: Sequence[tuple[str, Any]], device: torch.device | str,
                   run: Callable[[Any], float], tol: float = GEMM_TOL) -> tuple[str, Any]:
    """The first ``(name, variant)`` whose check passes on ``device`` (``run(variant)`` -> error); one warning
    line for each variant that fails its first check. Raises ``NoVerifiedKernel`` when none passes."""
    failed = []
    for i, (name, variant) in enumerate(variants):
        verdict, fresh = check(kernel, name, device, lambda v=variant: run(v), tol)
        if verdict.ok:
            return name, variant
        failed.append(f"{name}: {verdict.why}")
        if fresh:
            instead = f"using {variants[i + 1][0]} instead" if i + 1 < len(variants) else "no variant left"
            log.warning("fp8 self-check: %s launch config %s %s is wrong on %s: %s; %s", kernel, name,
                        _short(variant), device_id(device), verdict.why, instead)
    raise NoVerifiedKernel(f"no launch configuration of {kernel} passed its self-check on {device_id(device)}: "
                           + "; ".join(failed))


def _short(variant: Any) -> str:
    return "{" + ", ".join(f"{k}={v}" for k, v in variant.items()) + "}" if isinstance(variant, dict) else ""
