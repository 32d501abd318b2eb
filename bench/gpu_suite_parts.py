"""The parts of ``bench.gpu_suite``: (a) the kernel tests, (b) the FP8 benches, (c) the tiny trainer and
(d) one training step. Each ``part_*(ctx, part)`` fills ``part`` (tables, marks, notes, headline). No Hydra,
datasets or wandb at import; torch and the benches are imported inside the parts."""
from __future__ import annotations

import importlib.util
import os
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from bench.gpu_suite_ctx import (DENSE_MIN, DENSE_VS_TORCH_MIN, GROUPED_MIN, QUANT_MIN, QUANT_TARGET_ELEMS, QUANT_TARGET_KERNELS, ROOT,
                                 STEP_MIN, TRAINER_PRECISIONS, Ctx, declared_marks, run_cmd, tail)
from bench.suite_report import Mark, Part, Table, min_mark

KERNEL_TESTS = ("tests/test_fp8_kernels.py", "tests/test_fp8_engines.py", "tests/test_fp8_linear.py",
                "tests/test_fp8_tuning.py", "tests/test_cross_entropy.py", "tests/test_compile.py",
                "tests/test_adamw_kernel.py", "tests/test_hopper_gate.py", "tests/test_cuda_graph.py")


# ---------------------------------------------------------------------------------------------- (a) engines
def part_engines(ctx: Ctx, part: Part) -> None:
    """Every launch variant of the Triton GEMMs (warp-specialised included), the Triton quantisers and torch's
    blockwise GEMM, self-checked on this device; then what ``auto`` uses per op."""
    import torch

    import kernels
    from bench import common
    kernels.configure()
    from kernels import gemm, grouped_gemm, quant, selfcheck, torch_gemm
    dev = torch.device(common.DEVICE)
    checks = [(k, name, (lambda fn=fn, v=v: fn(v, dev)), selfcheck.GEMM_TOL)
              for k, fn in (("gemm", gemm.self_check), ("grouped_gemm", grouped_gemm.self_check_gemm),
                            ("grouped_wgrad", grouped_gemm.self_check_wgrad))
              for name, v in gemm.VARIANTS.items()]
    checks += [(op, "triton", lambda op=op: quant.self_check(op, dev), 0.0)
               for op in ("quant_act", "quant_act_t", "quant_act_both", "quant_weight")]
    checks.append(("quant_act_t", "transposed",
                   lambda: quant.self_check("quant_act_t", dev, quant.quant_act_t_transposed), 0.0))
    if not torch_gemm.unavailable(dev):
        checks.append(("gemm", "torch scaled_mm", lambda: torch_gemm.self_check(dev), selfcheck.GEMM_TOL))
    rows = []
    for kernel, name, run, tol in checks:
        t0 = time.monotonic()
        verdict, _ = selfcheck.check(kernel, name, dev, run, tol)
        rows.append([kernel, name, "right" if verdict.ok else "WRONG", rep_f(verdict.err, ".1e"),
                     f"{(time.monotonic() - t0) * 1e3:.0f}", verdict.why])
    part.tables.append(Table(["kernel", "variant", "verdict", "error", "check ms (incl. compile)", "why"], rows))
    ops = kernels.get_ops("auto", dev)
    summary = ops.summary() if hasattr(ops, "summary") else "auto = emulation (no CUDA)"
    part.notes.append(f"`auto`: {summary}")
    part.notes.append(f"device: {selfcheck.device_id(dev)}. Errors: relative (Frobenius) vs `kernels/reference.py` on "
                      f"small ragged problems (limit {selfcheck.GEMM_TOL:.0e}); quantisers: fraction of bytes/scales "
                      f"that differ (must be 0).")
    ok = "NONE" not in summary
    part.marks = [Mark("default engines right on this device", "every op has a self-checked engine",
                       summary.split(": ", 1)[-1], ok, "check")]
    wrong = [f"{r[0]} {r[1]}" for r in rows if r[2] != "right"]
    part.headline = f"{len(rows) - len(wrong)} of {len(rows)} right" + (f"; wrong: {', '.join(wrong)}" if wrong else "")


# ---------------------------------------------------------------------------------------------- (a) kernels
def junit_counts(xml_path: str | Path) -> dict:
    """Totals of a pytest JUnit XML: tests, passed, failures, errors, skipped, and the failed test ids."""
    import xml.etree.ElementTree as ET
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    c = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    c["passed"] = c["tests"] - c["failures"] - c["errors"] - c["skipped"]
    c["failed_ids"], c["messages"] = [], {}
    for tc in root.iter("testcase"):
        bad = tc.find("failure") if tc.find("failure") is not None else tc.find("error")
        if bad is not None:
            name = f"{tc.get('classname', '')}::{tc.get('name', '')}"
            c["failed_ids"].append(name)
            c["messages"][name] = _failure_line(bad.get("message", "") or bad.text or "")
    return c


def _failure_line(text: str, width: int = 240) -> str:
    """The line of a pytest failure that says what failed (``E   ...``/the assertion), shortened."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    pick = next((ln for ln in lines if ln.startswith("E ") or "Error" in ln), lines[0] if lines else "")
    return pick.replace("|", "/")[:width]


def part_kernels(ctx: Ctx, part: Part) -> None:
    files = [f for f in KERNEL_TESTS if (ROOT / f).exists()]
    missing = [f for f in KERNEL_TESTS if f not in files]
    if missing:
        part.notes.append(f"not in this checkout (not run): {', '.join(missing)}")
    if not files:
        part.status, part.headline = "skipped", "no kernel test files"
        return
    xml = ctx.tmp / "kernels.xml"
    # not the slow test: 200 training steps of the tiny model in FP8 emulation on the CPU (no GPU kernel)
    cmd = [sys.executable, "-m", "pytest", *files, "-q", "-m", "not slow", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    if importlib.util.find_spec("xdist") is not None and not ctx.smoke:
        cmd += ["-n", str(max(2, min(8, (os.cpu_count() or 4) // 2)))]   # 8 on a 16-core host: ~60 s
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += ["--timeout=150"]        # one hung test fails alone instead of eating the part's budget
    budget = max(30.0, ctx.part_deadline("kernels") - time.monotonic())
    part.notes.append(f"command: `{shlex.join(['python', *cmd[1:]]).replace(str(ctx.tmp), '$TMP')}` "
                      f"(timeout {budget:.0f} s)")
    from bench.train_check import env_with_path
    ok, site, why = hydra_path(ctx)         # test_fp8_linear's model tests read the presets through omegaconf
    if not ok:
        part.notes.append(f"without omegaconf (its tests skip): {why}")
    try:
        import kernels
        kernels.configure()                   # before a kernel module is imported
        from kernels.quant import FUSED_ENV   # the opt-in kernel is verified here, not a default
        proc = run_cmd(cmd, env={**env_with_path(site), FUSED_ENV: "1"}, timeout=budget)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = None, (e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or "")
        part.error = f"pytest timed out after {budget:.0f} s"
    part.log = tail(out, 40)
    if not xml.exists():
        part.error = part.error or f"pytest exit code {rc}, no JUnit XML"
        part.marks = [Mark(declared_marks("kernels")[0].name, "0 failed, 0 errors", f"exit code {rc}", False, "check")]
        part.headline = part.error if rc is None else f"pytest exit {rc}"
        return
    c = junit_counts(xml)
    part.tables.append(Table(["tests", "passed", "failed", "errors", "skipped", "exit code"],
                             [[c["tests"], c["passed"], c["failures"], c["errors"], c["skipped"], rc]]))
    if c["failed_ids"]:
        part.notes.append("failed: " + ", ".join(f"`{t}`" for t in c["failed_ids"][:30]) +
                          (f" (+{len(c['failed_ids']) - 30} more)" if len(c["failed_ids"]) > 30 else ""))
        part.tables.append(Table(["failed test", "first line of the failure"],
                                 [[t, msg] for t, msg in list(c["messages"].items())[:40]]))
    ok = rc == 0 and c["failures"] == 0 and c["errors"] == 0 and c["passed"] > 0
    part.marks = [Mark("kernel tests pass compiled on the GPU", "0 failed, 0 errors",
                       f"{c['passed']} passed, {c['failures']} failed, {c['errors']} errors, {c['skipped']} skipped",
                       ok, "check")]
    part.headline = f"{c['passed']} passed, {c['failures']} failed, {c['errors']} errors, {c['skipped']} skipped"


# ---------------------------------------------------------------------------------------------- (b) benches
def quant_shapes(ctx: Ctx) -> list[tuple[int, int]]:
    if ctx.smoke:
        return [(256, 384)]
    if ctx.quick:
        return [(4096, 7168), (16384, 2048), (16384, 7168)]
    return [(r, c) for r in (4096, 16384) for c in (2048, 7168, 16384)]


def dense_shapes(ctx: Ctx) -> list[tuple[int, int, int]]:
    if ctx.smoke:
        return [(256, 256, 384)]
    if ctx.quick:
        return [(4096, 2048, 7168), (4096, 7168, 2048), (4096, 7168, 7168), (16384, 7168, 7168),
                (16384, 16384, 7168), (16384, 7168, 16384)]
    return [(m, n, k) for m in (4096, 16384) for n in (2048, 7168, 16384) for k in (2048, 7168, 16384)]


def is_large(M: int, N: int, K: int) -> bool:
    """The shapes the dense target is judged on."""
    return M >= 8192 and N >= 7168 and K >= 7168


def part_quant(ctx: Ctx, part: Part) -> None:
    from bench import fp8_quant
    rows = fp8_quant.measure(quant_shapes(ctx), deadline=ctx.part_deadline("quant"))
    part.tables.append(Table(fp8_quant.HEADERS, fp8_quant.table_rows(rows)))
    done = [r for r in rows if not r.get("skipped")]
    big = [r for r in done if ctx.smoke or r["R"] * r["C"] >= QUANT_TARGET_ELEMS]
    part.marks = [min_mark(f"quantisation {k} vs device copy", f">= {QUANT_MIN:.2f} of copy GB/s", QUANT_MIN,
                           [(r["shape"], r.get("of_copy")) for r in big if r["kernel"] == k], unit="")
                  for k in QUANT_TARGET_KERNELS]
    n_exact = sum(bool(r.get("exact")) for r in done)
    part.marks.append(Mark("quantisers bit-exact vs reference", "all", f"{n_exact} of {len(done)}",
                           bool(done) and n_exact == len(done), "check"))
    part.notes += [f"GB/s = (BF16 bytes read + E4M3 bytes and FP32 scales written) / median time; copy = "
                   f"`dst.copy_(src)` of the same BF16 tensor, bytes read + written. Targets judged on tensors of "
                   f">= {QUANT_TARGET_ELEMS // 2**20} Mi elements."]
    copies = [r["copy_gbs"] for r in done if r.get("copy_gbs")]
    part.headline = (f"copy {statistics.median(copies):.0f} GB/s; of copy (min): " if copies else "") + ", ".join(
        f"{k} {m.got.split(' ')[0]}" for k, m in zip(QUANT_TARGET_KERNELS, part.marks) if m.met is not None)
    _skipped_note(part, rows)


def part_gemm(ctx: Ctx, part: Part) -> None:
    from bench import fp8_gemm
    rows = fp8_gemm.measure(dense_shapes(ctx), deadline=ctx.part_deadline("gemm"))
    part.tables.append(Table(fp8_gemm.HEADERS, fp8_gemm.table_rows(rows)))
    done = [r for r in rows if not r.get("skipped")]
    large = [r for r in done if ctx.smoke or is_large(r["M"], r["N"], r["K"])]
    part.marks = [min_mark(f"dense FP8 GEMM {lay} (auto) vs torch BF16, large shapes", f">= {DENSE_MIN:.2f}x",
                           DENSE_MIN, [(r["shape"], r.get("vs_bf16")) for r in large if r["layout"] == lay])
                  for lay in fp8_gemm.LAYOUTS]
    part.marks.append(min_mark("dense FP8 GEMM (auto) vs torch blockwise scaled_mm", f">= {DENSE_VS_TORCH_MIN:.2f}x",
                               DENSE_VS_TORCH_MIN, [(f"{r['shape']} {r['layout']}", r.get("vs_torch")) for r in done]))
    n_ok = sum(bool(r.get("ok")) for r in done)
    part.marks.append(Mark("dense FP8 GEMM matches reference (auto, triton)", "rel. err <= 1e-2 everywhere",
                           f"{n_ok} of {len(done)}", bool(done) and n_ok == len(done), "check"))
    engines = sorted({r.get("auto_engine", "") for r in done if r.get("auto_engine")})
    part.notes += ["Large shapes (target): M >= 8192, N >= 7168, K >= 7168. TFLOP/s = 2·M·N·K / median time. "
                   "auto/bf16, auto/torch and triton/torch are speed-ups (> 1: faster). `auto` picks, per shape, the "
                   "fastest self-checked engine (kernels/auto.py); torch blockwise = `F.scaled_mm` with the same "
                   "block scales (kernels/torch_gemm.py).",
                   f"engines auto chose: {', '.join(engines) or 'none'}."]
    heads = _min_ratios(large, "layout", fp8_gemm.LAYOUTS)
    vs_torch = [r["vs_torch"] for r in done if r.get("vs_torch")]
    part.headline = (("large shapes, min auto/bf16: " + ", ".join(heads)) if heads else "no timings") + (
        f"; min auto/torch {min(vs_torch):.2f}x" if vs_torch else "")
    _skipped_note(part, rows)


def _min_ratios(rows: list[dict], field: str, values) -> list[str]:
    """``"<value> <min fp8/bf16>x"`` for each ``value`` of ``row[field]`` that has timings."""
    heads = []
    for value in values:
        v = [r["vs_bf16"] for r in rows if r[field] == value and r.get("vs_bf16")]
        if v:
            heads.append(f"{value} {min(v):.2f}x")
    return heads


def part_grouped(ctx: Ctx, part: Part) -> None:
    from bench import fp8_grouped_gemm as fg
    if ctx.smoke:
        kw = {"experts_list": [2], "tokens": 256, "dim": 256, "inter": 128}
    else:
        kw = {"experts_list": [8, 32] if ctx.quick else [8, 16, 32], "tokens": 32768, "dim": 7168, "inter": 2048}
    rows = fg.measure(**kw, deadline=ctx.part_deadline("grouped"))
    part.tables.append(Table(fg.HEADERS, fg.table_rows(rows)))
    done = [r for r in rows if not r.get("skipped")]
    part.marks = [min_mark("grouped FP8 GEMM fwd vs torch._grouped_mm BF16", f">= {GROUPED_MIN:.2f}x", GROUPED_MIN,
                           [(f"E={r['E']} {r['gemm']}", r.get("vs_bf16")) for r in done if r["pass"] == "fprop"])]
    n_ok = sum(bool(r.get("ok")) for r in done)
    part.marks.append(Mark("grouped FP8 GEMM matches reference", "rel. err <= 1e-2 everywhere",
                           f"{n_ok} of {len(done)}", bool(done) and n_ok == len(done), "check"))
    part.notes.append(f"R = {kw['tokens']} routed token copies per rank, D = {kw['dim']}, F = {kw['inter']}; "
                      f"ragged expert counts (0.5x-1.5x of the mean, multiples of 16). TFLOP/s = 2·R·N·K / median time.")
    heads = _min_ratios(done, "pass", fg.PASSES)
    part.headline = ("min fp8/bf16: " + ", ".join(heads)) if heads else "no timings"
    _skipped_note(part, rows)


def _skipped_note(part: Part, rows: list[dict]) -> None:
    n = sum(bool(r.get("skipped")) for r in rows)
    if n:
        part.notes.append(f"{n} row(s) not run: the part's time budget ran out (rerun with --parts {part.key}).")


# ---------------------------------------------------------------------------------------------- (c) trainer
def hydra_path(ctx: Ctx) -> tuple[bool, str | None, str]:
    """``(available, PYTHONPATH entry, reason)``: import hydra/omegaconf in a subprocess; if missing, install
    the carried wheels (``--wheels``) into a temp dir and try again."""
    from bench.train_check import env_with_path
    check = [sys.executable, "-c", "import hydra, omegaconf"]
    if run_cmd(check, env=env_with_path(None), timeout=120).returncode == 0:
        return True, None, ""
    wheels = sorted(Path(ctx.args.wheels).glob("*.whl"))
    if not wheels:
        return False, None, (f"hydra-core/omegaconf are not installed and {ctx.args.wheels} holds no wheels "
                             f"(run `bash bench/gpu_wheels.sh` on a machine with PyPI and carry .whl)")
    site = ctx.tmp / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", str(site), *map(str, wheels)]
    r = run_cmd(pip, timeout=300)
    if r.returncode != 0:
        return False, None, f"pip install of the carried wheels failed: {tail(r.stdout + r.stderr, 3)}"
    r = run_cmd(check, env=env_with_path(str(site)), timeout=120)
    if r.returncode != 0:
        return False, None, f"hydra still not importable after installing the wheels: {tail(r.stderr, 2)}"
    return True, str(site), ""


def part_trainer(ctx: Ctx, part: Part) -> None:
    from bench.train_check import FP32_TOL, LossTol, TinyRun, compare_losses, env_with_path, run_tiny
    ok, site, why = hydra_path(ctx)
    if not ok:
        part.status, part.headline = "skipped", "Hydra unavailable"
        part.notes.append(f"skipped: {why}")
        return
    if site:
        part.notes.append(f"Hydra from the carried wheels ({', '.join(p.name for p in Path(ctx.args.wheels).glob('*.whl'))})")
    tol = LossTol()
    steps = 12 if ctx.smoke else 40
    gpu = "cpu" if ctx.smoke else "cuda"
    chosen = getattr(ctx.args, "trainer_precisions", None) or TRAINER_PRECISIONS
    runs = [TinyRun("cpu fp32", "cpu", "fp32", ctx.tmp / "tiny_cpu_fp32")] + \
        [TinyRun(f"{gpu} {p}", gpu, p, ctx.tmp / f"tiny_{gpu}_{p}") for p in TRAINER_PRECISIONS if p in chosen]
    env = env_with_path(site)
    deadline = ctx.part_deadline("trainer")
    for run in runs:
        left = deadline - time.monotonic()
        if left < 20:
            run.error = "not run: time budget"
            continue
        extra = () if run.device == "cpu" else tuple(getattr(ctx.args, "trainer_overrides", None) or ())
        run_tiny(run, steps, ctx.tmp / "data_cache", env, timeout_s=left, cpu_threads=min(8, os.cpu_count() or 1),
                 extra=extra)
        print(f"  trainer {run.name}: {run.error or 'ok'} in {run.seconds:.0f} s", flush=True)
    ref = runs[0]
    rows, marks = [], []
    for run in runs:
        run_tol = FP32_TOL if run.precision == "fp32" else tol
        cmp = compare_losses(ref.losses, run.losses, run_tol) if run is not ref and ref.losses and run.losses else None
        last = statistics.fmean(run.losses[-tol.tail:]) if len(run.losses) >= tol.tail else None
        rows.append([run.name, len(run.losses), rep_f(run.losses[0] if run.losses else None, ".4f"),
                     rep_f(last, ".4f"), rep_f(run.tokens_per_s, ".0f"),
                     rep_f(cmp and cmp["first_rel"], ".2%"), rep_f(cmp and cmp["max_step_rel"], ".2%") +
                     (f" (step {cmp['max_step']})" if cmp and cmp["max_step"] else ""), rep_f(cmp and cmp["tail_rel"], ".2%"),
                     "reference" if run is ref else ("ok" if cmp and cmp["ok"] else "; ".join(
                         (cmp or {}).get("reasons", []) or [run.error or "no losses"])), f"{run.seconds:.0f}"])
        if run is not ref:
            got = ("; ".join(cmp["reasons"]) or f"max step {cmp['max_step_rel']:.2%}, last-{tol.tail} mean "
                   f"{cmp['tail_rel']:.2%}") if cmp else (run.error or ref.error or "no losses")
            marks.append(Mark(f"tiny {run.name} losses vs CPU fp32", "within tolerance", got,
                              bool(cmp and cmp["ok"]), "check"))
        if run.error:
            part.notes.append(f"{run.name}: {run.error}")
        if run.graph_lines:
            part.notes.append(f"{run.name}: " + " / ".join(f"`{line[-150:]}`" for line in run.graph_lines))
    part.marks = marks
    part.tables.append(Table(["run", "steps", "loss step 1", f"mean last {tol.tail}", "tokens/s (median, after 5)",
                              "step-1 Δ", "max step Δ", f"last-{tol.tail} Δ", "vs CPU fp32", "wall s"], rows))
    if getattr(ctx.args, "trainer_overrides", None):
        part.notes.append(f"the GPU runs with `{' '.join(ctx.args.trainer_overrides)}`")
    part.notes.append(f"{steps} steps of `python -m trainer +exp=tiny` (batch 16 x 128 tokens), W&B disabled, no "
                      f"checkpoint; every run starts from the same weights (drawn on the CPU). Tolerances "
                      f"(relative): {gpu} fp32 step 1 <= {FP32_TOL.first_rel:.0e}, each of the first "
                      f"{FP32_TOL.step_until} steps (the warm-up) <= {FP32_TOL.step_rel:.1%}, "
                      f"last {FP32_TOL.tail} <= {FP32_TOL.tail_rel:.1%}; bf16/fp8 step 1 <= {tol.first_rel:.0%}, any step "
                      f"<= {tol.step_rel:.0%}, mean of the last {tol.tail} <= {tol.tail_rel:.0%}; every run's loss must "
                      f"fall >= {tol.min_drop:.0%}; see bench/train_check.py.")
    part.log = "\n\n".join(f"[{r.name}]\n{r.output_tail}" for r in runs if r.error and r.output_tail)
    if any(r.error for r in runs) and not part.error:
        part.error = "; ".join(f"{r.name}: {r.error}" for r in runs if r.error)
    heads = [f"{r.name} {r.tokens_per_s:.0f} tok/s" for r in runs if r.tokens_per_s]
    heads.append("losses " + ("within tolerance" if marks and all(m.met for m in marks) else "NOT within tolerance"))
    part.headline = "; ".join(heads)


def rep_f(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


# ---------------------------------------------------------------------------------------------- (d) step
def part_step(ctx: Ctx, part: Part) -> None:
    import torch

    from bench.train_check import H100_BF16_PEAK, measure_step_fitting, reduced_config
    ok, site, why = hydra_path(ctx)         # the model presets live in configs/, which imports omegaconf
    if not ok:
        part.status, part.headline = "skipped", "omegaconf unavailable"
        part.notes.append(f"skipped: {why}")
        return
    if site and site not in sys.path:
        sys.path.insert(0, site)
    if ctx.smoke:
        cfg, batch, seq, dev, iters = reduced_config("tiny", 2), 2, 64, "cpu", 1
    else:
        cfg, batch, seq, dev, iters = reduced_config("v3_small", 4), 4, 2048, "cuda", 3 if ctx.quick else 5
    res, deadline = {}, ctx.part_deadline("step")
    for prec, head in (("bf16", "plain"), ("fp8", "plain"), ("bf16", "fused"), ("fp8", "fused")):
        key = prec if head == "plain" else f"{prec} head_loss={head}"
        if time.monotonic() > deadline and res:
            part.notes.append(f"{key}: not run (time budget)")
            continue
        try:
            res[key] = measure_step_fitting(cfg, prec, batch, seq, dev, iters=iters, profile=True, head_loss=head,
                                            cuda_graph=dev == "cuda")
        except Exception as e:      # noqa: BLE001 - record and go on to the other precision
            part.error += f"{key}: {type(e).__name__}: {e}\n"
            part.log += f"[{key}]\n{traceback.format_exc(limit=6)}\n"
        if dev == "cuda":
            torch.cuda.empty_cache()
    _step_tables(part, res, H100_BF16_PEAK)
    speed = res["bf16"]["step_s"] / res["fp8"]["step_s"] if "bf16" in res and "fp8" in res else None
    part.marks = [min_mark("FP8 training step faster than BF16", f"> {STEP_MIN:.2f}x",
                           STEP_MIN + 1e-9, [("bf16 step / fp8 step", speed)]),
                  Mark("training step losses finite", "bf16 and fp8",
                       ", ".join(f"{p} {r['loss']:.3f}" for p, r in res.items()) or "no step ran",
                       {"bf16", "fp8"} <= set(res) and all(r["finite"] for r in res.values()), "check")]
    first = next(iter(res.values()), None)
    part.notes.append(f"Model: preset `{'tiny' if ctx.smoke else 'v3_small'}` with n_layers={cfg.n_layers} "
                      f"(first_k_dense={cfg.first_k_dense}, mtp_depth={cfg.mtp_depth}, {cfg.n_routed_experts} routed "
                      f"experts, top-{cfg.n_activated_experts}); random tokens; forward+backward+AdamW+clip+bias update, "
                      f"norms, SwiGLU and rope compiled (`train.compile=auto`), BF16 autocast (fp8: `apply_fp8`, "
                      f"Triton kernels), forward and backward replayed from a CUDA graph (`train.cuda_graph=auto`; "
                      f"peak memory: reserved, the graph's pool included); {iters} timed steps after 3 warm-up steps; "
                      f"host ms: until the step's last op was enqueued (host-bound when close to the step)."
                      + (f" FLOPs/token {first['flops_per_token'] / 1e9:.2f} G (models.params.flops_per_token)."
                         if first else ""))
    part.headline = (f"fp8/bf16 step speed-up {speed:.2f}x; MFU " + ", ".join(f"{p} {r['mfu']:.1%}" for p, r in res.items())
                     if speed else "incomplete")


def _step_tables(part: Part, res: dict, peak: float) -> None:
    """The step part's table (one row per measured variant) and each variant's top-kernels table."""
    rows = []
    for prec, r in res.items():
        rows.append([prec, f"{r['batch']} x {r['seq']}", f"{r['step_s'] * 1e3:.1f}", f"{r['host_s'] * 1e3:.1f}",
                     f"{r['tokens_per_s']:.0f}",
                     f"{r['tflops']:.1f}", f"{r['mfu']:.1%}", rep_f(r["peak_gb"], ".1f"), f"{r['loss']:.3f}",
                     ", ".join(f"{t * 1e3:.0f}" for t in r["step_times_s"])])
        if r["oom_retries"]:
            part.notes.append(f"{prec}: out of memory at batch {r['oom_retries']}, measured at batch {r['batch']}")
    part.tables.append(Table(["precision", "batch x seq", "step ms (median)", "host ms", "tokens/s", "model TFLOP/s",
                              f"MFU (vs {peak / 1e12:.0f})", "peak mem GB", "loss", "step times ms"], rows))
    for prec, r in res.items():
        prof = r.get("profile") or {}
        if prof.get("top"):
            part.tables.append(Table([f"{prec}: top GPU kernels", "calls", "ms", "share of GPU time"],
                                     [[name, n, f"{ms:.2f}", f"{share:.1%}"]
                                      for name, n, ms, share in prof["top"][:12]]))
            if prof.get("ops"):
                part.tables.append(Table([f"{prec}: ops by their kernels' time", "input shapes", "called from", "calls",
                                          "ms"], [[op, shapes, where, n, f"{ms:.2f}"]
                                                  for op, shapes, where, n, ms in prof["ops"][:12]]))
            if prof.get("copies"):
                part.tables.append(Table([f"{prec}: copies and casts, input shapes", "called from", "calls", "ms"],
                                         [[shapes, where, n, f"{ms:.2f}"]
                                          for _, shapes, where, n, ms in prof["copies"][:12]]))
            part.notes.append(f"{prec} profile: GPU busy {prof['busy_ms']:.1f} ms = {prof['busy_fraction']:.0%} of the "
                              f"{r['step_s'] * 1e3:.1f} ms step, {prof['launches']} kernel launches (one profiled step "
                              f"after the timed ones).")
        elif prof.get("error"):
            part.notes.append(f"{prec} profile: {prof['error']}")
