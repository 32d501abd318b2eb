"""The GEMMs' tuning table (``kernels/tuning.py``): a tuned config is the first variant self-checked, a wrong one
gives way to the built-in variants with one warning line (``tuning.tuned`` patched: it reads CUDA tables only)."""
import json
import logging

import pytest
import torch

pytest.importorskip("triton")

import kernels  # noqa: E402

kernels.configure()
from kernels import gemm, selfcheck, tuning  # noqa: E402
from kernels import reference as ref  # noqa: E402

from .fp8_utils import DEV, assert_gemm_close, fresh_verdicts  # noqa: E402,F401 - autouse

TUNED = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4, "GROUP_M": 8}


def operands():
    g = torch.Generator().manual_seed(0)
    a, sa = ref.quant_act(torch.randn(200, 464, generator=g).to(DEV))
    b, sb = ref.quant_weight(torch.randn(136, 464, generator=g).to(DEV))
    return a, sa, b, sb


def test_repo_tables_are_valid_and_named_by_their_device():
    tables = sorted(tuning.TABLE_DIR.glob("*.json"))
    assert tables, "the H100 table measured by bench.fp8_tune is in the repo"
    for path in tables:
        data = json.loads(path.read_text())
        assert path.stem == tuning.slug(data["device"]), path
        assert set(data["configs"]) <= set(tuning.KERNELS)
        for kernel, cfg in tuning._load(str(path))["configs"].items():
            assert {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"} <= set(cfg), (path, kernel)
            assert all(cfg[k] & (cfg[k] - 1) == 0 for k in ("BLOCK_M", "BLOCK_N", "num_warps")), (path, kernel)
            # the choice is the best scored config, and the scores came from configs right on every case
            best = max(data["scores"][kernel].items(), key=lambda kv: kv[1])[0]
            assert best == "x".join(str(cfg[k]) for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"))


def test_slug_and_the_environment_override(tmp_path, monkeypatch):
    assert tuning.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    monkeypatch.delenv(tuning.ENV, raising=False)
    assert tuning.table_path("NVIDIA H100 80GB HBM3") == tuning.TABLE_DIR / "nvidia-h100-80gb-hbm3.json"
    assert tuning.table_path("a device nobody tuned") is None
    own = tmp_path / "t.json"
    own.write_text(json.dumps({"configs": {"gemm": TUNED}}))
    monkeypatch.setenv(tuning.ENV, str(own))
    assert tuning.table_path("a device nobody tuned") == own
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"configs": {"gemm": {"BLOCK_Q": 64}}}))
    with pytest.raises(ValueError, match="BLOCK_Q"):
        tuning._load(str(bad))
    assert tuning.tuned("gemm", "cpu") is None          # tables are for CUDA devices


def test_the_tuned_config_is_self_checked_first_and_launched(monkeypatch):
    monkeypatch.setattr(tuning, "tuned", lambda kernel, device: dict(TUNED) if kernel == "gemm" else None)
    launched = []
    real_pick = gemm.pick_config
    monkeypatch.setattr(gemm, "pick_config", lambda *a, **k: launched.append(real_pick(*a, **k)) or launched[-1])
    a, sa, b, sb = operands()
    out = gemm.gemm(a, sa, b, sb, torch.float32)
    assert_gemm_close(out, ref.gemm(a, sa, b, sb, torch.float32))
    ok = [v for (k, v, _), verdict in selfcheck.verdicts().items() if k == "gemm" and verdict.ok]
    assert len(ok) == 1 and ok[0].startswith("tuned ") and "BLOCK_M=64" in ok[0]
    assert launched[-1]["BLOCK_M"] == 64 and launched[-1]["num_warps"] == 4 and launched[-1]["TMA"]
    assert not launched[-1]["WARP_SPECIALIZE"]


def test_a_wrong_tuned_config_gives_way_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(tuning, "tuned", lambda kernel, device: dict(TUNED))
    monkeypatch.setattr(gemm, "self_check", lambda variant, device: 0.5 if variant.get("BLOCK_M") == 64 else 0.0)
    a, sa, b, sb = operands()
    with caplog.at_level(logging.WARNING, logger="kernels"):
        gemm.gemm(a, sa, b, sb, torch.float32)
        gemm.gemm(a, sa, b, sb, torch.float32)          # the verdict is cached: no second warning
    assert len(caplog.records) == 1
    msg = caplog.records[0].getMessage()
    assert "launch config tuned" in msg and "BLOCK_M=64" in msg and "using tma instead" in msg
    assert {v for (k, v, _), verdict in selfcheck.verdicts().items() if verdict.ok} == {"tma"}


def test_no_tuned_config_without_tma(monkeypatch):
    """Operands TMA cannot read take the pointer path: the tuned (TMA) config is not tried."""
    monkeypatch.setattr(tuning, "tuned", lambda kernel, device: dict(TUNED))
    assert gemm.default_variant("gemm", False, torch.device("cpu"), lambda v, device: 0.0) == gemm.VARIANTS["pointers"]


def test_the_tuner_times_the_grouped_orders_and_keeps_the_best_config_measured_everywhere():
    from bench import fp8_tune
    grouped = fp8_tune.candidates("grouped_gemm")
    assert grouped[0] == fp8_tune.CONFIGS[0] and set(fp8_tune.GROUPED_ORDERS) < set(grouped)
    assert fp8_tune.config_dict("grouped_gemm", grouped[0]) == {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8,
                                                                "num_stages": 4}            # GROUP_M 0: built-in
    assert fp8_tune.config_dict("grouped_gemm", (64, 128, 4, 4, 16))["GROUP_M"] == 16
    assert fp8_tune.config_dict("gemm", fp8_tune.CONFIGS[0])["GROUP_M"] == 8
    assert "GROUP_M" not in fp8_tune.config_dict("grouped_wgrad", fp8_tune.CONFIGS[0])
    base, fast, faster_once = grouped[0], grouped[1], grouped[2]
    rows = [{"case": case, "config": c, "ms": ms} for case, c, ms in
            [("a", base, 2.0), ("b", base, 4.0), ("a", fast, 1.0), ("b", fast, 2.0), ("a", faster_once, 0.5),
             ("b", faster_once, None)]]                   # wrong or not run on case b: out
    choice, scores = fp8_tune.best(rows, grouped)
    assert choice == fast and scores == {base: 1.0, fast: 2.0}
