"""Helpers to compose configs and run the trainer in-process or as a subprocess."""
import json
import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_module

from configs.init_from import apply_init_from
from configs.schema import register, to_object, validate

from . import dist_utils

ROOT = Path(__file__).resolve().parents[1]


def fast_overrides(tmp: Path, cache: Path) -> list[str]:
    return [f"data.cache_dir={cache}", "logging.wandb.mode=disabled", "logging.progress=false"]


def make_config(*overrides: str, world_size: int = 1):
    """``+exp=tiny`` and ``overrides``, composed as ``python -m trainer`` does (``checkpoint.init_from`` applied)."""
    register()
    with initialize_config_module("configs", version_base=None):
        cfg = to_object(compose("config", overrides=["+exp=tiny", *overrides]))
    return validate(apply_init_from(cfg, overrides), world_size)


def run_inprocess(run_dir: Path, *overrides: str) -> dict:
    from trainer.train import Trainer
    run_dir.mkdir(parents=True, exist_ok=True)
    return Trainer(make_config(*overrides), run_dir).train()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m trainer *args`` in the repository root: its exit code, stdout and stderr. The process is forked
    from the tests' forkserver (``dist_utils``: torch and the trainer imported once) instead of a fresh
    interpreter, which spends seconds importing them; it then runs exactly what ``python -m trainer`` runs
    (``runpy``, ``__main__``, the given environment, atexit handlers at the end)."""
    # One intra-op thread: tests run in parallel on 2 cores, and oversubscribed OpenMP threads stall badly.
    return start_cli(*args, env=env).wait(timeout)


def start_cli(*args: str, env: dict | None = None) -> dist_utils.Module:
    """``run_cli`` without waiting: the running trainer (``pid``; ``wait(timeout)`` gives what ``run_cli`` gives)."""
    full_env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1", **(env or {})}
    return dist_utils.start_module("trainer", list(args), full_env, ROOT)


def run_torchrun(tmp_path: Path, name: str, nproc: int, *overrides: str, steps: int = 5) -> list[dict]:
    """``+exp=tiny`` for ``steps`` steps under torchrun (or one process when nproc == 1); returns metrics lines."""
    run_dir = tmp_path / name
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] \
        if nproc > 1 else [sys.executable]
    cmd = [*launcher, "-m", "trainer", "+exp=tiny", f"train.max_steps={steps}", "logging.wandb.mode=disabled",
           "logging.progress=false", f"hydra.run.dir={run_dir}", f"data.cache_dir={tmp_path}/cache", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_jsonl(run_dir / "metrics.jsonl")


def assert_losses_match(got: list[dict], want: list[dict], rel: float = 1e-5) -> None:
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= rel * abs(w["loss"]), (g["step"], g["loss"], w["loss"])
