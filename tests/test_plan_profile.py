"""``tools.plan_profile``: a GPU profile's GEMM efficiencies from a ``bench.gpu_suite`` report (its JSON sidecar),
built here with the suite's own table code and made-up rates."""
import statistics

import pytest

from bench import fp8_gemm, fp8_grouped_gemm
from bench import suite_report as rep
from tools.plan import main as plan_main
from tools.plan_costs import Hardware, load_hardware
from tools.plan_profile import ReportError, calibrate, gemm_rates, load_report

META = {"date": "2026-11-24 10:00 UTC", "device_line": "NVIDIA H100 80GB HBM3, sm_90, 132 SMs, 79.1 GiB",
        "commit": "abc1234", "mode": "full", "smoke": False}
GROUPED = {"fprop": [700.0, 760.0], "dgrad": [680.0, 720.0], "wgrad": [300.0, 340.0]}
DENSE_BF16 = {(16384, 7168, 7168): [640.0, 650.0, 600.0], (4096, 2048, 2048): [100.0, 120.0, 90.0]}   # 2nd: small


def _report(tmp_path, meta=META, parts=("grouped", "gemm"), cut_wgrad=False):
    grouped = []
    for p, rates in GROUPED.items():
        for E, v in zip((8, 32), rates):
            skipped = cut_wgrad and p == "wgrad"
            grouped.append({"E": E, "gemm": "w13", "pass": p, "skipped": skipped, "tflops": v, "bf16_tflops": 500.0,
                            "vs_bf16": v / 500, "err": 1e-3, "ok": True})
    dense = [{"shape": f"{m}x{n}x{k}", "M": m, "N": n, "K": k, "layout": lay, "skipped": False, "tflops": 900.0,
              "bf16_tflops": v, "err": 1e-3, "ok": True}
             for (m, n, k), rates in DENSE_BF16.items() for lay, v in zip(fp8_gemm.LAYOUTS, rates)]
    tables = {"grouped": rep.Table(fp8_grouped_gemm.HEADERS, fp8_grouped_gemm.table_rows(grouped)),
              "gemm": rep.Table(fp8_gemm.HEADERS, fp8_gemm.table_rows(dense))}
    out = tmp_path / "gpu_report.md"
    rep.write(out, meta, [rep.Part(k, k, "ok", tables=[tables[k]]) for k in parts])
    return out


def test_efficiencies_are_the_measured_rates_over_the_profiles_peaks(tmp_path):
    path = _report(tmp_path)
    report = load_report(str(path))   # the .md path finds its .json sidecar
    rates = gemm_rates(report)
    assert rates["bf16"] == DENSE_BF16[(16384, 7168, 7168)]   # large shapes only
    h100 = load_hardware("h100")
    hw, lines = calibrate(h100, report, str(path))
    assert hw.gemm_efficiency == pytest.approx(statistics.median(GROUPED["fprop"] + GROUPED["dgrad"])
                                               / h100.peak_fp8_tflops, abs=1e-4)
    assert hw.wgrad_efficiency == pytest.approx(320.0 / h100.peak_fp8_tflops, abs=1e-4)
    assert hw.bf16_efficiency == pytest.approx(640.0 / h100.peak_bf16_tflops, abs=1e-4)
    assert (hw.peak_fp8_tflops, hw.ib_gb_s, hw.attention_efficiency) == \
           (h100.peak_fp8_tflops, h100.ib_gb_s, h100.attention_efficiency)
    assert hw.name == "H100 (calibrated)" and "abc1234" in hw.sources[-1] and len(lines) == 3


def test_cli_calibrates_saves_and_the_saved_profile_predicts_the_same(tmp_path, capsys):
    from configs.schema import compose
    from tools.plan import predict
    path = _report(tmp_path)
    saved = tmp_path / "h100_measured.yaml"
    assert plan_main(["--hardware", "h100", "--gpu-report", str(path.with_suffix(".json")), "--save-profile",
                      str(saved), "+exp=tiny", "parallel.pp=2", "parallel.schedule=dualpipe", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("H100 (calibrated): gemm_efficiency 0.700 -> 0.359") and f"wrote {saved}" in out
    cfg = compose(["model=v3_16b", "parallel.pp=2", "parallel.schedule=dualpipe", "parallel.ep=8",
                   "parallel.ranks_per_node=1", "data.seq_len=4096", "train.micro_batch_size=1",
                   "train.global_batch_size=64"])
    h100 = load_hardware("h100")
    profiles = (load_hardware(str(saved)), calibrate(h100, load_report(str(path)))[0], h100)
    steps = [predict(cfg, hw, 16).step_s for hw in profiles]
    assert steps[0] == steps[1] > 1.2 * steps[2]   # the made-up kernels are slower than the profile assumed


@pytest.mark.parametrize("case, needle", [
    ("smoke", "smoke run"), ("no grouped part", "no 'grouped' part"), ("cut", "no timings for wgrad"),
    ("not json", "is not JSON"), ("cpu profile", "no FP8 and BF16 peaks")])
def test_reports_that_cannot_calibrate_are_refused_naming_why(tmp_path, capsys, case, needle):
    hw = load_hardware("h100")
    if case == "smoke":
        path = _report(tmp_path, meta={**META, "smoke": True})
    elif case == "no grouped part":
        path = _report(tmp_path, parts=("gemm",))
    elif case == "cut":
        path = _report(tmp_path, cut_wgrad=True)
    elif case == "not json":
        path = tmp_path / "r.json"
        path.write_text("# a markdown report\n")
    else:
        path, hw = _report(tmp_path), Hardware(name="cpu")   # a profile without GPU peaks
    with pytest.raises(ReportError, match=needle) as e:
        calibrate(hw, load_report(str(path)), str(path))
    assert str(path) in str(e.value)
    if case == "smoke":   # the CLI: one line, exit code 2
        assert plan_main(["--hardware", "h100", "--gpu-report", str(path), "+exp=tiny"]) == 2
        assert capsys.readouterr().err.startswith("error: ")
