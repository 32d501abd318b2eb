"""Stragglers: every rank's compute time of a step rides on the step's existing world all-reduce (no extra
collective); the skew is logged per step (W&B ``time/rank_skew``) and a rank that stays slow is named."""
import time
from pathlib import Path

import torch

from .dist_utils import spawn
from .trainer_utils import make_config

SLEEP_S = 0.5


def _slow_rank_worker(rank, world, tmp):
    """ep=2: rank 1 sleeps before each forward, so rank 0 waits for it in the expert all-to-all; that wait is not
    rank 0's compute, so rank 1 must come out as the slow one."""
    from parallel.dims import ParallelDims
    from trainer.train import Trainer
    cfg = make_config("logging.wandb.mode=disabled", "logging.progress=false", "train.max_steps=6",
                      "train.eval_every=0", f"data.cache_dir={tmp}/cache", "parallel.ep=2",
                      "logging.straggler_steps=3", world_size=world)
    dims = ParallelDims(world_size=world, rank=rank, ep=2, timeout_s=60).build_groups()
    trainer = Trainer(cfg, Path(tmp) / "run", dims, torch.device("cpu"))
    compute_loss = trainer.model.compute_loss

    def slow(*a, **k):
        if rank == 1:
            time.sleep(SLEEP_S)
        return compute_loss(*a, **k)
    trainer.model.compute_loss = slow
    lines = []
    trainer.logger = type("L", (), {"write": lambda self, line: lines.append(line)})()
    rows = [trainer.train_step() for _ in range(6)]
    assert "rank_skew" not in rows[0]           # the first step has no previous step to compare
    for r in rows[1:]:
        assert r["slowest_rank"] == 1 and r["rank_skew"] > 0.5, r
    named = [ln for ln in lines if "straggler" in ln]
    assert len(named) == 1 and named[0].startswith("step 4: rank 1 is a straggler:"), lines
    assert "logging.straggler_threshold=0.2" in named[0]


def test_a_slow_rank_is_named_once_and_its_peers_waits_do_not_count(tmp_path):
    spawn(_slow_rank_worker, 2, tmp_path, str(tmp_path))


def test_the_skew_keys_are_not_phase_seconds():
    """Phase seconds are time_<phase>_s and add up to less than the step (tests/test_schedules_e2e.py); the skew and
    the slowest rank are not seconds, yet they belong on W&B's time/ panel."""
    from trainer.wandb_panels import panel_name
    assert panel_name("rank_skew") == "time/rank_skew" and panel_name("slowest_rank") == "time/slowest_rank"
