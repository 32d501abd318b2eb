"""W&B dashboards offline: every panel group is logged and read back from the run's .wandb file; the
expert-load heatmap images exist; MFU, memory per rank, the pipeline bubbles and the final summary line.
``close()`` returns only once the run's .wandb file is written out (also with W&B's service held up), and
the reader stops at a log's torn end."""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from configs.schema import register, to_object
from trainer.metrics import MetricsLogger, simulated_bubble
from trainer.wandb_log import offline_run_finished, read_offline_run
from trainer.wandb_panels import panel_name

from .trainer_utils import ROOT, read_jsonl

SMALL = ["train.global_batch_size=8", "train.micro_batch_size=2", "data.seq_len=64", "train.eval_batches=1",
         "train.eval_every=0", "checkpoint.save_final=false", "logging.progress=false"]


def offline_run(run_dir: Path) -> Path:
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    return runs[0]


def groups(history: list[dict]) -> set[str]:
    return {k.split("/")[0] for row in history for k in row if "/" in k}


def test_offline_run_has_every_panel_group(tmp_path):
    """torchrun, 4 ranks: pp=2 (1F1B) x EP=2 over two 'nodes' (tokens cross nodes), W&B offline, a stated peak."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "-m", "trainer",
           "+exp=tiny", "parallel.pp=2", "parallel.schedule=1f1b", "parallel.ep=2", "parallel.ranks_per_node=1",
           "train.max_steps=4", *SMALL,
           "logging.wandb.mode=offline", f"hydra.run.dir={run}", f"data.cache_dir={tmp_path}/cache"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "DSV3_PEAK_TFLOPS": "0.2"}
    env.pop("WANDB_API_KEY", None)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]

    history, summary = read_offline_run(offline_run(run))
    steps = [row for row in history if "train/loss" in row]
    assert [row["_step"] for row in steps] == [1, 2, 3, 4]
    assert {"train", "throughput", "experts", "comm", "pipeline", "memory", "val"} <= groups(history)
    last = steps[-1]
    for key in ("train/loss", "train/lr", "train/grad_norm", "throughput/tokens_per_s", "throughput/step_time_s",
                "throughput/tflops_per_rank", "throughput/mfu", "experts/max_over_mean",
                "experts/moe0_max_over_mean", "comm/cross_node_tokens", "comm/cross_node_per_token",
                "comm/max_nodes_per_token", "pipeline/bubble_measured", "pipeline/bubble_simulated",
                "memory/peak_gb", "memory/rank0_peak_gb", "memory/rank3_peak_gb"):
        assert key in last, key
    assert last["throughput/mfu"] == pytest.approx(last["throughput/tflops_per_rank"] / 0.2)
    assert last["comm/cross_node_tokens"] > 0 and last["memory/rank3_peak_gb"] > 0.05
    assert 0 <= last["pipeline/bubble_measured"] < 1 and 0 <= last["pipeline/bubble_simulated"] < 1
    # The schedule-only reference (unit costs) is logged once and kept in the summary.
    want = simulated_bubble("1f1b", 2, 8 // (2 * 2))           # global 8 / (micro 2 x dp 2) = 2 micro-batches
    assert steps[0]["pipeline/bubble_unit_costs"] == pytest.approx(want)
    assert summary["pipeline/bubble_unit_costs"] == pytest.approx(want)
    assert last["experts/moe0_load"]["_type"] == "histogram"
    # Heatmaps: one image per step here (4 steps < 20), files on disk.
    images = [row["experts/load_heatmap"] for row in steps if "experts/load_heatmap" in row]
    assert len(images) == 4 and all(img["_type"] == "image-file" for img in images)
    assert all((offline_run(run) / "files" / img["path"]).is_file() for img in images)
    assert summary["throughput/flops_per_token"] > 0
    # metrics.jsonl carries the same numbers; the final line summarises the run.
    lines = read_jsonl(run / "metrics.jsonl")
    assert len(lines[-1]["mem_peak_gb_per_rank"]) == 4 and "mfu" in lines[-1]
    done = next(line for line in proc.stdout.splitlines() if line.startswith("done: "))
    assert "TFLOP/s/rank (MFU" in done and "peak mem" in done and "val_loss" in done


def test_logger_unit_bubble_no_peak_and_online_fallback(tmp_path, monkeypatch):
    """MetricsLogger alone: the unit-cost bubble for pp > 1 (once), no MFU without a peak, and online mode
    without an API key logging offline instead."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.delenv("DSV3_PEAK_TFLOPS", raising=False)
    register()
    with initialize_config_module("configs", version_base=None):   # composed only: MetricsLogger needs the values
        cfg = to_object(compose("config", overrides=["+exp=tiny", "parallel.pp=2", "parallel.schedule=1f1b",
                                                     "train.global_batch_size=8", "train.micro_batch_size=2"]))
    wandb_cfg = SimpleNamespace(mode="online", project="t", entity=None, name=None, tags=[])
    logger = MetricsLogger(tmp_path, wandb_cfg, OmegaConf.to_container(OmegaConf.structured(cfg)), total_steps=2,
                           start_step=0, progress=False, device=torch.device("cpu"), world_size=2)
    loads = [torch.tensor([5.0, 1, 1, 1, 0, 0, 0, 0]), torch.tensor([1.0] * 8)]
    for step in (1, 2):
        logger.log_step({"step": step, "loss": 3.0, "tokens_per_s": 1000.0, "step_time_s": 0.5}, loads)
    assert "MFU n/a" in logger.summary()
    logger.close()
    assert offline_run_finished(offline_run(tmp_path))              # written out when close() returns
    history, summary = read_offline_run(offline_run(tmp_path))     # fell back to offline
    want = simulated_bubble("1f1b", 2, 8 // (2 * 1))               # dp = 2 ranks / pp 2 = 1: 4 micro-batches
    assert history[0]["pipeline/bubble_unit_costs"] == pytest.approx(want) and 0 < want < 1
    assert sum("pipeline/bubble_unit_costs" in row for row in history) == 1
    assert summary["pipeline/bubble_unit_costs"] == pytest.approx(want)
    assert "throughput/mfu" not in history[-1] and "throughput/tflops_per_rank" in history[-1]
    assert history[-1]["experts/moe0_max_over_mean"] == pytest.approx(5.0)      # 5 / mean 1
    assert "experts/load_heatmap" in history[-1]


def test_panel_names():
    assert panel_name("loss") == "train/loss" and panel_name("tokens_per_s") == "throughput/tokens_per_s"
    assert panel_name("ep_cross_node_tokens") == "comm/cross_node_tokens"
    assert panel_name("mem_peak_gb") == "memory/peak_gb"
    assert panel_name("max_expert_load_over_mean") == "experts/max_over_mean"
    assert panel_name("pipeline_bubble_measured") == "pipeline/bubble_measured"
    assert panel_name("time_forward_backward_s") == "time/forward_backward_s"
    assert panel_name("val_loss") == "val/loss"


def tiny_config(*overrides: str) -> dict:
    register()
    with initialize_config_module("configs", version_base=None):
        cfg = to_object(compose("config", overrides=["+exp=tiny", *overrides]))
    return OmegaConf.to_container(OmegaConf.structured(cfg))


def offline_cfg() -> SimpleNamespace:
    return SimpleNamespace(mode="offline", project="t", entity=None, name=None, tags=[])


def test_close_waits_for_the_service_to_write_the_offline_log(tmp_path, monkeypatch):
    """The CI flake: ``wandb.finish()`` returns before W&B's service has written the run's .wandb file. The
    service buffers the log in 32 KiB blocks and writes the rest when it closes the run's stream, on the
    ``inform_finish`` message that ``finish()`` sends last without waiting for an answer; on a busy machine
    the file held only its 7-byte header when the test read it. Here that message reaches the service late,
    as under load: ``close()`` must still return only with the log complete."""
    from wandb.sdk.lib.service.service_connection import ServiceConnection

    delay_s = 1.5
    inform_finish = ServiceConnection.inform_finish
    monkeypatch.setattr(ServiceConnection, "inform_finish",
                        lambda self, run_id: threading.Timer(delay_s, inform_finish, (self, run_id)).start())
    logger = MetricsLogger(tmp_path, offline_cfg(), tiny_config(), total_steps=3, start_step=0, progress=False,
                           device=torch.device("cpu"))
    for step in (1, 2, 3):
        logger.log_step({"step": step, "loss": 3.0 - step / 10, "tokens_per_s": 1000.0, "step_time_s": 0.5})
    t0 = time.monotonic()
    logger.close()
    waited = time.monotonic() - t0
    assert offline_run_finished(offline_run(tmp_path)), "close() returned before the .wandb file was written out"
    assert waited >= delay_s * 0.9
    history, summary = read_offline_run(offline_run(tmp_path))
    assert [row["_step"] for row in history] == [1, 2, 3]
    assert summary["train/loss"] == pytest.approx(2.7)


def test_reader_stops_at_a_torn_end(tmp_path):
    """A log cut anywhere (a run killed mid-write, a copy of a log being written) reads up to its last whole
    record, never a garbled one, and is not 'finished'."""
    (tmp_path / "a").mkdir()
    logger = MetricsLogger(tmp_path / "a", offline_cfg(), tiny_config(), total_steps=4, start_step=0,
                           progress=False, device=torch.device("cpu"))
    for step in (1, 2, 3, 4):
        logger.log_step({"step": step, "loss": float(step)})
    logger.close()
    src = next(offline_run(tmp_path / "a").glob("run-*.wandb"))
    full, _ = read_offline_run(src.parent)
    data = src.read_bytes()
    cut = tmp_path / "cut"
    for n in range(7, len(data), max(1, len(data) // 97)):
        cut.mkdir(exist_ok=True)
        (cut / src.name).write_bytes(data[:n])
        history, _ = read_offline_run(cut)
        assert history == full[:len(history)], n
        assert not offline_run_finished(cut), n


def _tiny_logger(run_dir: Path, mode: str, **kw) -> MetricsLogger:
    register()
    with initialize_config_module("configs", version_base=None):
        cfg = to_object(compose("config", overrides=["+exp=tiny"]))
    wandb_cfg = SimpleNamespace(mode=mode, project="t", entity=None, name=None, tags=[])
    run_dir.mkdir(exist_ok=True)
    return MetricsLogger(run_dir, wandb_cfg, OmegaConf.to_container(OmegaConf.structured(cfg)), total_steps=4,
                         start_step=0, progress=False, device=torch.device("cpu"), **kw)


def test_console_says_where_the_wandb_run_is_and_honours_wandb_mode(tmp_path, monkeypatch):
    """One line names the offline run's directory and the commands that read it without a browser (``wandb leet``:
    W&B's terminal viewer) or upload it; ``WANDB_MODE`` in the environment wins over logging.wandb.mode, said once."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    logger = _tiny_logger(tmp_path / "a", "offline")
    logger.close()
    where = offline_run(tmp_path / "a")
    lines = (tmp_path / "a" / "train.log").read_text().splitlines()
    assert f"W&B: offline run {where}; view it in a terminal with `wandb leet {where}`, upload it with `wandb sync " \
           f"{where}`" in lines, lines
    monkeypatch.setenv("WANDB_MODE", "disabled")
    logger = _tiny_logger(tmp_path / "b", "offline")
    logger.close()
    assert not (tmp_path / "b" / "wandb").exists()
    assert (tmp_path / "b" / "train.log").read_text().splitlines() == [
        "W&B: WANDB_MODE=disabled in the environment wins over logging.wandb.mode=offline"]
    from configs.checks import check_sections

    from .trainer_utils import make_config
    monkeypatch.setenv("WANDB_MODE", "bogus")
    from errors import ConfigError
    with pytest.raises(ConfigError, match=r"^WANDB_MODE \(environment\): 'bogus' is not one of offline, online, "):
        check_sections(make_config())


def test_console_shows_validation_and_the_blend_shares(tmp_path, monkeypatch):
    """A SLURM .out file alone: each validation (per source with data.val_blend) when computed, and each blend
    source's share of the tokens in the plain step line."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    logger = _tiny_logger(tmp_path, "disabled", log_every=2)
    logger.log_eval(0, 6.95, {"val_loss/web": 6.9, "val_loss/math": 7.0})
    for step in (1, 2):
        logger.log_step({"step": step, "loss": 3.0, "tokens_per_s": 1e3, "step_time_s": 0.5, "tokens/web": 300 * step,
                         "tokens/code": 100 * step, "tokens/math": 100 * step})
    logger.close()
    lines = (tmp_path / "train.log").read_text().splitlines()
    assert lines[0] == "validation at step 0/4: val_loss 6.9500 (web 6.9000, math 7.0000)", lines
    assert lines[1].startswith("step 2/4 | ") and lines[1].endswith(" | data web 60% code 20% math 20%"), lines
