"""The Hopper compile gate (``kernels/hopper_gate.py``): every Triton kernel compiled for sm_90a at the
specialisations of its real launches, on this CPU machine, and what the compiled code must show.

One gate run (two compile subprocesses, a fresh Triton cache; ~15-30 s on 2 cores) in one test. Skips
only when Triton's NVIDIA backend cannot compile at all (no backend, no bundled ptxas/cuobjdump).
"""
import os

import pytest

triton = pytest.importorskip("triton")

from kernels import hopper_gate  # noqa: E402


def _nvidia_backend_missing() -> str | None:
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
        tools = triton.knobs.nvidia
        missing = [t for t in ("ptxas", "cuobjdump") if not os.access(getattr(tools, t).path, os.X_OK)]
    except Exception as e:  # noqa: BLE001 - any failure here means: no NVIDIA compile on this machine
        return f"triton's NVIDIA backend is unavailable: {type(e).__name__}: {e}"
    return f"triton ships no {', '.join(missing)}" if missing else None


def broken(reports, check):
    return {r["name"]: bad for r in reports if r["name"] != hopper_gate.CONTROL
            and (bad := [f for f in hopper_gate.failures(r) if check(f)])}


def test_hopper_compile_gate():
    """One gate run, every check (one test function, so ``pytest -n`` workers don't compile twice)."""
    why = _nvidia_backend_missing()
    if why:
        pytest.skip(why)
    reports = hopper_gate.run_gate()
    print("\n" + hopper_gate.table(reports))                  # shown with -s, and on failure
    real = [r for r in reports if r["name"] != hopper_gate.CONTROL]

    # every kernel, at every production use, compiles for sm_90a
    from kernels import _adamw_kernels, gemm, grouped_gemm, quant
    defined = {name for mod in (quant, gemm, grouped_gemm, _adamw_kernels) for name, obj in vars(mod).items()
               if name.endswith("_kernel") and hasattr(obj, "fn")}          # @triton.jit (or interpreted)
    assert len(defined) == 10 and defined <= {r["kernel"] for r in reports}, defined
    assert not broken(reports, lambda f: "does not compile" in f)
    launched = " ".join(r["name"] for r in reports)
    for use in ("gemm fprop", "gemm dgrad", "gemm wgrad", "grouped fprop", "grouped dgrad", "grouped wgrad"):
        assert use in launched

    # no local memory, shared memory within the H100 per-block limit
    assert not broken(reports, lambda f: "local memory" in f or "shared memory" in f)
    assert all(r["smem"] <= hopper_gate.H100_SMEM_PER_BLOCK for r in real)

    # every GEMM kernel (both load paths): wgmma, and loads pipelined (async copies into a >= 2-stage ring)
    gemms = [r for r in real if r["gemm"]]
    assert {r["kernel"] for r in gemms} == {"_gemm_kernel", "_grouped_gemm_kernel", "_grouped_wgrad_kernel"}
    assert not broken(reports, lambda f: "wgmma" in f or "pipelined" in f)
    for r in gemms:
        assert r["wgmma"] and r["sass_gmma"] and (r["cp_async"] or r["tma"]) and r["smem_stages"] >= 2, r
        assert (r["sass_tma"] if r["tma"] else r["sass_ldgsts"]) > 0, r          # and ptxas kept them

    # production launches (GPU_CONFIG) got what they ask for: TMA copies, two warp groups, no warp specialisation
    # (Triton 3.6 miscompiles it on an H100); the opt-in warp-specialised variant still compiles to a producer
    # warp group and two consumer groups with the register hand-over
    production = [r for r in gemms if "pointer" not in r["name"] and "opt-in" not in r["name"]
                  and "tuned" not in r["name"]]
    assert len(production) == 7 and all(r["TMA"] and not r["WARP_SPECIALIZE"] for r in production)
    assert any(r["name"].startswith("grouped wgrad, BF16 out") for r in production)   # the Wgrad's opt-in output
    assert not broken(reports, lambda f: "config asks" in f)
    for r in production:
        assert r["tma"] and not r["setmaxnreg"] and r["warps_total"] == r["num_warps"] == 8, r
    # the H100 tuning table's configs (kernels/tuning/), what gemm runs there, and the grouped program order that
    # bench.fp8_tune times (GROUP_M): TMA, no warp specialisation
    tuned = [r for r in gemms if "H100 tuned" in r["name"]]
    assert len(tuned) == 5 and all(r["TMA"] and not r["WARP_SPECIALIZE"] for r in tuned)
    assert any(r["name"].endswith("GROUP_M 8") and r["kernel"] == "_grouped_gemm_kernel" for r in tuned)
    assert any("tile table in parts" in r["name"] for r in tuned)
    for r in tuned:
        assert r["tma"] and not r["setmaxnreg"] and r["warps_total"] == r["num_warps"], r
    opt_in = [r for r in gemms if "opt-in" in r["name"]]
    assert len(opt_in) == 3 and all(r["WARP_SPECIALIZE"] for r in opt_in)
    for r in opt_in:
        assert r["tma"] and r["setmaxnreg"] and r["sass_setmaxreg"] and r["warps_total"] == 3 * r["num_warps"], r

    # quantisers: the instructions bit-exactness rests on (IEEE division, no flush-to-zero, the hardware's
    # saturating RNE convert, no float negation)
    quants = [r for r in real if r["kernel"] in hopper_gate.QUANT_KERNELS]
    assert {r["kernel"] for r in quants} == set(hopper_gate.QUANT_KERNELS)
    for r in quants:
        facts = r["rounding"]
        assert facts["cvt_e4m3"] and not facts["div_approx"], r
        assert not facts["neg"] and not facts["ftz"] and (facts["div_rn"] or r["kernel"] == "_cast_kernel"), r
    # the AdamW: its three uses compile, with IEEE-rounded division and square root (torch's maths to FP32 rounding)
    opt = [r for r in real if r["kernel"] == "_adamw_kernel"]
    assert {"adamw, bf16 weight", "adamw, zero bucket", "adamw, split master"} == {r["name"] for r in opt}
    assert len(opt) == 3
    for r in opt:
        assert r["ieee"]["div_rn"] and r["ieee"]["sqrt_rn"] and not r["ieee"]["approx"], r
    assert not broken(reports, lambda f: f)

    # the control (dense GEMM at num_stages=1) must fail the pipelining check, or that check is not biting
    control = next(r for r in reports if r["name"] == hopper_gate.CONTROL)
    assert any("not pipelined" in f for f in hopper_gate.failures(control)), control
    assert hopper_gate.gate_ok(reports)


def test_each_rule_rejects_what_it_should():
    """``failures`` on hand-made reports: every rule fires on its defect and only there (no compile)."""
    good = {"name": "x", "kernel": "k", "gemm": True, "local": 0, "smem": 100 << 10, "wgmma": 8, "sass_gmma": 8,
            "cp_async": 0, "tma": 3, "smem_stages": 4, "setmaxnreg": 8, "sass_setmaxreg": 8, "TMA": True,
            "WARP_SPECIALIZE": True}
    assert hopper_gate.failures(good) == []
    defects = {"local memory": {"local": 64}, "shared memory": {"smem": 228 << 10}, "no wgmma": {"wgmma": 0},
               "no wgmma (PTX 8": {"sass_gmma": 0}, "not pipelined": {"smem_stages": 1},
               "no cp.async.bulk.tensor": {"tma": 0, "cp_async": 32}, "warp specialisation": {"setmaxnreg": 0},
               "SASS 0": {"sass_setmaxreg": 0}}
    for words, change in defects.items():
        found = hopper_gate.failures({**good, **change})
        assert len(found) == 1 and words in found[0], (words, found)
    assert "not pipelined" in hopper_gate.failures({**good, "tma": 0, "TMA": False})[0]
    assert hopper_gate.failures({**good, "gemm": False, "wgmma": 0, "sass_gmma": 0, "tma": 0, "smem_stages": 0}) == []
    assert "does not compile" in hopper_gate.failures({"name": "x", "error": "boom"})[0]
    plain = {**good, "gemm": False, "wgmma": 0, "sass_gmma": 0, "tma": 0, "smem_stages": 0}
    ieee = {"div_rn": 2, "sqrt_rn": 1, "approx": 0}
    assert hopper_gate.failures({**plain, "ieee": ieee}) == []
    for change in ({"approx": 1}, {"div_rn": 0}, {"sqrt_rn": 0}):
        found = hopper_gate.failures({**plain, "ieee": {**ieee, **change}})
        assert len(found) == 1 and "not IEEE-rounded" in found[0], (change, found)


def test_rounding_rules_reject_what_they_should():
    """``rounding_failures``: each quantiser rule fires on its defect and only there."""
    good = {"div_rn": 32, "div_approx": 0, "ftz": 0, "neg": 0, "cvt_e4m3": 8}
    assert hopper_gate.rounding_failures("_quant_act_kernel", good) == []
    assert hopper_gate.rounding_failures("_cast_kernel", {**good, "div_rn": 0}) == []     # the cast divides nothing
    defects = {"approximate division": {"div_approx": 2}, "no IEEE division": {"div_rn": 0},
               "flush-to-zero": {"ftz": 4}, "no cvt.rn.satfinite": {"cvt_e4m3": 0},
               "float negation": {"neg": 8}}
    for words, change in defects.items():
        found = hopper_gate.rounding_failures("_quant_act_kernel", {**good, **change})
        assert len(found) == 1 and words in found[0], (words, found)
    report = {"name": "q", "kernel": "_quant_act_kernel", "gemm": False, "local": 0, "smem": 0, "rounding": good}
    assert hopper_gate.failures(report) == []
    assert "approximate division" in hopper_gate.failures({**report, "rounding": {**good, "div_approx": 1}})[0]
