"""The ``auto`` FP8 backend on a GPU: per op, the fastest engine that passed its self-check on this device.

Engines per op, in order of preference (``cuda_engines``):
- quantisers: the Triton kernels when they are bit-exact vs ``reference.py`` on this device (for the 128×1
  transposed one also its composition ``quant.quant_act_t_transposed``), else the reference's plain-torch
  quantisers; ``quant_act_both`` (both copies of one activation): the fused Triton kernel when it is bit-exact
  here, else ("separate") this namespace's own ``quant_act`` and ``quant_act_t``, one after the other;
- ``gemm``: torch's blockwise ``scaled_mm`` (cuBLASLt, ``torch_gemm.py``) where the running torch and device
  have it and the operands suit it, and the Triton kernel (its first self-checked launch variant);
- ``grouped_gemm`` / ``grouped_wgrad``: the Triton kernels;
- the reference (dequantise, FP32 matmul) last: correct everywhere, slow; used only when no engine passes.

Each engine is self-checked once per process and device (``selfcheck.py``) before it is used. Where more than
one engine can run a GEMM, the first call of each shape class (op, M, N, K, scale layout, output dtype,
strides) times each engine on the call's own operands (one warm-up, then ``reps`` runs between CUDA events)
and keeps the fastest for the rest of the process; each choice is logged once (logger ``kernels``, INFO).
``summary()`` runs every self-check and says which engines passed: the trainer logs it at start-up.

On the CPU ``auto`` means ``emulation``; ``AutoOps`` itself is device-neutral (tests drive it on the CPU).
"""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import selfcheck
from .reference import b_group

log = logging.getLogger("kernels")

GEMM_OPS = ("gemm", "grouped_gemm", "grouped_wgrad")
QUANT_OPS = ("quant_act", "quant_act_t", "quant_act_both", "quant_weight")


@dataclass
class Engine:
    """One way to run one op: ``fn`` with the op's signature; ``verify(device) -> str | None`` (None: passed,
    else why not, one line; run once per device); ``accepts(*args) -> bool`` (None: takes any operands)."""
    name: str
    fn: Callable
    verify: Callable[[torch.device], str | None]
    accepts: Callable[..., bool] | None = None
    fallback: bool = False      # the reference: used only when no other engine passes or accepts the operands
    # (for ``quant_act_both``: the separate quantisers, which ``AutoOps`` runs through its own ops)


@dataclass
class AutoOps:
    """The op namespace of ``kernels.get_ops("auto", device)`` for a device with engines to choose from."""
    device: torch.device
    engines: dict[str, list[Engine]]              # op -> engines, preferred first
    timer: Callable[[Callable[[], object]], float] | None = None   # fn -> ms; default: CUDA events / host clock
    choices: dict[tuple, str] = field(default_factory=dict)
    _passed: dict[tuple[str, str], str | None] = field(default_factory=dict)

    # -------------------------------------------------------------------- the ops (reference.py signatures)
    def quant_act(self, x, pow2=False):
        return self._one("quant_act")(x, pow2)

    def quant_act_t(self, x, tokens_per_expert=None, pow2=False):
        return self._one("quant_act_t")(x, tokens_per_expert, pow2)

    def quant_act_both(self, x, tokens_per_expert=None, pow2=False):
        """The fused kernel where it passed its self-check here, else this namespace's two quantisers (so each
        copy comes from the engine its own op chose)."""
        from . import quant
        fused = self.passed("quant_act_both")[0] \
            if "quant_act_both" in self.engines and quant.fused_enabled(x.device) else None
        if fused is None or fused.fallback:
            return (*self.quant_act(x, pow2), *self.quant_act_t(x, tokens_per_expert, pow2))
        return fused.fn(x, tokens_per_expert, pow2)

    def quant_weight(self, w, pow2=False, transpose=False):
        return self._one("quant_weight")(w, pow2, transpose=transpose)

    def gemm(self, a, sa, b, sb, out_dtype=torch.bfloat16):
        return self._pick(self.gemm_key(a, b, sb, out_dtype), "gemm", (a, sa, b, sb, out_dtype))(a, sa, b, sb, out_dtype)

    @staticmethod
    def gemm_key(a, b, sb, out_dtype=torch.bfloat16) -> tuple:
        """The shape class of a dense GEMM call: one engine choice per class."""
        return ("gemm", *a.shape, b.shape[0], b_group(b, sb), out_dtype, a.stride(), b.stride())

    def grouped_gemm(self, a, sa, b, sb, tokens_per_expert, out_dtype=torch.bfloat16):
        key = ("grouped_gemm", a.shape[1], *b.shape, out_dtype, b.stride())
        args = (a, sa, b, sb, tokens_per_expert, out_dtype)
        return self._pick(key, "grouped_gemm", args)(*args)

    def grouped_wgrad(self, aT, sa, bT, sb, tokens_per_expert, out_dtype=torch.float32):
        key = ("grouped_wgrad", aT.shape[0], bT.shape[0], tokens_per_expert.numel(), out_dtype)
        args = (aT, sa, bT, sb, tokens_per_expert, out_dtype)
        return self._pick(key, "grouped_wgrad", args)(*args)

    # ----------------------------------------------------------------------------------------- choosing
    def passed(self, op: str) -> list[Engine]:
        """The engines of ``op`` that passed their self-check on this device (checked on first ask), preferred
        first; the fallback (reference) only when no other engine passed."""
        out = []
        for e in self.engines[op]:
            key = (op, e.name)
            if key not in self._passed:
                try:
                    self._passed[key] = e.verify(self.device)
                except Exception as exc:  # noqa: BLE001 - an engine that cannot even be checked is not used
                    text = str(exc).strip().splitlines()
                    self._passed[key] = f"{type(exc).__name__}: {(text[0] if text else '')[:200]}"
                if self._passed[key] is not None:
                    log.warning("fp8 auto: %s engine %s not used on %s: %s", op, e.name,
                                selfcheck.device_id(self.device), self._passed[key])
            if self._passed[key] is None:
                out.append(e)
        best = [e for e in out if not e.fallback]
        if best:
            return best
        if not out:
            raise selfcheck.NoVerifiedKernel(f"fp8 auto: no engine for {op} passed its self-check on "
                                             f"{selfcheck.device_id(self.device)}")
        return out

    def _one(self, op: str) -> Callable:
        return self.passed(op)[0].fn

    def _pick(self, key: tuple, op: str, args: tuple) -> Callable:
        name = self.choices.get(key)
        if name is None:
            name = self._choose(key, op, args)
        return next(e.fn for e in self.engines[op] if e.name == name)

    def _choose(self, key: tuple, op: str, args: tuple) -> str:
        cands = [e for e in self.passed(op) if e.accepts is None or e.accepts(*args)]
        if not cands:                           # nothing verified takes these operands: the reference does
            cands = [e for e in self.engines[op] if e.fallback]
        if len(cands) == 1:
            self.choices[key] = cands[0].name
            return cands[0].name
        times = {}
        for e in cands:
            try:
                times[e.name] = (self.timer or _timer(self.device))(lambda e=e: e.fn(*args))
            except Exception as exc:  # noqa: BLE001 - an engine that refuses this shape loses it
                log.info("fp8 auto: %s %s: %s refused it (%s)", op, _describe(key), e.name,
                         str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__)
        if not times:
            raise RuntimeError(f"fp8 auto: every engine of {op} failed on {_describe(key)}")
        best = min(times, key=times.get)
        log.info("fp8 auto: %s %s -> %s (%s)", op, _describe(key), best,
                 ", ".join(f"{n} {ms:.3f} ms" for n, ms in times.items()))
        self.choices[key] = best
        return best

    def summary(self) -> str:
        """One line: per op, the engines that passed their self-check here (runs the checks now)."""
        parts = []
        for op in QUANT_OPS + GEMM_OPS:
            try:
                names = [e.name for e in self.passed(op)]
            except selfcheck.NoVerifiedKernel:
                names = ["NONE"]
            parts.append(f"{op} {'/'.join(names)}")
        return f"fp8 engines on {selfcheck.device_id(self.device)} (self-checked; GEMMs fastest per shape " \
               f"at first use): " + ", ".join(parts)


def _describe(key: tuple) -> str:
    return " ".join(str(k) for k in key[1:])


def _timer(device: torch.device, reps: int = 5) -> Callable[[Callable[[], object]], float]:
    """Milliseconds per call of ``fn``: one warm-up call (compiles), then ``reps`` calls between two CUDA
    events (host clock off CUDA)."""
    def time_ms(fn) -> float:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / reps
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    return time_ms


# ------------------------------------------------------------------------------------------ CUDA engines
def cuda_engines() -> dict[str, list[Engine]]:
    """The engines of ``auto`` on a GPU (module docstring)."""
    from . import configure
    configure()
    from . import gemm, grouped_gemm, quant, reference, torch_gemm

    def quant_ok(op, fn=None, variant="triton"):
        def ok(device):
            return None if triton_quant_exact(op, device, fn, variant) else "not bit-exact on this device"
        return ok

    def torch_ok(device):
        why = torch_gemm.unavailable(device)
        if why:
            return why
        verdict, _ = selfcheck.check("gemm", "torch scaled_mm", device, lambda: torch_gemm.self_check(device),
                                     selfcheck.GEMM_TOL)
        return None if verdict.ok else verdict.why

    def variant_ok(kernel, check):
        def ok(device):
            gemm.default_variant(kernel, True, device, check)       # raises NoVerifiedKernel when none passes
            return None
        return ok

    def ref_ok(device):
        return None

    def fused_ok(device):        # one warning line when it fails (``passed``'s), naming where it differs
        verdict, _ = selfcheck.check("quant_act_both", "triton", device,
                                     lambda: quant.self_check("quant_act_both", device), tol=0.0)
        return None if verdict.ok else verdict.why

    quantisers = {op: [Engine("triton", getattr(quant, op), quant_ok(op)),
                       Engine("reference", getattr(reference, op), ref_ok, fallback=True)] for op in QUANT_OPS}
    quantisers["quant_act_t"].insert(1, Engine("triton transposed", quant.quant_act_t_transposed,
                                               quant_ok("quant_act_t", quant.quant_act_t_transposed, "transposed")))
    quantisers["quant_act_both"] = [Engine("triton", quant.quant_act_both, fused_ok),
                                    Engine("separate", reference.quant_act_both, ref_ok, fallback=True)]
    return quantisers | {
        "gemm": [Engine("torch scaled_mm", torch_gemm.gemm, torch_ok, torch_gemm.accepts),
                 Engine("triton", gemm.gemm, variant_ok("gemm", gemm.self_check)),
                 Engine("reference", reference.gemm, ref_ok, fallback=True)],
        "grouped_gemm": [Engine("triton", grouped_gemm.grouped_gemm,
                                variant_ok("grouped_gemm", grouped_gemm.self_check_gemm)),
                         Engine("reference", reference.grouped_gemm, ref_ok, fallback=True)],
        "grouped_wgrad": [Engine("triton", grouped_gemm.grouped_wgrad,
                                 variant_ok("grouped_wgrad", grouped_gemm.self_check_wgrad)),
                          Engine("reference", reference.grouped_wgrad, ref_ok, fallback=True)],
    }


def triton_quant_exact(op: str, device: torch.device, fn=None, variant: str = "triton") -> bool:
    """Whether Triton quantiser ``op`` (``fn``, default ``quant.<op>``) is bit-exact vs the reference on
    ``device`` (checked once per process, cached; a failure logs one warning)."""
    from . import quant
    verdict, fresh = selfcheck.check(op, variant, device, lambda: quant.self_check(op, device, fn), tol=0.0)
    if fresh and not verdict.ok:
        log.warning("fp8 self-check: the Triton quantiser %s (%s) is not bit-exact on %s: %s", op, variant,
                    selfcheck.device_id(device), verdict.why)
    return verdict.ok
