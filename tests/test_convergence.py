"""The README's tiny run: validation loss falls from ~ln(vocab) to a clearly lower value."""
import math

import pytest

from .trainer_utils import read_jsonl, run_cli


@pytest.mark.slow
def test_tiny_experiment_learns(tmp_path):
    run = tmp_path / "run"
    proc = run_cli("+exp=tiny", f"hydra.run.dir={run}", f"data.cache_dir={tmp_path}/cache",
                   "logging.wandb.mode=disabled", "logging.progress=false", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = read_jsonl(run / "eval.jsonl")
    start, end = evals[0]["val_loss"], evals[-1]["val_loss"]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 150
    assert abs(start - math.log(1024)) < 0.15
    assert end < start - 2.0, (start, end)       # measured: 6.95 -> 3.83
    assert len(read_jsonl(run / "metrics.jsonl")) == 150
    assert (run / "checkpoints" / "step_00000150" / ".metadata").is_file()
