"""Training-level GPU checks of ``bench.gpu_suite``: the tiny trainer end to end, and one training step of a
depth-reduced ``v3_small``.

Trainer runs (``tiny_runs``): ``python -m trainer +exp=tiny`` as subprocesses (Hydra is needed there; the
suite puts the carried wheels on ``PYTHONPATH``), W&B disabled, no checkpoint, every run in its own Hydra
run dir and one shared data cache. Per-step losses come from each run's ``metrics.jsonl`` and are compared
with ``compare_losses`` against the CPU FP32 run.

``models.build`` draws the weights on the CPU for every device, so the CUDA runs start from exactly the
CPU run's weights. A CUDA FP32 run must then track the CPU FP32 run closely (``FP32_TOL``: only kernel
rounding differs; TF32 is off by default; step by step through the warm-up, where rounding is not yet
amplified). BF16/FP8 change the rounding, so they get ``LossTol``, which was calibrated conservatively,
before the shared init, on runs with different init draws. Measured on CPU against an FP32 run, 40 tiny steps:
three FP32 runs that differ only in the init draw, BF16 autocast from the same init, BF16 from another init, and the
FP8 emulation from the same init (29 steps): per-step losses differ by at most 2.3 %, the mean of the last
10 steps by at most 1.6 %, step 1 by at most 0.12 %; over the 40 steps the loss falls by 21-24 %
(6.97 -> ~5.4). ``LossTol`` allows more than twice that spread (step 1: 1 %, any step: 6 %, last-10 mean:
3 %) and requires every run to have trained (last-10 mean at least 10 % under its first loss), so a broken
FP8 path (no learning, divergence, NaN) fails while init and rounding noise pass.

Training step (``measure_step``): ``models.build`` of the preset with fewer layers, ``parallel.fp8.apply_fp8``
for FP8, BF16 autocast for both (as ``trainer/train.py`` does), AdamW through ``parallel.zero.Replicated``
(the trainer's single-device optimizer), clip 1.0, expert-bias update; random tokens. Warm-up steps first
(Triton compiles there), then the median of timed steps. MFU = tokens/s × FLOPs per token
(``models.params.flops_per_token``) / peak (989 TFLOP/s dense BF16 for the H100, for FP8 too).
No Hydra here: this half imports only models/, parallel/, kernels/ and trainer/metrics.py.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

from trainer.metrics import PEAK_FLOPS

H100_BF16_PEAK = dict(PEAK_FLOPS)["H100"]   # 989e12: dense BF16 tensor-core FLOP/s, the MFU basis (FP8 steps too)
ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------- loss checks
@dataclass(frozen=True)
class LossTol:
    first_rel: float = 0.01     # step-1 loss (≈ ln V at init, whatever the init draw)
    step_rel: float = 0.06      # any single step (of the first ``step_until``, when set)
    tail_rel: float = 0.03      # mean over the last ``tail`` steps
    tail: int = 10
    min_drop: float = 0.10      # each run's last-``tail`` mean must be this fraction under its first loss
    step_until: int | None = None


# The tiny runs' learning-rate warm-up (steps; passed to every run by ``tiny_overrides``).
TINY_WARMUP = 15
# CUDA FP32 vs CPU FP32 from the same weights: one forward differs only by kernel rounding (~1e-6). Through the
# warm-up every step stays within 0.01 % (six CUDA runs of different paths on an H100); past it, near the peak
# learning rate, the tiny run amplifies rounding into excursions of 0.03 % to 3.4 % at one step, which path took
# which rounding deciding (the optimizer paths agree to 1e-7 on the same gradients:
# docs/benchmarks.md). So: step 1 within 1e-4, every warm-up step within 0.1 %, the
# mean of the last 10 within 0.5 %.
FP32_TOL = LossTol(first_rel=1e-4, step_rel=0.001, tail_rel=0.005, step_until=TINY_WARMUP)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare_losses(ref: list[float], got: list[float], tol: LossTol = LossTol()) -> dict:
    """Compare per-step losses ``got`` with the reference run ``ref``. Returns ``ok`` plus the figures
    (``first_rel``, ``max_step_rel`` at ``max_step`` over all steps, ``tail_rel``, ``drop`` of ``got``) and
    ``reasons`` (the per-step rule over the first ``tol.step_until`` steps, when set)."""
    out = {"steps": len(got), "first_rel": None, "max_step_rel": None, "max_step": None, "tail_rel": None,
           "drop": None, "reasons": []}
    reasons = out["reasons"]
    if len(got) != len(ref):
        reasons.append(f"{len(got)} steps logged, reference has {len(ref)}")
    n = min(len(got), len(ref))
    if n < tol.tail + 1:
        reasons.append(f"only {n} comparable steps (need > {tol.tail})")
        out["ok"] = False
        return out
    if not all(math.isfinite(v) for v in got[:n]):
        reasons.append("non-finite loss")
        out["ok"] = False
        return out
    rels = [_rel(g, r) for g, r in zip(got[:n], ref[:n])]
    worst = max(range(n), key=rels.__getitem__)
    ruled = min(n, tol.step_until or n)
    worst_ruled = max(range(ruled), key=rels.__getitem__)
    tail_got, tail_ref = statistics.fmean(got[n - tol.tail:n]), statistics.fmean(ref[n - tol.tail:n])
    out.update(first_rel=rels[0], max_step_rel=rels[worst], max_step=worst + 1, tail_rel=_rel(tail_got, tail_ref),
               drop=1.0 - tail_got / got[0])
    if out["first_rel"] > tol.first_rel:
        reasons.append(f"step 1 differs by {out['first_rel']:.2%} (> {tol.first_rel:.0%})")
    if rels[worst_ruled] > tol.step_rel:
        within = f" within the first {ruled} steps" if ruled < n else ""
        reasons.append(f"step {worst_ruled + 1} differs by {rels[worst_ruled]:.2%} (> {tol.step_rel:.1%}{within})")
    if out["tail_rel"] > tol.tail_rel:
        reasons.append(f"mean of the last {tol.tail} steps differs by {out['tail_rel']:.2%} (> {tol.tail_rel:.0%})")
    if out["drop"] < tol.min_drop:
        reasons.append(f"loss fell only {out['drop']:.1%} (< {tol.min_drop:.0%}): not training")
    out["ok"] = not reasons
    return out


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The per-step rows of a trainer run (``metrics.jsonl``), in step order."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["step"])


def timer_problems(rows: list[dict]) -> list[int]:
    """Steps whose phase times (``time_<phase>_s``, ``trainer/timers.py``: CUDA events on a GPU) are missing or
    add up to more than the step's wall time."""
    bad = []
    for r in rows:
        t = {k: v for k, v in r.items() if k.startswith("time_")}
        if not t.get("time_forward_backward_s", 0.0) > 0 or sum(t.values()) > 1.01 * r["step_time_s"]:
            bad.append(r["step"])
    return bad


def steady_tokens_per_s(rows: list[dict], skip: int = 5) -> float | None:
    """Median tokens/s over the steps after the first ``skip`` (compilation and warm-up excluded)."""
    vals = [r["tokens_per_s"] for r in rows[skip:] if r.get("tokens_per_s")]
    return statistics.median(vals) if vals else None


# ---------------------------------------------------------------------------------------- trainer runs
@dataclass
class TinyRun:
    name: str          # "cuda bf16"
    device: str
    precision: str
    run_dir: Path
    returncode: int | None = None
    seconds: float = 0.0
    output_tail: str = ""
    losses: list[float] = dataclasses.field(default_factory=list)
    tokens_per_s: float | None = None
    error: str = ""
    graph_lines: list[str] = dataclasses.field(default_factory=list)   # what the run logged of train.cuda_graph


def tiny_overrides(steps: int, precision: str, device: str, run_dir: Path, cache_dir: Path) -> list[str]:
    return ["+exp=tiny", f"train.max_steps={steps}", f"optim.warmup_steps={TINY_WARMUP}",
            f"train.precision={precision}", f"train.device={device}",
            "train.eval_batches=2", "logging.wandb.mode=disabled", "logging.progress=false",
            "checkpoint.save_final=false", "checkpoint.resume=none", f"hydra.run.dir={run_dir}",
            f"data.cache_dir={cache_dir}"]


def run_tiny(run: TinyRun, steps: int, cache_dir: Path, env: dict, timeout_s: float, cpu_threads: int = 8,
             extra: tuple[str, ...] = ()) -> TinyRun:
    """Run the tiny trainer once (subprocess, with the ``extra`` overrides); fills ``run`` from its exit code and
    ``metrics.jsonl``."""
    cmd = [sys.executable, "-m", "trainer", *tiny_overrides(steps, run.precision, run.device, run.run_dir, cache_dir),
           *extra]
    env = dict(env, HYDRA_FULL_ERROR="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    if run.device == "cpu":
        env.update(OMP_NUM_THREADS=str(cpu_threads), MKL_NUM_THREADS=str(cpu_threads))
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        run.returncode, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        run.returncode = None
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        run.error = f"timed out after {timeout_s:.0f} s"
    run.seconds = time.monotonic() - t0
    run.output_tail = "\n".join(out.strip().splitlines()[-25:])
    run.graph_lines = [line.strip() for line in out.splitlines() if "train.cuda_graph" in line][:3]
    if run.returncode not in (0, None):
        run.error = f"exit code {run.returncode}"
    try:
        rows = read_metrics(run.run_dir)
        run.losses = [math.nan if r.get("loss") is None else float(r["loss"]) for r in rows]   # null: NaN logged
        run.tokens_per_s = steady_tokens_per_s(rows)
        if bad := timer_problems(rows):
            run.error = run.error or f"phase times (trainer/timers.py) missing or over the step time at steps {bad[:5]}"
    except (OSError, ValueError, KeyError, TypeError) as e:
        run.error = run.error or f"no metrics: {type(e).__name__}: {e}"
    return run


# ---------------------------------------------------------------------------------------- one training step
OPTIM = types.SimpleNamespace(lr=4.2e-4, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)   # exp/v3_small


def reduced_config(preset: str = "v3_small", layers: int = 4):
    """The model preset with ``n_layers`` reduced (first_k_dense and MTP kept)."""
    from configs import model_preset
    cfg = model_preset(preset)
    return dataclasses.replace(cfg, n_layers=layers)


def mfu(tokens_per_s: float, flops_per_token: float, peak: float = H100_BF16_PEAK) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak."""
    return tokens_per_s * flops_per_token / peak


def measure_step(cfg, precision: str, batch: int, seq: int, device: str = "cuda", warmup: int = 2, iters: int = 3,
                 seed: int = 0, profile: bool = False, head_loss: str = "plain", compile: str = "auto",
                 adamw: str = "auto", host_profile: int = 0, moments: str = "auto", cuda_graph: bool = False,
                 master: str = "fp32") -> dict:
    """Train ``iters`` steps after ``warmup`` steps on random tokens; median step time, tokens/s, TFLOP/s,
    MFU (vs ``H100_BF16_PEAK``), peak memory (CUDA ``max_memory_allocated`` over the timed steps; replayed from a
    graph: ``max_memory_reserved``, the graph's pool included) and the
    last loss. ``head_loss`` is ``train.head_loss`` (``parallel.head_loss``), ``compile`` ``train.compile``
    (``parallel.compile``); ``adamw``: ``auto`` (the trainer's optimizer: the Triton AdamW on CUDA after its
    self-check) or ``torch`` (clip, ``torch.optim.AdamW`` fused, the master cast: the path it replaces);
    ``moments``: ``optim.moment_dtype`` of the ``auto`` optimizer (``auto``: BF16 beside BF16 weights).
    ``host_profile``: the ``host_profile`` entry holds the top functions by own time of one more step under
    ``cProfile`` (the host side: Python, dispatch, launches). ``cuda_graph``: forward and backward replayed from a
    CUDA graph (``train.cuda_graph``, ``parallel.cuda_graph``; the warm-up steps capture it). ``master``:
    ``optim.master`` of the ``auto`` optimizer."""
    import torch

    import models
    from models.params import flops_per_token
    from parallel.dims import ParallelDims
    from parallel.zero import build_optimizer
    from parallel.precision import Precision

    dev = torch.device(device)
    torch.manual_seed(seed)
    model = models.build(cfg, device=dev, seed=seed)
    from parallel.head_loss import apply_head_loss
    apply_head_loss(model, head_loss)
    if precision == "fp8":
        from parallel.fp8 import apply_fp8
        apply_fp8(model)
    elif precision != "bf16":
        raise ValueError(f"precision {precision!r}: bf16 or fp8")
    from parallel.compile import apply_compile, enabled
    if enabled(compile, dev):
        apply_compile(model)
    model.train()
    if adamw == "torch":
        from parallel.zero import Replicated
        opt = Replicated(model, OPTIM, ParallelDims(world_size=1), None, Precision(precision).weights, kernel=False)
    else:   # as the trainer
        opt = build_optimizer(model, types.SimpleNamespace(**vars(OPTIM), moment_dtype=moments, master=master),
                              ParallelDims(world_size=1), weights=Precision(precision).weights)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=dev)
    inputs, labels = ids[:, :-1], ids[:, 1:]

    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, cache_enabled=not cuda_graph)

    def forward_backward(inputs, labels):
        with autocast:
            out = model.compute_loss(inputs, labels, mtp_weight=0.3, aux_alpha=1e-4)
        opt.backward(out.loss)
        return out.loss.detach()
    graphed = None
    if cuda_graph:
        from parallel.cuda_graph import WARMUP, CudaGraphs, GraphedStep
        graphed = GraphedStep(forward_backward, model, opt, CudaGraphs(dev))
        warmup = max(warmup, WARMUP + 1)   # the timed steps replay

    def step() -> float:
        loss = graphed((inputs, labels)) if graphed else forward_backward(inputs, labels)
        opt.grads_finite()   # the trainer's check before the update (its answer reaches the host with the step's)
        opt.step(1.0)
        opt.zero_grad()
        model.update_expert_bias(1e-3)
        return loss

    times, host, loss = _timed_steps(step, dev, warmup, iters)
    step_s = statistics.median(times)
    prof = profile_step(step, dev, step_s) if profile else None
    host_top = host_profile_step(step, dev, host_profile) if host_profile else None
    tokens = batch * seq
    fpt = flops_per_token(cfg, seq).per_token
    tps = tokens / step_s
    # A replay allocates nothing: the graph's activations sit in its pool, which the allocator counts as reserved.
    peak = torch.cuda.max_memory_reserved if graphed else torch.cuda.max_memory_allocated
    peak_gb = peak(dev) / 1e9 if dev.type == "cuda" else None
    failed = graphed.failed if graphed else None
    del model, opt, ids, inputs, labels, graphed
    if failed:
        raise RuntimeError(f"the CUDA graph's capture failed ({failed}); the steps ran eagerly")
    return {"precision": precision, "head_loss": head_loss, "compile": compile, "adamw": adamw, "batch": batch,
            "seq": seq, "tokens": tokens, "step_s": step_s, "host_s": statistics.median(host), "step_times_s": times,
            "tokens_per_s": tps, "flops_per_token": fpt, "tflops": tps * fpt / 1e12, "mfu": mfu(tps, fpt),
            "peak_gb": peak_gb, "loss": loss, "finite": math.isfinite(loss), "profile": prof, "host_profile": host_top}


def profile_step(step, dev, step_s: float, top: int = 80) -> dict:
    """One more ``step`` under ``torch.profiler``: the ``top`` GPU kernels by total time (name, calls, ms, share),
    the GPU-busy fraction (summed kernel time over the un-profiled median ``step_s``; streams that overlap count
    twice), and ``ops``: the torch ops whose own kernels took the most GPU time, with their input shapes and the
    repository's frames that called them (``op_rows``; a step replayed from a CUDA graph runs no op there, so only
    its eager parts appear), and ``copies``: the same rows for the copies and casts alone (``copy_rows``). Off CUDA,
    or when the profiler fails: ``{"error": ...}``."""
    import torch
    if dev.type != "cuda":
        return {"error": "no CUDA"}
    try:
        try:
            prof, ops_error = _profiled(step, dev, stacks=True), None
        except Exception as e:  # noqa: BLE001 - without the ops' stacks the kernels still count
            prof, ops_error = _profiled(step, dev, stacks=False), f"{type(e).__name__}: {e}"
        kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
                   and e.self_device_time_total > 0]
        events = [] if ops_error else prof.key_averages(group_by_input_shape=True, group_by_stack_n=OP_FRAMES)
        ops, copies = op_rows(events), copy_rows(events)
    except Exception as e:  # noqa: BLE001 - the profile is an extra; the step's figures stand without it
        return {"error": f"{type(e).__name__}: {e}"}
    busy_us = sum(e.self_device_time_total for e in kernels)
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    rows = [(e.key[:90], e.count, e.self_device_time_total / 1e3, e.self_device_time_total / busy_us)
            for e in kernels[:top]]
    return {"busy_ms": busy_us / 1e3, "busy_fraction": busy_us / 1e6 / step_s, "launches": sum(e.count for e in kernels),
            "top": rows, "ops": ops, "copies": copies, **({"ops_error": ops_error} if ops_error else {})}


def _profiled(step, dev, stacks: bool):
    """One ``step`` under ``torch.profiler``: its CUDA kernels, and with ``stacks`` the host ops with their input
    shapes and Python stacks too."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    extra = dict(record_shapes=True, with_stack=True, experimental_config=stack_config()) if stacks else {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] if stacks else [ProfilerActivity.CUDA],
                 **extra) as prof:
        step()
        torch.cuda.synchronize(dev)
    return prof


OP_FRAMES = 12   # Python frames kept per op event; ``op_rows`` shows the repository's among them


def stack_config():
    """The profiler setting that attaches Python stacks to op events (``with_stack`` alone leaves them empty)."""
    import torch
    return torch._C._profiler._ExperimentalConfig(verbose=True)


def op_rows(events, top: int = 40, time_of=None) -> list[tuple[str, str, str, int, float]]:
    """The ``top`` host-side op events (``torch.profiler`` averages grouped by input shape and stack) by the GPU
    time of their own kernels (``time_of(event)``, µs): (op, input shapes, the Tensor method and the calling frames
    inside this repository, innermost first, calls, ms). Which op launched a kernel, and from which line, is what
    the kernel table cannot say (a ``direct_copy`` kernel is any of ``copy_``, ``contiguous``, ``clone``, ``to``)."""
    import torch
    time_of = time_of or (lambda e: e.self_device_time_total)
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and time_of(e) > 0]
    cpu.sort(key=time_of, reverse=True)
    return [(e.key, str(e.input_shapes)[:80], _callers(e.stack or [])[:160], e.count, time_of(e) / 1e3)
            for e in cpu[:top]]


# The op whose own kernel a copy or cast is: ``to``, ``contiguous``, ``clone``, ``reshape`` and the rest reach it.
COPY_OPS = ("aten::copy_",)


def copy_rows(events, top: int = 30, time_of=None) -> list[tuple[str, str, str, int, float]]:
    """``op_rows`` of the copies and casts alone, however small each is (many small rows add up: a step's
    ``direct_copy`` and BF16-cast kernels, spread over dozens of shapes and calling lines)."""
    rows = op_rows(events, top=len(events), time_of=time_of)
    return [r for r in rows if r[0] in COPY_OPS][:top]


def _callers(stack: list[str]) -> str:
    """``contiguous() < models/moe.py(88): combine < ...``: the first Tensor method, then this repository's frames
    (not bench's, which only drive the step, nor a virtual environment's); frames name files as imported, absolute
    or from the working directory."""
    method = next((f.split()[2] + "()" for f in stack if f.startswith("<built-in method ")), None)
    ours = []
    for f in stack:
        path = Path(f.split("(", 1)[0])
        if f.startswith("<") or path.suffix != ".py" or not path.exists():
            continue
        try:
            rel = path.resolve().relative_to(ROOT)
        except ValueError:
            continue
        if rel.parts[0] != "bench" and not any(p.startswith(".") or p == "site-packages" for p in rel.parts):
            ours.append(f"{rel.as_posix()}{f[len(str(path)):]}")
    return " < ".join(([method] if method else []) + ours)


def host_profile_step(step, dev, top: int) -> str:
    """One more ``step`` under ``cProfile``: the ``top`` functions by own time, as ``pstats`` prints them, and the
    step's host time and wall time under the profiler."""
    import cProfile
    import io
    import pstats

    import torch
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda *a: None)
    sync(dev)
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    step()
    host = time.perf_counter() - t0
    pr.disable()
    sync(dev)
    wall = time.perf_counter() - t0
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(top)
    return f"under cProfile: host {host * 1e3:.1f} ms, wall {wall * 1e3:.1f} ms\n" + out.getvalue()


def _timed_steps(step, dev, warmup: int, iters: int) -> tuple[list[float], list[float], float]:
    """Run ``step`` (returns the loss as a device tensor) ``warmup`` times, reset CUDA's peak memory, then time
    ``iters`` more runs (each waits for the device); -> (seconds of each timed run, seconds until each run's
    ``step`` returned: the host's enqueue time, the last loss)."""
    import torch

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    for _ in range(warmup):
        loss = step()
    sync()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times, host = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        loss = step()
        host.append(time.perf_counter() - t0)
        sync()
        times.append(time.perf_counter() - t0)
    return times, host, float(loss)


def measure_step_fitting(cfg, precision: str, batch: int, seq: int, device: str = "cuda", min_batch: int = 1,
                         **kw) -> dict:
    """``measure_step``, halving ``batch`` after a CUDA out-of-memory error (noted in ``oom_retries``)."""
    import torch
    tries = []
    while True:
        try:
            res = measure_step(cfg, precision, batch, seq, device, **kw)
            res["oom_retries"] = tries
            return res
        except torch.cuda.OutOfMemoryError:
            tries.append(batch)
            if device != "cpu":
                torch.cuda.empty_cache()
            if batch // 2 < min_batch:
                raise
            batch //= 2


def env_with_path(extra: str | None) -> dict:
    """``os.environ`` with ``extra`` prepended to PYTHONPATH and the repo root after it."""
    env = dict(os.environ)
    parts = [p for p in (extra, str(ROOT), env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env
