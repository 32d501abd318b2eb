"""Hopper compile gate: compile every Triton kernel in ``kernels/`` for sm_90a — no GPU needed — at the
specialisations its real launches use, and check what the compiled code does.

Launches: ``launches()`` runs the FP8 training call sequence of ``parallel/fp8.py`` (Fprop, Dgrad, Wgrad of
a dense linear and of the routed experts), then the optimizer's AdamW, through the *public wrappers* on meta
tensors of production shapes, with each kernel's ``run`` swapped for a recorder: grid, arguments, constexprs,
``num_warps`` and ``num_stages`` come from the wrappers' own launch code, and the specialisation from
Triton's own binder (``specialize_impl``), exactly as ``JITFunction.run`` would at launch. The GEMMs are also
compiled on their pointer path, and a control compiles the dense GEMM with ``num_stages=1``.

Compiles target ``GPUTarget("cuda", 90, 32)`` in worker subprocesses with ``TRITON_INTERPRET=0`` (the caller
may have imported ``kernels`` under the interpreter) and a fresh Triton cache. Each report holds warps,
global scratch, registers and local memory (``cuobjdump``), shared memory, the PTX/SASS counts of wgmma,
cp.async, TMA loads and setmaxnreg, the depth of the FP8 operand ring in shared memory (``smem_stages``) and
the largest ``wgmma.wait_group N`` (``wgmma_in_flight``).

Checks: ``failures``. The control must be *rejected* (unpipelined), which shows the pipelining check bites.

CLI (prints the table; exit 1 on any failure): ``python -m kernels.hopper_gate [--json] [--jobs N]``.
Speed is not measured (that needs a GPU); neither is correctness (the interpreter tests do that).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

H100_SMEM_PER_BLOCK = 227 * 1024          # cudaDevAttrMaxSharedMemoryPerBlockOptin on H100/H200
TARGET = ("cuda", 90, 32)                 # sm_90a, warp size 32
CONTROL = "control: gemm fprop, num_stages=1"

# Production problem (DeepSeek-V3, per rank): 4096 tokens, hidden 7168, routed-expert intermediate 2048,
# 8 local experts with ragged counts incl. empty ones. The specialisation sees which integers equal 1 or
# are multiples of 16 and the dtypes; the ragged counts are data the kernels read at run time.
TOKENS, HIDDEN, INTER = 4096, 7168, 2048
EXPERT_TOKENS = (0, 700, 1, 1499, 0, 513, 1300, 83)
QUANT_KERNELS = ("_cast_kernel", "_quant_act_kernel", "_quant_act_t_kernel", "_quant_weight_kernel",
                 "_quant_act_both_kernel")
IEEE_KERNELS = ("_adamw_kernel",)       # the optimizer: torch's AdamW to FP32 rounding needs IEEE div and sqrt


@dataclass
class Launch:
    name: str           # where the launch comes from, e.g. "gemm fprop"
    kernel: object      # the @triton.jit function
    args: tuple
    kwargs: dict


@contextlib.contextmanager
def _recording(kernels, sink: list, name: list):
    """Swap each kernel's ``run`` (what ``kernel[grid](...)`` calls) for a recorder of the launch."""
    for k in kernels:
        k.run = lambda *args, grid, warmup, _k=k, **kwargs: sink.append(Launch(name[0], _k, args, kwargs))
    try:
        yield
    finally:
        for k in kernels:
            del k.run


def launches() -> list[Launch]:
    """Every kernel launch of one FP8 training step of a dense linear and a routed-expert layer (the call
    sequence of ``parallel/fp8.py``), then the GEMMs on their pointer path; recorded on meta tensors."""
    import torch

    from . import _adamw_kernels, gemm, grouped_gemm, quant

    kernels = [getattr(quant, k) for k in QUANT_KERNELS] + [getattr(_adamw_kernels, k) for k in IEEE_KERNELS]
    kernels += [quant._transpose_kernel, gemm._gemm_kernel, grouped_gemm._grouped_gemm_kernel,
                grouped_gemm._grouped_wgrad_kernel]
    out, name = [], [""]

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="meta")

    def call(label, fn, *args, **kwargs):
        name[0] = label
        return fn(*args, **kwargs)

    T, H, F = TOKENS, HIDDEN, INTER
    tpe = torch.tensor(EXPERT_TOKENS).to("meta")
    R, E = sum(EXPERT_TOKENS), len(EXPERT_TOKENS)
    pointers = {"TMA": False}
    with _recording(kernels, out, name):
        # dense linear y = x·Wᵀ (x [T,H], W [F,H]); backward dx = dy·W, dW = dyᵀ·x
        xq, xs = call("linear fprop", quant.quant_act, meta(T, H))
        wq, ws, wq_t = call("linear fprop", quant.quant_weight, meta(F, H), transpose=True)
        xt = call("linear fprop", quant.quant_act_t, meta(T, H), None)
        call("gemm fprop", gemm.gemm, xq, xs, wq, ws, torch.bfloat16)
        dyq, dys = call("linear dgrad", quant.quant_act, meta(T, F))
        call("gemm dgrad", gemm.gemm, dyq, dys, wq_t, ws.mT, torch.bfloat16)
        dyt = call("linear wgrad", quant.quant_act_t, meta(T, F), None)
        call("gemm wgrad", gemm.gemm, *dyt, *xt, torch.float32)
        call("gemm fprop, pointer path", gemm.gemm, xq, xs, wq, ws, torch.bfloat16, config=pointers)
        # routed experts y_e = x_e·W_eᵀ (x [R,H] sorted by expert, W [E,F,H])
        xq, xs = call("experts fprop", quant.quant_act, meta(R, H))
        wq, ws, wq_t = call("experts fprop", quant.quant_weight, meta(E, F, H), transpose=True)
        xt = call("experts fprop", quant.quant_act_t, meta(R, H), tpe)
        call("grouped fprop", grouped_gemm.grouped_gemm, xq, xs, wq, ws, tpe, torch.bfloat16)
        dyq, dys = call("experts dgrad", quant.quant_act, meta(R, F))
        call("grouped dgrad", grouped_gemm.grouped_gemm, dyq, dys, wq_t, ws.mT, tpe, torch.bfloat16)
        dyt = call("experts wgrad", quant.quant_act_t, meta(R, F), tpe)
        call("grouped wgrad", grouped_gemm.grouped_wgrad, *dyt, *xt, tpe, torch.float32)
        call("grouped wgrad, BF16 out (DSV3_FP8_WGRAD_BF16)", grouped_gemm.grouped_wgrad, *dyt, *xt, tpe,
             torch.bfloat16)
        call("grouped fprop, pointer path", grouped_gemm.grouped_gemm, xq, xs, wq, ws, tpe, torch.bfloat16,
             config=pointers)
        call("grouped wgrad, pointer path", grouped_gemm.grouped_wgrad, *dyt, *xt, tpe, torch.float32,
             config=pointers)
        _variant_launches(call, {
            "gemm": ("gemm fprop", gemm.gemm, (xq, xs, wq[0], ws[0], torch.bfloat16)),
            "grouped_gemm": ("grouped fprop", grouped_gemm.grouped_gemm, (xq, xs, wq, ws, tpe, torch.bfloat16)),
            "grouped_wgrad": ("grouped wgrad", grouped_gemm.grouped_wgrad, (*dyt, *xt, tpe, torch.float32))})
        call("cast", quant.cast_to_e4m3, meta(T, H, dtype=torch.float32))
        _optimizer_launches(call, meta, F * H)
        call("linear fprop+wgrad, both copies in one launch", quant.quant_act_both, meta(T, H), None)
        call("experts dgrad+wgrad, both copies in one launch", quant.quant_act_both, meta(R, F), tpe)
    return out


def _variant_launches(call, variants: dict) -> None:
    """The GEMMs (``variants``: kernel -> (label, wrapper, args)) at the H100's tuning table's configs
    (``kernels/tuning/``, as ``gemm`` runs them), the grouped Fprop in the program order the tuner times (GROUP_M row
    tiles) and reading the 128-row tile table in parts (opt-in), and the opt-in warp-specialised variant
    (``DSV3_WARP_SPECIALIZE=1``)."""
    from . import gemm
    from .reference import SHARED_TILES_ENV
    for kernel, cfg in _tuned_h100().items():
        label, fn, args = variants[kernel]
        call(f"{label}, H100 tuned", fn, *args, config={**gemm.VARIANTS["tma"], **cfg})
    label, fn, args = variants["grouped_gemm"]
    tuned = {**gemm.VARIANTS["tma"], **_tuned_h100().get("grouped_gemm", {})}
    call(f"{label}, H100 tuned, GROUP_M 8", fn, *args, config={**tuned, "GROUP_M": 8})
    saved = os.environ.get(SHARED_TILES_ENV)
    os.environ[SHARED_TILES_ENV] = "1"
    try:
        call(f"{label}, H100 tuned, tile table in parts ({SHARED_TILES_ENV})", fn, *args, config=tuned)
    finally:
        if saved is None:
            del os.environ[SHARED_TILES_ENV]
        else:
            os.environ[SHARED_TILES_ENV] = saved
    for label, fn, args in variants.values():
        call(f"{label}, warp-specialised (opt-in)", fn, *args, config=gemm.VARIANTS["tma+ws"])


def _optimizer_launches(call, meta, n: int) -> None:
    """AdamW over a weight of ``n`` elements (BF16 gradient and weight, FP32 master and moments, clipped), over a
    ZeRO bucket (FP32 gradient, BF16 moments, no clip, no weight written) and over a split master (the BF16 weight
    and its int16 low halves, BF16 moments: ``optim.master=split``)."""
    import torch

    from . import adamw
    f32 = {"dtype": torch.float32}
    hyper = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "step": 3}
    call("adamw, bf16 weight", adamw.triton_adamw_, meta(n, **f32), meta(n), meta(n, **f32), meta(n, **f32),
         weight_decay=0.1, coef=meta(**f32), out=meta(n), **hyper)
    call("adamw, zero bucket", adamw.triton_adamw_, meta(n, **f32), meta(n, **f32), meta(n), meta(n),
         weight_decay=0.0, **hyper)
    call("adamw, split master", adamw.triton_adamw_, meta(n, dtype=torch.int16), meta(n), meta(n), meta(n),
         weight_decay=0.1, coef=meta(**f32), out=meta(n), **hyper)


def _tuned_h100() -> dict:
    """The H100 tuning table's configs (``kernels/tuning/``): launches the GPU makes there, compiled here too."""
    import json

    from . import tuning
    path = tuning.TABLE_DIR / f"{tuning.slug('NVIDIA H100 80GB HBM3')}.json"
    return json.loads(path.read_text())["configs"] if path.is_file() else {}


# --------------------------------------------------------------------------------------------- compiling
def _backend():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    return make_backend(GPUTarget(*TARGET))


def _specialise(launch: Launch, backend):
    """(signature, constexprs, attrs, options) exactly as ``JITFunction.run`` derives them at launch."""
    from triton.runtime.jit import create_function_from_signature

    k = launch.kernel
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", k.debug) or False
    binder = create_function_from_signature(k.signature, k.params, backend)
    bound, specialisation, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = k._pack_args(backend, kwargs, bound, specialisation, options)
    return signature, constexprs, attrs, options


def _key(launch: Launch, backend) -> str:
    signature, constexprs, attrs, options = _specialise(launch, backend)
    return repr((launch.kernel.fn.__qualname__, sorted(signature.items()), sorted(constexprs.items(), key=str),
                 sorted(attrs.items(), key=str), sorted(options.__dict__.items(), key=str)))


def _cubin_facts(cubin: bytes) -> dict:
    """From the cuobjdump bundled with Triton: REG / STACK / SHARED / LOCAL of the cubin, and SASS counts of
    GMMA (wgmma; QGMMA for FP8), UTMALDG (TMA loads), LDGSTS (cp.async) and USETMAXREG (setmaxnreg that
    ptxas kept: it drops them, with a warning, where they cannot take effect)."""
    import triton

    try:
        tool = triton.knobs.nvidia.cuobjdump.path
    except Exception:  # noqa: BLE001 - layouts without the knob: the binary next to the backend
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage, sass = (subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
                       for flag in ("--dump-resource-usage", "--dump-sass"))
    facts = {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    for key, op in (("sass_gmma", r"[HQ]GMMA"), ("sass_tma", r"UTMALDG"), ("sass_ldgsts", r"LDGSTS"),
                    ("sass_setmaxreg", r"USETMAXREG")):
        facts[key] = len(re.findall(rf"\b{op}\b", sass))
    return facts


@contextlib.contextmanager
def _stderr_into(f):
    """Send file descriptor 2 (where MLIR diagnostics go) into ``f`` for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def compile_report(launch: Launch, dump: str | None = None) -> dict:
    """Compile ``launch`` for sm_90a and describe the result (module docstring); ``dump``: a folder to
    write its TTIR/TTGIR/PTX into."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    backend = _backend()
    rep = {"name": launch.name, "kernel": launch.kernel.fn.__name__, "triton": triton.__version__,
           "TMA": bool(launch.kwargs.get("TMA")), "WARP_SPECIALIZE": bool(launch.kwargs.get("WARP_SPECIALIZE"))}
    with tempfile.TemporaryFile(mode="w+") as log:
        try:
            signature, constexprs, attrs, options = _specialise(launch, backend)
            rep.update(num_warps=options.num_warps, num_stages=options.num_stages)
            with _stderr_into(log):
                ck = triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=GPUTarget(*TARGET),
                                    options=options.__dict__)
        except Exception as e:  # noqa: BLE001 - a compiler failure is a gate result, not a crash
            log.seek(0)
            why = [ln.strip() for ln in log.read().splitlines() if re.search(r"error:|Assertion|failed", ln)]
            rep["error"] = (f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
                            + (f" ({why[0][:300]})" if why else ""))
            return rep
    ptx, ttgir = ck.asm["ptx"], ck.asm["ttgir"]
    if dump:
        folder = os.path.join(dump, re.sub(r"[^\w.-]+", "_", launch.name))
        os.makedirs(folder, exist_ok=True)
        for ext in ("ttir", "ttgir", "ptx"):
            with open(os.path.join(folder, f"{launch.kernel.fn.__name__}.{ext}"), "w") as f:
                f.write(ck.asm[ext])
    usage = _cubin_facts(ck.asm["cubin"])
    maxnreg = [int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)]
    rings = [int(d) for d in re.findall(r"!ttg\.memdesc<(\d+)x\d+x\d+xf8E4M3FN", ttgir)]
    waits = [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)]
    rep.update(
        warps_total=ck.metadata.num_warps, scratch=ck.metadata.global_scratch_size,
        regs=usage.get("reg", -1), local=usage.get("local", 0) + usage.get("stack", 0),
        smem=ck.metadata.shared + usage.get("shared", 0),
        gemm=bool(re.search(r"\btt\.dot(_scaled)?\b", ck.asm["ttir"])),
        wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
        cp_async=len(re.findall(r"cp\.async\.c[ag]\.", ptx)),
        tma=ptx.count("cp.async.bulk.tensor"),
        setmaxnreg=len(maxnreg), maxnreg=sorted(set(maxnreg)),
        smem_stages=max(rings, default=0),
        wgmma_in_flight=max(waits, default=0),
        **{k: v for k, v in usage.items() if k.startswith("sass_")})
    if launch.kernel.fn.__name__ in QUANT_KERNELS:
        rep["rounding"] = rounding_facts(ptx)
    if launch.kernel.fn.__name__ in IEEE_KERNELS:
        rep["ieee"] = ieee_facts(ptx)
    return rep


def ieee_facts(ptx: str) -> dict:
    """Divisions and square roots of an optimizer kernel: IEEE-rounded (``div.rn``, ``sqrt.rn``) or approximate."""
    count = lambda pattern: len(re.findall(pattern, ptx))   # noqa: E731
    return {"div_rn": count(r"\bdiv\.rn\.f32\b"), "sqrt_rn": count(r"\bsqrt\.rn\.f32\b"),
            "approx": count(r"\b(div\.(full|approx)|rcp\.approx|sqrt\.approx|rsqrt\.approx)\S*\.f32\b")}


def rounding_facts(ptx: str) -> dict:
    """The instructions a quantiser's bit-exactness rests on (``failures`` says which must be there)."""
    count = lambda pattern: len(re.findall(pattern, ptx))   # noqa: E731
    return {"div_rn": count(r"\bdiv\.rn\.f32\b"), "div_approx": count(r"\b(div\.(full|approx)|rcp\.approx)\S*\.f32\b"),
            "ftz": count(r"\.ftz\.f32\b"), "neg": count(r"\bneg\.f32\b"),
            "cvt_e4m3": count(r"\bcvt\.rn\.satfinite\.e4m3x2\.f32\b")}


def failures(rep: dict) -> list[str]:
    """What the gate rejects in one report (empty list: it passes)."""
    if "error" in rep:
        return [f"does not compile for sm_90a: {rep['error']}"]
    bad = rounding_failures(rep["kernel"], rep["rounding"]) if "rounding" in rep else []
    if "ieee" in rep and (rep["ieee"]["approx"] or not (rep["ieee"]["div_rn"] and rep["ieee"]["sqrt_rn"])):
        bad.append(f"optimizer maths not IEEE-rounded: {rep['ieee']}")
    if rep["local"]:
        bad.append(f"{rep['local']} B of local memory (register spills / stack)")
    if rep["smem"] > H100_SMEM_PER_BLOCK:
        bad.append(f"shared memory {rep['smem']} B > {H100_SMEM_PER_BLOCK} B")
    if rep["gemm"]:
        if not (rep["wgmma"] and rep["sass_gmma"]):
            bad.append(f"no wgmma (PTX {rep['wgmma']}, SASS GMMA {rep['sass_gmma']})")
        if not (rep["cp_async"] or rep["tma"]) or rep["smem_stages"] < 2:
            bad.append(f"loads not pipelined (cp.async {rep['cp_async']}, TMA {rep['tma']}, "
                       f"operand ring {rep['smem_stages']} stage(s))")
        if rep["TMA"] and not rep["tma"]:
            bad.append("config asks for TMA, the PTX has no cp.async.bulk.tensor")
        if rep["WARP_SPECIALIZE"] and not (rep["setmaxnreg"] and rep["sass_setmaxreg"]):
            bad.append(f"config asks for warp specialisation: setmaxnreg PTX {rep['setmaxnreg']}, "
                       f"SASS {rep['sass_setmaxreg']}")
    return bad


def rounding_failures(kernel: str, r: dict) -> list[str]:
    """A quantiser is bit-exact vs the reference only with: IEEE divisions (``div.rn``; Triton's ``/`` is the
    approximate ``div.full``), no flush-to-zero (the tiles' inputs may be FP32 subnormals), the hardware's
    saturating RNE E4M3 convert (the interpreter's FP32 emulation of it compiles to garbage for values rounding
    to zero), and no float negation (it loses the sign of -0 on Hopper)."""
    bad = []
    if r["div_approx"]:
        bad.append(f"{r['div_approx']} approximate division(s) (div.full/div.approx/rcp.approx)")
    if kernel != "_cast_kernel" and not r["div_rn"]:
        bad.append("no IEEE division (div.rn.f32)")
    if r["ftz"]:
        bad.append(f"{r['ftz']} flush-to-zero FP32 instruction(s)")
    if not r["cvt_e4m3"]:
        bad.append("no cvt.rn.satfinite.e4m3x2.f32")
    if r["neg"]:
        bad.append(f"{r['neg']} float negation(s) (neg.f32)")
    return bad


def gate_ok(reports: list[dict]) -> bool:
    """Every case passes and the control is rejected."""
    return all(bool(failures(r)) == (r["name"] == CONTROL) for r in reports)


# ------------------------------------------------------------------------------------------ processes
def _cases() -> list[Launch]:
    """Unique launches (the first use names each, later uses are appended) plus the control."""
    backend = _backend()
    seen, cases = {}, []
    for launch in launches():
        key = _key(launch, backend)
        if key in seen:
            seen[key].name += f", {launch.name}"
        else:
            seen[key] = launch
            cases.append(launch)
    fprop = next(c for c in cases if c.name.startswith("gemm fprop"))
    cases.append(Launch(CONTROL, fprop.kernel, fprop.args, {**fprop.kwargs, "num_stages": 1}))
    return cases


def _worker(index: int, count: int, out: str, dump: str | None) -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") == "0", "the gate compiles; the interpreter must be off"
    reports = [compile_report(c, dump) for c in _cases()[index::count]]
    with open(out, "w") as f:
        json.dump(reports, f)


def run_gate(jobs: int | None = None, python: str | None = None, dump: str | None = None) -> list[dict]:
    """Compile every case in ``jobs`` worker subprocesses (``TRITON_INTERPRET=0``, a fresh Triton cache) and
    return the reports in case order. Raises RuntimeError with the worker's stderr if one dies."""
    jobs = jobs or min(2, os.cpu_count() or 1)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tmp = tempfile.mkdtemp(prefix="hopper_gate_")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": os.path.join(tmp, "cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    outs = [os.path.join(tmp, f"worker{i}.json") for i in range(jobs)]
    try:
        procs = [subprocess.Popen([python or sys.executable, "-m", "kernels.hopper_gate", "--worker", str(i),
                                   str(jobs), outs[i]] + (["--dump", dump] if dump else []),
                                  cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for i in range(jobs)]
        errs = [p.communicate()[1] for p in procs]
        parts = []
        for p, err, out in zip(procs, errs, outs):
            if p.returncode:
                raise RuntimeError(f"hopper gate worker failed (rc {p.returncode}):\n{err[-4000:]}")
            with open(out) as f:
                parts.append(json.load(f))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    reports = [None] * sum(map(len, parts))
    for i, part in enumerate(parts):
        reports[i::jobs] = part
    return reports


def table(reports: list[dict]) -> str:
    """The reports as a markdown table; instruction counts as PTX/SASS."""
    head = ("| launch | kernel | warps (total) | stages | regs | spill B | smem KB | wgmma | cp.async | TMA "
            "| setmaxnreg (values) | operand ring | wgmma in flight | gate |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in reports:
        verdict = "; ".join(failures(r)) or "ok"
        if r["name"] == CONTROL:
            verdict = "rejected, as it must be: " + verdict if failures(r) else "CONTROL NOT REJECTED"
        if "error" in r:
            rows.append(f"| {r['name']} | `{r['kernel']}` | {r.get('num_warps', '')} | {r.get('num_stages', '')} "
                        + "| " * 10 + f"| {verdict} |")
            continue
        warps = f"{r['num_warps']} ({r['warps_total']})" if r["warps_total"] != r["num_warps"] else r["num_warps"]
        nreg = f"{r['setmaxnreg']}/{r['sass_setmaxreg']}"
        nreg += f" ({'/'.join(map(str, r['maxnreg']))})" if r["maxnreg"] else ""
        counts = f"{r['wgmma']}/{r['sass_gmma']} | {r['cp_async']}/{r['sass_ldgsts']} | {r['tma']}/{r['sass_tma']}"
        rows.append(f"| {r['name']} | `{r['kernel']}` | {warps} | {r['num_stages']} | {r['regs']} | {r['local']} "
                    f"| {r['smem'] / 1024:.0f} | {counts} | {nreg} | {r['smem_stages']} | {r['wgmma_in_flight']} "
                    f"| {verdict} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernels.hopper_gate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=None, help="compile processes (default: min(2, cores))")
    ap.add_argument("--json", action="store_true", help="print the reports as JSON instead of the table")
    ap.add_argument("--dump", help="write each case's TTIR/TTGIR/PTX under this folder")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        _worker(int(a.worker[0]), int(a.worker[1]), a.worker[2], a.dump)
        return 0
    reports = run_gate(a.jobs, dump=os.path.abspath(a.dump) if a.dump else None)
    if a.json:
        print(json.dumps(reports, indent=1))
    else:
        version = next((r["triton"] for r in reports), "?")
        print(f"Hopper compile gate: sm_90a, triton {version}. Columns: module docstring of "
              f"kernels/hopper_gate.py.\n")
        print(table(reports))
    ok = gate_ok(reports)
    print("\ngate: " + ("PASS" if ok else "FAIL"), file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
