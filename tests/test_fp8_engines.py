"""Choosing FP8 engines (``kernels/selfcheck.py``, ``auto.py``, ``torch_gemm.py``): a variant or engine runs only
after its self-check passed on the device, a wrong one is skipped with one warning line, ``auto`` keeps the fastest
verified engine per shape. On CPU the interpreter and the reference stand in; a stand-in holds torch's blockwise
GEMM to cuBLASLt's documented scale layouts."""
import logging
import math

import pytest
import torch

pytest.importorskip("triton")

import kernels  # noqa: E402

kernels.configure()
from kernels import auto, gemm, grouped_gemm, quant, selfcheck, torch_gemm, tuning  # noqa: E402
from kernels import reference as ref  # noqa: E402
from kernels.auto import AutoOps, Engine  # noqa: E402

from .fp8_utils import DEV, assert_gemm_close  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_verdicts(monkeypatch, tmp_path):
    """No cached verdict, and no tuned launch config (a GPU's table would be checked first: test_fp8_tuning)."""
    (tmp_path / "untuned.json").write_text('{"configs": {}}')
    monkeypatch.setenv(tuning.ENV, str(tmp_path / "untuned.json"))
    selfcheck.forget()
    yield
    selfcheck.forget()


def operands(M=200, N=136, K=384, seed=0):
    g = torch.Generator().manual_seed(seed)
    a, sa = ref.quant_act(torch.randn(M, K, generator=g).to(DEV))
    b, sb = ref.quant_weight(torch.randn(N, K, generator=g).to(DEV))
    return a, sa, b, sb


# -------------------------------------------------------------------------------------------- self-checks
def test_first_verified_skips_a_wrong_variant_with_one_warning(caplog):
    variants = [("fast", {"k": 1}), ("safe", {"k": 2})]
    errs = {1: 0.7, 2: 1e-6}
    calls = []

    def run(v):
        calls.append(v["k"])
        return errs[v["k"]]
    with caplog.at_level(logging.WARNING, logger="kernels"):
        assert selfcheck.first_verified("gemm", variants, DEV, run) == ("safe", {"k": 2})
        assert selfcheck.first_verified("gemm", variants, DEV, run) == ("safe", {"k": 2})     # cached
    assert calls == [1, 2]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert f"gemm launch config fast {{k=1}} is wrong on {selfcheck.device_id(DEV)}" in lines[0]
    assert "7.0e-01" in lines[0]
    assert "using safe instead" in lines[0]


def test_no_variant_passes_names_every_reason():
    def run(v):
        if v == "boom":
            raise RuntimeError("PTX miscompiled\nsecond line")
        return float("nan")
    with pytest.raises(selfcheck.NoVerifiedKernel) as e:
        selfcheck.first_verified("grouped_gemm", [("a", "nan"), ("b", "boom")], DEV, run)
    assert "a: relative error nan" in str(e.value) and "b: RuntimeError: PTX miscompiled" in str(e.value)
    assert "second line" not in str(e.value)


def test_the_worst_of_several_errors_is_nan_wherever_a_nan_is():
    """A self-check of several cases (FP32 and BF16 outputs, Fprop and Wgrad) fails if any case is NaN: Python's
    ``max`` keeps the first of ``(0.1, nan)``."""
    assert max(1e-4, float("nan")) == 1e-4
    assert math.isnan(selfcheck.worst([1e-4, float("nan")])) and math.isnan(selfcheck.worst([float("nan"), 1e-4]))
    assert selfcheck.worst([1e-4, 3e-4, 2e-4]) == 3e-4


def test_quantiser_check_must_be_bit_exact():
    verdict, fresh = selfcheck.check("quant_act", "triton", DEV, lambda: 1e-9, tol=0.0)
    assert fresh and not verdict.ok and "must be bit-exact" in verdict.why
    x = torch.randn(64, 64, device=DEV)
    assert selfcheck.mismatch(x, x.clone()) == 0.0
    y = x.clone()
    y[0, 0] = -y[0, 0]
    assert selfcheck.mismatch(x, y) == 1 / x.numel()
    assert selfcheck.mismatch(torch.zeros(2), -torch.zeros(2)) == 1.0          # -0 is a different byte


def test_quantiser_self_check_names_the_case_that_differs():
    def off_by_one_ulp_scale(x, tokens_per_expert=None, pow2=False):
        q, s = ref.quant_act_t(x, tokens_per_expert, pow2)
        if tokens_per_expert is not None and pow2:
            s = (s.view(torch.int32) + 1).view(torch.float32)
        return q, s
    assert quant.self_check("quant_act_t", DEV, ref.quant_act_t) == 0.0
    with pytest.raises(quant.QuantMismatch, match=r"100.00% .* quant_act_t experts, pow2=True: s \(320, 7\)"):
        quant.self_check("quant_act_t", DEV, off_by_one_ulp_scale)


@pytest.mark.parametrize("op", ["quant_act", "quant_act_t", "quant_weight"])
def test_triton_quantisers_pass_their_self_checks(op):
    assert quant.self_check(op, DEV) == 0.0
    if op == "quant_act_t":
        assert quant.self_check(op, DEV, quant.quant_act_t_transposed) == 0.0


def test_default_launch_variants_are_self_checked_and_never_warp_specialised(monkeypatch, tmp_path):
    monkeypatch.delenv(gemm.WS_ENV, raising=False)
    assert [n for n, _ in gemm.variant_chain(True)] == ["tma", "pointers"]
    assert [n for n, _ in gemm.variant_chain(False)] == ["pointers"]
    assert not any(v["WARP_SPECIALIZE"] for _, v in gemm.variant_chain(True))
    monkeypatch.setenv(gemm.WS_ENV, "1")
    assert [n for n, _ in gemm.variant_chain(True)] == ["tma+ws", "tma", "pointers"]
    monkeypatch.delenv(gemm.WS_ENV)
    a, sa, b, sb = operands(K=464)                       # TMA-readable: the default is the checked "tma"
    assert_gemm_close(gemm.gemm(a, sa, b, sb, torch.float32), ref.gemm(a, sa, b, sb, torch.float32))
    checked = {(k, v) for (k, v, _), verdict in selfcheck.verdicts().items() if verdict.ok}
    assert checked == {("gemm", "tma")}
    tpe = torch.tensor(grouped_gemm.CHECK_COUNTS, device=DEV)
    x, w = torch.randn(sum(grouped_gemm.CHECK_COUNTS), 464, device=DEV), torch.randn(len(tpe), 144, 464, device=DEV)
    grouped_gemm.grouped_gemm(*ref.quant_act(x), *ref.quant_weight(w), tpe)
    grouped_gemm.grouped_wgrad(*ref.quant_act_t(torch.randn(len(x), 144, device=DEV), tpe), *ref.quant_act_t(x, tpe), tpe)
    assert {k for (k, v, _), verdict in selfcheck.verdicts().items() if verdict.ok} == {
        "gemm", "grouped_gemm", "grouped_wgrad"}


def test_a_variant_that_fails_its_check_is_not_run(monkeypatch, caplog):
    """A wrong ``tma`` variant (its check fails) leaves the default on the pointer path, with one warning."""
    launched = []
    real_pick = gemm.pick_config
    monkeypatch.setattr(gemm, "pick_config", lambda *a, **k: launched.append(real_pick(*a, **k)) or launched[-1])
    monkeypatch.setattr(gemm, "self_check", lambda variant, device: 0.5 if variant["TMA"] else 0.0)
    a, sa, b, sb = operands(K=464)
    with caplog.at_level(logging.WARNING, logger="kernels"):
        out = gemm.gemm(a, sa, b, sb, torch.float32)
    assert_gemm_close(out, ref.gemm(a, sa, b, sb, torch.float32))
    assert [c["TMA"] for c in launched] == [False]
    assert len(caplog.records) == 1 and "launch config tma" in caplog.records[0].getMessage()


def test_triton_quantisers_give_way_when_not_bit_exact(monkeypatch, caplog):
    """A quantiser that fails its check on the device is replaced there: ``quant_act_t`` by its transposed
    composition, the others by the reference; one warning line each."""
    ops = kernels.get_ops("triton")
    x = torch.randn(300, 256, device=DEV)
    real = quant.self_check

    def direct_kernels_wrong(op, device, fn=None):
        if fn is None or fn is getattr(kernels.quant, op):
            raise quant.QuantMismatch(0.25, f"{op} (pretend)")
        return real(op, device, fn)
    monkeypatch.setattr(quant, "self_check", direct_kernels_wrong)
    with caplog.at_level(logging.WARNING, logger="kernels"):
        q, s = ops.quant_act(x)
        ops.quant_weight(x)
        qt, st = ops.quant_act_t(x)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3 and all("not bit-exact" in m and "(pretend)" in m for m in messages)
    q_ref, s_ref = ref.quant_act(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    qt_ref, st_ref = ref.quant_act_t(x)
    assert torch.equal(qt.view(torch.uint8), qt_ref.view(torch.uint8)) and torch.equal(st, st_ref)
    assert qt.stride(0) == 304 != qt_ref.stride(0)      # the transposed engine's TMA-readable rows, not the reference


def _broken_fused(real):
    """``quant_act_both`` with one scale of its 128×1 copy off by a factor of two (a miscompile stand-in)."""
    def fused(x, tokens_per_expert=None, pow2=False):
        q, s, qt, st = real(x, tokens_per_expert, pow2)
        st = st.clone()
        st.view(-1)[0] *= 2
        return q, s, qt, st
    return fused


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_a_wrong_fused_quantiser_gives_way_to_the_separate_ones(backend, monkeypatch, caplog):
    """The fused quantiser runs only after its bit-exact self-check: a wrong one warns once and the two separate
    quantisers make the copies; a right one is used as is."""
    x, tpe = torch.randn(300, 256, device=DEV), torch.tensor([100, 0, 200], device=DEV)
    want = ref.quant_act_both(x, tpe)

    def ops_now():
        return AutoOps(DEV, auto.cuda_engines()) if backend == "auto" else kernels.get_ops("triton")
    def same(got, want):
        return all(torch.equal(g.view(torch.int8), w.view(torch.int8)) for g, w in zip(got, want, strict=True))
    fused_calls = []
    real = quant.quant_act_both
    monkeypatch.setattr(quant, "quant_act_both", lambda *a, **k: fused_calls.append(1) or real(*a, **k))
    ops = ops_now()
    ops.quant_act_both(x, tpe)                                   # the self-check runs here
    fused_calls.clear()
    assert same(ops.quant_act_both(x, tpe), want) and fused_calls == [1]
    selfcheck.forget()
    monkeypatch.setattr(quant, "quant_act_both", _broken_fused(real))
    ops = ops_now()
    with caplog.at_level(logging.WARNING, logger="kernels"):
        got = ops.quant_act_both(x, tpe)
        again = ops.quant_act_both(x)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages
    assert "quant_act_both" in messages[0] and "dense, pow2=False: sT (320, 2)" in messages[0], messages
    assert same(got, want) and same(again, ref.quant_act_both(x))
    assert again[2].stride(0) == 304                    # the Triton 128×1 kernel's layout, not the reference's
    if backend == "auto":
        assert "quant_act_both separate" in ops.summary()


# ------------------------------------------------------------------------------------------------- auto
def _wrong_gemm(a, sa, b, sb, out_dtype=torch.bfloat16):
    return ref.gemm(a, sa, b, sb, out_dtype) * 1.5


def _verify(fn):
    def verify(device):
        a, sa, b, sb = operands(seed=9)
        err = selfcheck.rel_err(fn(a, sa, b, sb, torch.float32), ref.gemm(a, sa, b, sb, torch.float32))
        return None if err <= selfcheck.GEMM_TOL else f"relative error {err:.1e}"
    return verify


def make_auto(times: dict, accepts_fast=lambda *a: True):
    fast = lambda *a: gemm.gemm(*a)     # noqa: E731 - the interpreted Triton kernel
    engines = {"gemm": [Engine("wrong", _wrong_gemm, _verify(_wrong_gemm)),
                        Engine("slow", ref.gemm, _verify(ref.gemm)),
                        Engine("fast", fast, _verify(fast), accepts_fast),
                        Engine("reference", ref.gemm, lambda d: None, fallback=True)]}
    timed = []

    def timer(fn):
        name = next(n for n, e in (("slow", ref.gemm), ("fast", fast)) if fn.__defaults__[0].fn is e)
        timed.append(name)
        return times[name]
    return AutoOps(DEV, engines, timer=timer), timed


def test_auto_keeps_the_fastest_verified_engine_per_shape(caplog):
    ops, timed = make_auto({"slow": 2.0, "fast": 1.0})
    a, sa, b, sb = operands()
    with caplog.at_level(logging.INFO, logger="kernels"):
        out = ops.gemm(a, sa, b, sb)
        ops.gemm(a, sa, b, sb)                                   # same shape class: no second timing
    assert sorted(timed) == ["fast", "slow"]
    assert ops.choices == {AutoOps.gemm_key(a, b, sb): "fast"}
    torch.testing.assert_close(out.float(), ref.gemm(a, sa, b, sb).float(), rtol=1e-2, atol=1e-2)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert f"gemm engine wrong not used on {selfcheck.device_id(DEV)}" in text and "-> fast (slow 2.000 ms, fast 1.000 ms)" in text
    a2, sa2, _, _ = operands(M=64)                               # another shape class: timed again
    ops.gemm(a2, sa2, b, sb)
    assert len(timed) == 4


def test_auto_skips_an_engine_that_does_not_take_the_operands():
    ops, timed = make_auto({"slow": 2.0, "fast": 1.0}, accepts_fast=lambda a, *rest: a.shape[1] % 128 == 0)
    a, sa, b, sb = operands(K=320)
    ops.gemm(a, sa, b, sb)
    assert timed == [] and ops.choices[AutoOps.gemm_key(a, b, sb)] == "slow"


def test_auto_falls_back_to_the_reference_only_when_nothing_passes():
    engines = {"gemm": [Engine("wrong", _wrong_gemm, _verify(_wrong_gemm)),
                        Engine("reference", ref.gemm, lambda d: None, fallback=True)]}
    ops = AutoOps(DEV, engines, timer=lambda fn: 1.0)
    a, sa, b, sb = operands()
    assert torch.equal(ops.gemm(a, sa, b, sb), ref.gemm(a, sa, b, sb))
    assert [e.name for e in ops.passed("gemm")] == ["reference"]
    ops = AutoOps(DEV, {"gemm": engines["gemm"][:1]})
    with pytest.raises(selfcheck.NoVerifiedKernel, match="no engine for gemm"):
        ops.gemm(a, sa, b, sb)


def test_cuda_engines_under_the_interpreter():
    """The GPU engine table (on the CPU: the interpreter; torch's blockwise GEMM unavailable): the Triton
    engines pass their checks, and every op works."""
    ops = AutoOps(DEV, auto.cuda_engines())
    parts = dict(p.split(" ", 1) for p in ops.summary().split(": ", 1)[1].split(", "))
    assert "triton" in parts["gemm"].split("/") and parts["quant_act"] == parts["grouped_wgrad"] == "triton"
    assert parts["quant_act_t"] == "triton/triton transposed" and parts["quant_act_both"] == "triton"
    assert parts["gemm"] == ("torch scaled_mm/triton" if DEV.type == "cuda" else "triton")
    x, w = torch.randn(130, 256, device=DEV), torch.randn(144, 256, device=DEV)
    y = ops.gemm(*ops.quant_act(x), *ops.quant_weight(w))
    assert ((y.float() - x @ w.t()).norm() / (x @ w.t()).norm()) < 0.05


def test_backend_names():
    assert kernels.resolve_backend("auto", "cpu") == "emulation"
    assert kernels.resolve_backend("auto", "cuda") == "auto"
    assert kernels.get_ops("auto", "cpu") is ref
    with pytest.raises(ValueError, match="must be one of"):
        kernels.resolve_backend("cublas", "cpu")
    with pytest.raises(NotImplementedError, match="no blockwise-scaled grouped GEMM"):
        kernels.get_ops("torch").grouped_gemm()


# ---------------------------------------------------------------------------------------- torch_gemm
def fake_scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype=torch.bfloat16):
    """cuBLASLt's blockwise contract as torch documents it (test_scaled_matmul_cuda.py), in plain torch:
    ``a [M,K]`` row-major, ``b [K,N]`` column-major; 1×128 scales ``[rows, K/128]`` outer-dim major (stride(0)
    == 1); 128×128 scales of b ``[round_up(K/128, 4), N/128]``."""
    import torch.nn.functional as F
    M, K = a.shape
    N = b.shape[1]
    assert a.stride(1) == 1 and b.stride(0) == 1 and K % 128 == 0
    assert recipe_a == F.ScalingType.BlockWise1x128 and scale_a.shape == (M, K // 128) and scale_a.stride(0) == 1
    if recipe_b == F.ScalingType.BlockWise128x128:
        L4 = -(-(K // 128) // 4) * 4
        assert scale_b.shape == (L4, -(-N // 128)), scale_b.shape
        sb, group = scale_b[: K // 128].t(), 128
    else:
        assert recipe_b == F.ScalingType.BlockWise1x128
        assert scale_b.shape == (N, K // 128) and scale_b.stride(0) == 1, (scale_b.shape, scale_b.stride())
        sb, group = scale_b, 1
    return (ref.dequant(a, scale_a) @ ref.dequant(b.t(), sb, group).t()).to(output_dtype)


def test_torch_gemm_meets_cublaslt_scale_layouts(monkeypatch):
    """The layouts ``torch_gemm`` hands to ``F.scaled_mm`` (measured right on an H100 by its self-check) are
    the documented ones: Fprop/Dgrad with 128×128 weight blocks (K/128 = 5: padded to 8) and Wgrad 1×128."""
    import torch.nn.functional as F
    assert torch_gemm.unavailable("cpu") and "CUDA" in torch_gemm.unavailable("cpu")
    monkeypatch.setattr(F, "scaled_mm", fake_scaled_mm)
    a, sa, b, sb = operands(M=192, N=200, K=640)
    torch.testing.assert_close(torch_gemm.gemm(a, sa, b, sb, torch.float32), ref.gemm(a, sa, b, sb, torch.float32))
    wq, ws, wq_t = ref.quant_weight(torch.randn(256, 640, device=DEV), transpose=True)   # Dgrad: b = Wᵀ, s.mT
    dyq, dys = ref.quant_act(torch.randn(64, 256, device=DEV))
    torch.testing.assert_close(torch_gemm.gemm(dyq, dys, wq_t, ws.mT, torch.float32),
                               ref.gemm(dyq, dys, wq_t, ws.mT, torch.float32))
    (at, sat), (bt, sbt) = (ref.quant_act_t(torch.randn(256, n, device=DEV)) for n in (96, 136))   # Wgrad: 1×128²
    torch.testing.assert_close(torch_gemm.gemm(at, sat, bt, sbt, torch.float32), ref.gemm(at, sat, bt, sbt, torch.float32))
    assert torch_gemm.accepts(a, sa, b, sb) and not torch_gemm.accepts(*operands(K=320))
    assert not torch_gemm.accepts(a, sa, wq_t.t(), ws)                            # not K-contiguous
    with pytest.raises(ValueError, match="multiple of 128"):
        torch_gemm.gemm(*operands(K=320))


def test_the_fused_quantiser_is_opt_in_on_cuda(monkeypatch):
    """``quant_act_both`` made the FP8 step slower on an H100: on CUDA the op namespaces use it only with
    DSV3_FUSED_QUANT=1 (the GPU suite's kernel tests set it); the interpreter and the Hopper gate's meta tensors
    always may."""
    monkeypatch.delenv(quant.FUSED_ENV, raising=False)
    assert not quant.fused_enabled("cuda") and quant.fused_enabled("cpu") and quant.fused_enabled("meta")
    monkeypatch.setenv(quant.FUSED_ENV, "1")
    assert quant.fused_enabled(torch.device("cuda", 0))



def test_the_transpose_kernel_is_the_default_with_torchs_copy_as_opt_out(monkeypatch):
    """The weights' transpose kernel made an H100's FP8 step faster: the default on every device (on CUDA after its
    self-check); DSV3_FP8_TRANSPOSE=0 runs torch's copy on CUDA, the baseline."""
    monkeypatch.delenv(quant.TRANSPOSE_ENV, raising=False)
    assert quant.transpose_enabled("cuda") and quant.transpose_enabled("cpu") and quant.transpose_enabled("meta")
    monkeypatch.setenv(quant.TRANSPOSE_ENV, "0")
    assert not quant.transpose_enabled(torch.device("cuda", 0)) and quant.transpose_enabled("cpu")