"""``expert_load.jsonl``: one line per ``heatmap_every`` window and at the last step (W&B disabled), cut back on
resume and rollback like metrics.jsonl; a run stopped mid-window writes the open one at close."""
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from trainer.expert_load import LoadWindow, load_over_mean
from trainer.metrics import MetricsLogger

from .trainer_utils import make_config, read_jsonl

DISABLED = SimpleNamespace(mode="disabled", project="t", entity=None, name=None, tags=[])


def loads(step: int) -> list[torch.Tensor]:
    """Two MoE layers x 4 experts; layer 0 moves its load to expert ``step % 4``, layer 1 is balanced."""
    hot = torch.ones(4)
    hot[step % 4] = 5.0
    return [hot, torch.full((4,), 2.0)]


def logger(run_dir: Path, start_step: int) -> MetricsLogger:
    cfg = OmegaConf.to_container(OmegaConf.structured(make_config()))
    return MetricsLogger(run_dir, DISABLED, cfg, total_steps=10, start_step=start_step, progress=False,
                         device=torch.device("cpu"), heatmap_every=3)


def run_steps(log: MetricsLogger, steps) -> None:
    for step in steps:
        log.log_step({"step": step, "loss": 1.0}, loads(step))


def expected(first: int, last: int) -> list[list[float]]:
    total = [sum(x) for x in zip(*(loads(s) for s in range(first, last + 1)))]
    return [[round(v, 4) for v in layer.tolist()] for layer in load_over_mean(total)]


def test_windows_shapes_and_values(tmp_path):
    log = logger(tmp_path, 0)
    run_steps(log, range(1, 11))
    log.close()
    rows = read_jsonl(tmp_path / "expert_load.jsonl")
    assert [(r["from_step"], r["step"]) for r in rows] == [(1, 3), (4, 6), (7, 9), (10, 10)]
    for r in rows:
        assert r["load_over_mean"] == expected(r["from_step"], r["step"])
        assert [len(layer) for layer in r["load_over_mean"]] == [4, 4]
        for layer in r["load_over_mean"]:
            assert sum(layer) / len(layer) == pytest.approx(1.0, abs=1e-4)
    assert rows[-1]["load_over_mean"] == [[0.5, 0.5, 2.5, 0.5], [1.0] * 4]   # step 10: expert 2 hot, 5 / mean 2


def test_cut_back_on_resume_and_rollback_and_open_window_at_close(tmp_path):
    log = logger(tmp_path, 0)
    run_steps(log, range(1, 6))
    log.close()   # stopped at step 5: the open window 4-5 is written
    assert [(r["from_step"], r["step"]) for r in read_jsonl(tmp_path / "expert_load.jsonl")] == [(1, 3), (4, 5)]

    log = logger(tmp_path, 4)   # resumed from the checkpoint of step 4: the window that ended at 5 goes
    assert [r["step"] for r in read_jsonl(tmp_path / "expert_load.jsonl")] == [3]
    run_steps(log, range(5, 9))   # windows 5-6; 7-8 open
    log.rewind(7)                 # rolled back to step 7: nothing after it, the open window restarts at 8
    run_steps(log, range(8, 11))
    log.close()
    rows = read_jsonl(tmp_path / "expert_load.jsonl")
    assert [(r["from_step"], r["step"]) for r in rows] == [(1, 3), (5, 6), (8, 9), (10, 10)]
    assert rows[1]["load_over_mean"] == expected(5, 6) and rows[2]["load_over_mean"] == expected(8, 9)


def test_window_without_moe_layers_writes_nothing():
    w = LoadWindow(every=1, total_steps=2, start_step=0)
    assert w.add(1, []) is None and w.close(2) is None
