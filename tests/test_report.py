"""``python -m tools.report`` on a tiny run stopped at step 6 and resumed to 10 (plots, summary, expert heatmap),
on partial or odd runs, and its one-line exit-2 errors; W&B is never touched."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml
from PIL import Image

from tools.report import main

from .trainer_utils import ROOT, read_jsonl, run_inprocess

COMMON = ["train.max_steps=10", "train.eval_every=5", "logging.wandb.mode=disabled", "logging.progress=false",
          "logging.log_every=2"]
ALWAYS = {"loss.png", "lr.png", "grad_norm.png", "throughput.png", "experts.png", "step_time.png"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(the run dir resumed to step 10, its report made at step 6 before the resume)."""
    tmp = tmp_path_factory.mktemp("report")
    run_dir, common = tmp / "run", [*COMMON, f"data.cache_dir={tmp}/cache"]
    run_inprocess(run_dir, *common, "train.stop_at_step=6")
    assert main([str(run_dir), "--out", str(tmp / "early")]) == 0
    run_inprocess(run_dir, *common)
    return run_dir, tmp / "early"


def check_images(out, names):
    assert {p.name for p in out.glob("*.png")} == set(names)
    for name in names:
        with Image.open(out / name) as img:
            img.verify()
        with Image.open(out / name) as img:
            assert img.size[0] >= 600 and img.size[1] >= 300, (name, img.size)
            lo, hi = img.convert("L").getextrema()
            assert hi - lo > 100, f"{name} looks blank"
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    for name in names:
        assert f"]({name})" in md and f'src="{name}"' in html


def copy_run(run_dir, dest):
    dest.mkdir()
    for name in ("metrics.jsonl", "eval.jsonl", "train.log", "config.yaml"):
        shutil.copy(run_dir / name, dest / name)
    return dest


def test_report_of_a_resumed_run(run, capsys):
    run_dir, _ = run
    assert main([str(run_dir)]) == 0
    out = run_dir / "report"
    assert str(out / "report.md") in capsys.readouterr().out
    check_images(out, ALWAYS)
    md = (out / "report.md").read_text()
    rows, evals = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "eval.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 11))   # one timeline across the resume
    assert f"final loss: {rows[-1]['loss']:.4f} (step 10)" in md
    assert "steps: 10 of 10" in md
    assert f"final val_loss: {evals[-1]['val_loss']:.4f} (step 10)" in md
    best = min(evals, key=lambda r: r["val_loss"])
    assert f"best val_loss: {best['val_loss']:.4f} (step {best['step']})" in md
    assert "model: preset tiny" in md and "precision: fp32" in md and "batch: 16 sequences x 128 tokens" in md
    assert "resumed 1x: at step 6 from " in md and "step_00000006" in md
    assert "last line: done: step 10/10" in md
    assert "MFU: n/a" in md   # CPU without logging.peak_tflops: none logged, none invented
    assert "experts.png shows expert_load.jsonl (10 windows, the last steps 10-10)" in md
    assert "pipeline_bubble.png" not in md
    with Image.open(out / "experts.png") as img, Image.open(out / "loss.png") as other:
        assert img.size[1] > other.size[1]   # the heatmap above the max / mean line


def test_expert_load_file_of_a_resumed_run(run):
    """heatmap_every = max(1, 10 // 20): a window per step, one line each across the resume, 1 on average."""
    run_dir, _ = run
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]
    rows = read_jsonl(run_dir / "expert_load.jsonl")
    assert [(r["from_step"], r["step"]) for r in rows] == [(s, s) for s in range(1, 11)]
    for r in rows:
        grid = r["load_over_mean"]
        n_moe = cfg["n_layers"] - cfg["first_k_dense"] + cfg["mtp_depth"]   # each MTP block has a MoE layer too
        assert [len(layer) for layer in grid] == [cfg["n_routed_experts"]] * n_moe
        for layer in grid:
            assert sum(layer) / len(layer) == pytest.approx(1.0, abs=1e-3)
    assert any(max(layer) > 1.05 for r in rows for layer in r["load_over_mean"])   # real loads, not all ones


def test_report_of_a_run_stopped_early(run):
    _, early = run
    check_images(early, ALWAYS)
    md = (early / "report.md").read_text()
    assert "steps: 6 of 10" in md and "last line: done: step 6/10" in md and "resumed" not in md
    assert "experts.png shows expert_load.jsonl (6 windows, the last steps 6-6)" in md


def test_cli_never_touches_wandb(run, tmp_path):
    run_dir, _ = run
    env = {**os.environ, "WANDB_MODE": "online", "WANDB_API_KEY": "x" * 40, "WANDB_BASE_URL": "http://127.0.0.1:9"}
    proc = subprocess.run([sys.executable, "-m", "tools.report", str(run_dir), "--out", str(tmp_path / "cli")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    check_images(tmp_path / "cli", ALWAYS)
    assert not (run_dir / "wandb").exists()
    code = ("import sys; from tools.report import main; rc = main(sys.argv[1:]); "
            "assert 'wandb' not in sys.modules, 'wandb imported'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, str(run_dir), "--out", str(tmp_path / "c2")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr


def test_torn_line_no_eval_and_no_end_line(run, tmp_path):
    run_dir, _ = run
    d = copy_run(run_dir, tmp_path / "r")
    (d / "eval.jsonl").unlink()
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"step": 11, "loss": 6.1')   # killed mid-write
    log = (d / "train.log").read_text().splitlines()
    (d / "train.log").write_text("\n".join(line for line in log if not line.startswith("done:")) + "\n")
    assert main([str(d)]) == 0
    md = (d / "report" / "report.md").read_text()
    last = read_jsonl(run_dir / "metrics.jsonl")[-1]
    assert f"final loss: {last['loss']:.4f} (step 10)" in md
    assert "metrics.jsonl: 1 line(s) that did not parse" in md
    assert "validation: none in eval.jsonl" in md and "val_loss" not in md.split("## Results")[1].split("##")[0]
    assert "no end line in train.log" in md and "the last step logged is 10" in md
    # copy_run leaves expert_load.jsonl out, as in a run dir of an older trainer
    assert "no expert_load.jsonl in the run dir" in md and "experts.png plots max_expert_load_over_mean" in md
    check_images(d / "report", ALWAYS)


def test_pipeline_bubble_rollbacks_and_skips(run, tmp_path):
    """A pp=2 run's rows (keys as trainer/train.py writes them) and the log lines of a rollback and a skip."""
    run_dir, _ = run
    d = copy_run(run_dir, tmp_path / "pp")
    rows = read_jsonl(d / "metrics.jsonl")
    for r in rows:
        r |= {"pipeline_bubble_measured": 0.2 + 0.01 * r["step"], "pipeline_bubble_simulated": 0.25, "mfu": 0.31}
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    cfg["parallel"] |= {"pp": 2, "schedule": "1f1b"}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    with open(d / "train.log", "a") as f:
        f.write("step 8: non-finite loss or gradients (rank 1): update skipped (1 in a row; the run stops at 3)\n"
                "step 9: rolled back to step 6 (/x/step_00000006), skipping the data of steps 7-9; rollback 1 of "
                "at most 3\nstopping at step 10 on request (SIGTERM): checkpoint /x/step_00000010; resume with "
                "checkpoint.resume=auto\n")
    assert main([str(d)]) == 0
    check_images(d / "report", ALWAYS | {"pipeline_bubble.png"})
    md = (d / "report" / "report.md").read_text()
    assert "median MFU: 31.0%" in md and "pipeline bubble: median 25.5% measured (rank 0), 25.0% simulated" in md
    assert "rollbacks: 1: step 9 back to step 6" in md
    assert "skipped steps (non-finite loss or gradients): 1 (steps 8)" in md
    assert "stop on request at step 10 (SIGTERM)" in md


def test_not_a_run_dir_is_one_line_exit_2(tmp_path, capsys, run):
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "missing", tmp_path / "empty"):
        assert main([str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {path}: not a run dir"), err
    (tmp_path / "file").write_text("x")
    assert main([str(run[0]), "--out", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --out: writing the report to"), err

