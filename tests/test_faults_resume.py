"""Resume hygiene: a resumed run cuts metrics.jsonl / eval.jsonl back to its checkpoint's step
(one line per step), continues the same W&B run (the id is kept in every checkpoint), and the metrics files are
strict JSON (non-finite numbers as null)."""
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from checkpoint import CheckpointManager
from trainer.metrics import RUN_ID_FILE, MetricsLogger, cut_back, json_line, saved_run_id
from trainer.wandb_log import read_offline_run

from .trainer_utils import fast_overrides, make_config, read_jsonl, run_inprocess

SMALL = ["train.global_batch_size=8", "train.micro_batch_size=4", "data.seq_len=64", "train.eval_batches=1"]
DISABLED = SimpleNamespace(mode="disabled", project="t", entity=None, name=None, tags=[])


def strict_jsonl(path: Path) -> list[dict]:
    """Parse as strict JSON: NaN / Infinity tokens are an error."""
    def refuse(token):
        raise ValueError(f"{path}: non-standard JSON token {token}")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def logger(run_dir: Path, start_step: int = 0, run_id: str | None = None, wandb_cfg=DISABLED) -> MetricsLogger:
    cfg = OmegaConf.to_container(OmegaConf.structured(make_config()))
    return MetricsLogger(run_dir, wandb_cfg, cfg, total_steps=10, start_step=start_step, progress=False,
                         device=torch.device("cpu"), run_id=run_id)


def test_metrics_files_are_strict_json(tmp_path):
    log = logger(tmp_path)
    log.log_step({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3,
                  "mem_peak_gb_per_rank": [0.5, float("-inf")]})
    log.log_eval(1, float("nan"))
    log.close()
    (row,) = strict_jsonl(tmp_path / "metrics.jsonl")
    assert row["loss"] is None and row["grad_norm"] is None and row["lr"] == 1e-3
    assert row["mem_peak_gb_per_rank"] == [0.5, None]
    assert strict_jsonl(tmp_path / "eval.jsonl") == [{"step": 1, "val_loss": None}]
    assert json_line({"a": [1.0, {"b": math.nan}]}) == '{"a": [1.0, {"b": null}]}'


def test_cut_back_keeps_steps_up_to_the_checkpoint(tmp_path):
    m, e = tmp_path / "metrics.jsonl", tmp_path / "eval.jsonl"
    m.write_text("".join(f'{{"step": {s}, "loss": {s}.5}}\n' for s in range(1, 7)) + '{"step": 7, "lo')  # torn line
    e.write_text("".join(f'{{"step": {s}, "val_loss": NaN}}\n' for s in (0, 2, 4, 6)))   # pre-fix bare NaN
    log = logger(tmp_path, start_step=4)
    log.log_step({"step": 5, "loss": 9.0})
    log.close()
    assert [(r["step"], r["loss"]) for r in strict_jsonl(m)] == [(1, 1.5), (2, 2.5), (3, 3.5), (4, 4.5), (5, 9.0)]
    assert strict_jsonl(e) == [{"step": 0, "val_loss": None}, {"step": 2, "val_loss": None},
                               {"step": 4, "val_loss": None}]
    # A start from step 0 (no checkpoint yet: e.g. requeued before the first save) redoes everything.
    assert cut_back(m, 0) == 5 and m.read_text() == ""
    assert cut_back(tmp_path / "absent.jsonl", 3) == 0


def run_id(run_dir: Path, **kwargs) -> str:
    log = logger(run_dir, **kwargs)
    log.close()
    return log.run_id


def test_run_id_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    fresh = run_id(tmp_path)
    assert len(fresh) == 8 and fresh.isalnum() and fresh != run_id(tmp_path)
    assert run_id(tmp_path, run_id="fromckpt") == "fromckpt"          # the resumed checkpoint's
    monkeypatch.setenv("WANDB_RUN_ID", "fromenv")
    assert run_id(tmp_path, run_id="fromckpt") == "fromenv"           # the user's explicit choice
    assert MetricsLogger(tmp_path, DISABLED, {}, 10, 0, False, is_main=False).run_id is None
    (tmp_path / "ck").mkdir()
    assert saved_run_id(tmp_path / "ck") is None and saved_run_id(None) is None
    (tmp_path / "ck" / RUN_ID_FILE).write_text("abc123\n")
    assert saved_run_id(tmp_path / "ck") == "abc123"


def offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"), key=lambda p: p.name)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # 2 shared cores: oversubscribed intra-op threads stall badly
    yield
    torch.set_num_threads(threads)


def test_resume_one_line_per_step_and_the_same_wandb_run(tmp_path, monkeypatch, one_thread):
    """Run 2 resumes killed run 1 from step 3: each step logged once, redone steps equal run 1's; run 3 (new run
    dir) continues too; all three log to one W&B run id."""
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    ck = tmp_path / "ck"
    common = [*fast_overrides(tmp_path, tmp_path / "cache"), *SMALL, "logging.wandb.mode=offline",
              f"checkpoint.dir={ck}", "train.eval_every=2", "checkpoint.keep=0"]
    run = tmp_path / "run"
    run_inprocess(run, *common, "train.max_steps=5", "checkpoint.every=3", "checkpoint.save_final=false")
    first = {m["step"]: m["loss"] for m in read_jsonl(run / "metrics.jsonl")}
    assert sorted(first) == [1, 2, 3, 4, 5] and [r["step"] for r in read_jsonl(run / "eval.jsonl")] == [0, 2, 4, 5]
    assert CheckpointManager(ck).latest().name == "step_00000003"

    run_inprocess(run, *common, "train.max_steps=7", "checkpoint.every=0")
    lines = strict_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5, 6, 7]
    assert [m["loss"] for m in lines[3:5]] == [first[4], first[5]]      # redone steps: bitwise as before
    assert [r["step"] for r in strict_jsonl(run / "eval.jsonl")] == [0, 2, 4, 6, 7]

    run_inprocess(tmp_path / "run2", *common, "train.max_steps=8", "checkpoint.every=0")
    assert [m["step"] for m in read_jsonl(tmp_path / "run2" / "metrics.jsonl")] == [8]

    segments = offline_runs(run) + offline_runs(tmp_path / "run2")
    ids = {p.name.rsplit("-", 1)[1] for p in segments}
    assert len(segments) == 3 and len(ids) == 1, segments
    (run_id,) = ids
    assert {saved_run_id(ck / f"step_{s:08d}") for s in (3, 7, 8)} == {run_id}
    steps = [[row["_step"] for row in read_offline_run(p)[0] if "train/loss" in row] for p in segments]
    assert steps == [[1, 2, 3, 4, 5], [4, 5, 6, 7], [8]]


# ---- the config on resume -------------------------------------------------------------------------------------
def fake_checkpoint(path: Path, *overrides: str) -> Path:
    """A step dir holding only the config.yaml a save writes (config_changes reads nothing else)."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(make_config(*overrides))))
    return path


def test_config_changes_lists_what_may_change_and_refuses_what_may_not(tmp_path):
    from errors import ConfigError
    from trainer.run_state import config_changes
    ck = fake_checkpoint(tmp_path / "step_00000004", "optim.lr=0.003", "train.max_steps=10")
    assert config_changes(make_config("optim.lr=0.003", "train.max_steps=10"), ck) is None
    # logging, checkpointing, the layout, the device, the stop step and the cache: meant to change, not listed
    same = make_config("optim.lr=0.003", "train.max_steps=10", "logging.log_every=1", "checkpoint.every=2",
                       "parallel.timeout_s=60", "train.stop_at_step=5", "data.cache_dir=/elsewhere",
                       "logging.wandb.mode=offline", "train.device=cpu")
    assert config_changes(same, ck) is None
    line = config_changes(make_config("optim.lr=0.001", "train.max_steps=20", "train.precision=bf16",
                                      "logging.log_every=1"), ck)
    assert line == (f"config changed since {ck}: optim.lr: 0.003 -> 0.001, train.max_steps: 10 -> 20, "
                    "train.precision: fp32 -> bf16"), line
    for changed, first, way in [(["train.seed=7"], "train.seed: ", f"checkpoint.init_from={ck} "),
                                (["data.seq_len=64", "train.seed=7"], "data.seq_len: ", "checkpoint.init_from="),
                                (["data.tokenizer=/tok"], "data.tokenizer: ", "checkpoint.init_from="),
                                (["model.n_layers=3", "optim.lr=0.001"], "model.n_layers: ", "checkpoint.resume=none")]:
        with pytest.raises(ConfigError) as e:
            config_changes(make_config("optim.lr=0.003", "train.max_steps=10", *changed), ck)
        msg = str(e.value)
        assert msg.startswith(first + f"cannot change when resuming: the checkpoint {ck} was written with ") and \
            "\n" not in msg and way in msg, msg
    msg = str(pytest.raises(ConfigError, config_changes,
                            make_config("train.max_steps=10", "data.seq_len=64", "train.seed=7"), ck).value)
    assert "written with data.seq_len=128, this run has data.seq_len=64 (also train.seed: 0 -> 7)" in msg, msg
    assert "optim.lr" not in msg   # the keys that may change are not part of the refusal
    # data.blend is checked by content where it opens (BlendedBatches): a source moved elsewhere is listed, not refused
    blend = fake_checkpoint(tmp_path / "blend" / "step_00000004", "data.blend=[{path: /a/web, weight: 0.5}]")
    assert config_changes(make_config("data.blend=[{path: /b/web, weight: 0.5}]"), blend) == \
        f"config changed since {blend}: data.blend[0].path: /a/web -> /b/web"
    (ck / "config.yaml").unlink()   # a converted checkpoint (model_config.yaml only): the model check alone
    assert config_changes(make_config("optim.lr=0.001"), ck) is None


def test_resume_cli_prints_the_changes_and_refuses_the_seed(tmp_path, one_thread):
    """Through the CLI: the changed keys are one line of the log; a new seed is one error line, exit 2, before
    the corpus is read; its advice (a new run directory with checkpoint.init_from) works."""
    from .trainer_utils import run_cli
    cache, run = tmp_path / "cache", tmp_path / "run"
    args = ["+exp=tiny", *SMALL, "train.eval_every=0", f"data.cache_dir={cache}", "logging.wandb.mode=disabled",
            "logging.progress=false"]
    run_inprocess(run, *args[1:], "train.max_steps=2")
    step2 = run / "checkpoints" / "step_00000002"
    proc = run_cli(*args, f"hydra.run.dir={run}", "train.max_steps=3", "optim.lr=0.001", "logging.log_every=1",
                   "checkpoint.every=1", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    assert f"config changed since {step2}: optim.lr: 0.003 -> 0.001, train.max_steps: 2 -> 3" in out, proc.stdout
    assert "config changed since" in (run / "train.log").read_text()
    step3 = run / "checkpoints" / "step_00000003"
    for resume in ("auto", str(step2)):
        proc = run_cli(*args, f"hydra.run.dir={run}", "train.max_steps=4", "train.seed=7",
                       f"checkpoint.resume={resume}", f"data.cache_dir={tmp_path}/fresh-cache", timeout=300)
        assert proc.returncode == 2, proc.stderr[-3000:]
        err = proc.stderr.strip().splitlines()
        ck = step3 if resume == "auto" else step2
        assert len(err) == 1 and err[0].startswith(
            f"error: train.seed: cannot change when resuming: the checkpoint {ck} was written with train.seed=0, "
            "this run has train.seed=7. "), proc.stderr
        assert f"start a new run directory with checkpoint.init_from={ck} " in err[0]
    assert not (tmp_path / "fresh-cache").exists()   # refused before the corpus was read
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]   # the refused runs wrote nothing
    proc = run_cli(*args, f"hydra.run.dir={tmp_path}/finetune", "train.max_steps=1", "train.seed=7",
                   f"checkpoint.init_from={step3}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"initialised from {step3}" in proc.stdout
