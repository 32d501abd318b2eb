"""A user's path through the trainer: start from existing weights (checkpoint.init_from), logs a cluster
job can read (start-up summary, plain step lines, train.log), the pre-flight memory check, re-running a
finished run."""
import time

import pytest

from errors import ConfigError
from parallel.dims import ParallelDims
from trainer.memory_plan import plan_memory
from trainer.preflight import LIMIT_ENV, preflight

from .test_trainer import SMALL, cache  # noqa: F401 - the same small run and data-cache fixture
from .trainer_utils import fast_overrides, make_config, read_jsonl, run_cli, run_inprocess


def test_init_from_our_checkpoint_loads_weights_and_starts_fresh(tmp_path, cache):
    common = [*fast_overrides(tmp_path, cache), *SMALL]
    run_inprocess(tmp_path / "a", *common, "train.max_steps=3", f"checkpoint.dir={tmp_path}/ck_a")
    trained_val = read_jsonl(tmp_path / "a/eval.jsonl")[-1]
    assert trained_val["step"] == 3
    summary = run_inprocess(tmp_path / "b", *common, "train.max_steps=2", f"checkpoint.dir={tmp_path}/ck_b",
                            f"checkpoint.init_from={tmp_path}/ck_a/step_00000003")
    assert summary["val_loss_start"] == trained_val["val_loss"]          # the same weights, bitwise
    fresh = read_jsonl(tmp_path / "a/metrics.jsonl")[0]
    b = read_jsonl(tmp_path / "b/metrics.jsonl")
    assert [m["step"] for m in b] == [1, 2] and b[0]["lr"] == fresh["lr"]   # step 0, fresh schedule + optimizer
    assert b[0]["loss"] < fresh["loss"]                                     # ... but trained weights
    assert "initialised from" in (tmp_path / "b/train.log").read_text()
    # A later start of run b resumes its own checkpoint; init_from no longer applies.
    run_inprocess(tmp_path / "b", *common, "train.max_steps=3", f"checkpoint.dir={tmp_path}/ck_b",
                  f"checkpoint.init_from={tmp_path}/ck_a/step_00000003")
    assert "init_from=" in (tmp_path / "b/train.log").read_text().split("resuming from")[0].splitlines()[-1]
    assert [m["step"] for m in read_jsonl(tmp_path / "b/metrics.jsonl")] == [1, 2, 3]


def test_init_from_another_model_names_both_values(tmp_path, cache):
    common = [*fast_overrides(tmp_path, cache), *SMALL, "train.max_steps=1"]
    run_inprocess(tmp_path / "a", *common, f"checkpoint.dir={tmp_path}/ck_a", "model.n_layers=3")
    with pytest.raises(ConfigError, match=r"^checkpoint\.init_from: .*step_00000001 was written with model\.n_layers=3"
                                          r", this run has 4 \(set model\.n_layers=3"):
        run_inprocess(tmp_path / "b", *common, f"checkpoint.init_from={tmp_path}/ck_a/step_00000001")
    with pytest.raises(ConfigError, match=r"^checkpoint\.init_from: .*nowhere is not a loadable checkpoint"):
        run_inprocess(tmp_path / "c", *common, f"checkpoint.init_from={tmp_path}/nowhere")


def test_cluster_log_lines(tmp_path, cache):
    """logging.progress=false (or no terminal): a start-up summary and one plain line per log_every steps on
    stdout and in <run dir>/train.log; saves announced; a finished run started again says so."""
    args = ["+exp=tiny", *SMALL, "train.max_steps=4", "logging.log_every=2", "logging.progress=false",
            "logging.wandb.mode=disabled", f"data.cache_dir={cache}", f"hydra.run.dir={tmp_path}/run"]
    proc = run_cli(*args, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    for prefix in ("run dir ", "layout: 1 rank(s) = pp 1 x dp 1", "model: ", "data: embedded corpus", "memory: ~"):
        assert any(line.startswith(prefix) for line in out), (prefix, proc.stdout)
    steps = [line for line in out if line.startswith("step ")]
    assert [s.split(" | ")[0] for s in steps] == ["step 2/4", "step 4/4"], proc.stdout
    fields = [f.split(" ")[0] for f in steps[0].split(" | ")]
    assert fields == ["step", "loss", "lr", "grad", *fields[4:5], "MFU", "mem", "ETA"] and "tok/s" in steps[0]
    assert any(line.startswith(f"checkpoint saved: {tmp_path}/run/checkpoints/step_00000004 (step 4")
               for line in out)
    tok = {f.name: f.read_bytes() for f in (tmp_path / "run/tokenizer").iterdir()}   # it travels with the run ...
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(tok)                     # ... and each checkpoint
    assert {f: (tmp_path / "run/checkpoints/step_00000004" / f).read_bytes() for f in tok} == tok
    log = (tmp_path / "run/train.log").read_text().splitlines()
    assert steps[0] in log and steps[1] in log and "\r" not in proc.stdout + proc.stderr   # no progress bar
    # each validation as it is computed (before the first step, after the last), not only in the final line
    evals = read_jsonl(tmp_path / "run/eval.jsonl")
    assert [line for line in out if line.startswith("validation ")] == \
        [f"validation at step {e['step']}/4: val_loss {e['val_loss']:.4f}" for e in evals] and len(evals) == 2
    assert out[-1].startswith("done: step 4/4, ")
    again = run_cli(*args, timeout=300)
    assert again.returncode == 0 and "nothing to do: already at train.max_steps=4" in again.stdout
    assert "loss nan" not in again.stdout


def test_a_stopped_run_ends_with_a_stopped_line(tmp_path, cache, monkeypatch):
    """SIGTERM mid-run: the last line says where it stopped, the checkpoint and how to resume, not ``done:``."""
    import os
    import signal

    from trainer.train import Trainer
    cfg = make_config(*fast_overrides(tmp_path, cache), *SMALL, "train.max_steps=6", "train.eval_every=0")
    trainer = Trainer(cfg, tmp_path / "run")
    step = Trainer.train_step

    def stop_after_two(self):
        metrics = step(self)
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)   # handled at this step's boundary, like a SLURM preemption
        return metrics
    monkeypatch.setattr(Trainer, "train_step", stop_after_two)
    assert trainer.train()["stopped"] == "SIGTERM"
    last = (tmp_path / "run/train.log").read_text().splitlines()[-1]
    ck = tmp_path / "run/checkpoints/step_00000003"   # the step in progress when the stop was seen finishes first
    assert last.startswith(f"stopped at step 3/6 (checkpoint {ck}): resume with checkpoint.resume=auto; "), last
    assert ck.is_dir()


def test_preflight_stops_v3_small_in_one_line(tmp_path):
    t0 = time.perf_counter()
    proc = run_cli("+exp=v3_small", "logging.wandb.mode=disabled", f"hydra.run.dir={tmp_path}/run", timeout=120,
                   env={LIMIT_ENV: "8"})
    took = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    # BF16 weights 2 B, FP32 gradients 4, FP32 master 4 + BF16 moments 2 x 2 per parameter, and the activations
    assert len(err) == 1 and err[0].startswith("error: memory: this run needs ~51.95 GB per rank (weights 4.32, "
                                               "grads 8.65, optimizer 17.29, activations 21.68;"), proc.stderr
    assert "but 8.0 GB are available ($DSV3_MEMORY_LIMIT_GB)" in err[0] and "parallel.ep" in err[0]
    assert took < 60, took   # measured ~17 s under load; nothing is built


def test_preflight_names_the_key_that_fits(monkeypatch):
    cfg = make_config("parallel.zero=0", world_size=4)
    z0 = plan_memory(cfg, 4, "trainer").worst.total
    cfg2 = make_config("parallel.zero=2", world_size=4)
    z2 = plan_memory(cfg2, 4, "trainer").worst.total
    assert z2 < z0
    monkeypatch.setenv(LIMIT_ENV, str((z0 + z2) / 2 / 1e9))
    with pytest.raises(ConfigError, match=r"^memory: .* it fits with parallel\.zero=2"):
        preflight(cfg, ParallelDims(world_size=4), None)
    assert preflight(cfg2, ParallelDims(world_size=4), None).startswith("memory: ~")


def test_wandb_run_name_from_experiment_and_layout():
    from omegaconf import OmegaConf

    from trainer.wandb_panels import run_name
    cfg = OmegaConf.to_container(OmegaConf.structured(make_config("parallel.pp=2", "parallel.ep=2",
                                                                  "parallel.schedule=dualpipe", world_size=4)))
    assert run_name(cfg, 4) == "d64-l4-e8-pp2-ep2-dp2-dualpipe-fp32".replace("d64", f"d{cfg['model']['dim']}")
