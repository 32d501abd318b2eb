"""Trainer: metrics, resume (bitwise), atomic checkpoints, W&B offline, CLI."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from checkpoint import CheckpointManager

from .trainer_utils import ROOT, fast_overrides, read_jsonl, run_cli, run_inprocess

REQUIRED = {"step", "loss", "mtp_loss", "aux_loss", "lr", "grad_norm", "tokens", "step_time_s", "tokens_per_s"}
SMALL = ["train.global_batch_size=8", "train.micro_batch_size=4", "data.seq_len=64", "train.eval_batches=1",
         "train.eval_every=0"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


def test_resume_is_bitwise_identical(tmp_path, cache):
    common = [*fast_overrides(tmp_path, cache), *SMALL, "train.max_steps=10"]
    run_inprocess(tmp_path / "straight", *common, f"checkpoint.dir={tmp_path}/ck_a")
    straight = [m["loss"] for m in read_jsonl(tmp_path / "straight/metrics.jsonl")]
    run_inprocess(tmp_path / "split", *common, f"checkpoint.dir={tmp_path}/ck_b", "train.stop_at_step=5")
    assert CheckpointManager(tmp_path / "ck_b").latest().name == "step_00000005"
    run_inprocess(tmp_path / "split", *common, f"checkpoint.dir={tmp_path}/ck_b", "checkpoint.resume=auto")
    split = read_jsonl(tmp_path / "split/metrics.jsonl")
    assert [m["step"] for m in split] == list(range(1, 11))
    assert [m["loss"] for m in split] == straight  # bitwise: float equality of every step's loss
    assert len(set(straight)) > 5


def test_metrics_jsonl_has_required_keys_and_schedules_apply(tmp_path, cache):
    run_inprocess(tmp_path / "run", *fast_overrides(tmp_path, cache), *SMALL, "train.max_steps=3",
                  "checkpoint.save_final=false", "train.mtp_loss_weight.then=0.1", "train.mtp_loss_weight.after_steps=2",
                  "train.bias_update_speed.then=0.0", f"train.bias_update_speed.after_tokens={8 * 64}")
    lines = read_jsonl(tmp_path / "run/metrics.jsonl")
    assert [m["step"] for m in lines] == [1, 2, 3]
    for m in lines:
        assert REQUIRED <= m.keys()
        # where the step's time went: each phase before the final reduction, together within the step time
        phases = {k: v for k, v in m.items() if k.startswith("time_")}
        assert {"time_forward_backward_s", "time_gradient_reduction_and_optimizer_step_s",
                "time_expert_load_all_reduce_s"} <= phases.keys()
        assert all(v > 0 for v in phases.values()) and sum(phases.values()) < m["step_time_s"]
        assert phases["time_forward_backward_s"] > 0.5 * m["step_time_s"]
    assert lines[-1]["tokens"] == 3 * 8 * 64
    assert [m["mtp_loss_weight"] for m in lines] == [0.3, 0.3, 0.1]
    assert [m["bias_update_speed"] for m in lines] == [0.001, 0.0, 0.0]
    assert (tmp_path / "run/eval.jsonl").exists()


def test_no_validation_split_means_no_val_loss(tmp_path, cache):
    summary = run_inprocess(tmp_path / "run", *fast_overrides(tmp_path, cache), *SMALL, "train.max_steps=2",
                            "data.val_fraction=0", "checkpoint.save_final=false")
    assert summary["val_loss_start"] is None and summary["val_loss_end"] is None
    assert all("val_loss" not in m for m in read_jsonl(tmp_path / "run/metrics.jsonl"))


def test_gradient_accumulation_matches_one_big_batch(tmp_path, cache):
    """global_batch_size is independent of micro_batch_size (up to float summation order)."""
    common = [*fast_overrides(tmp_path, cache), "train.global_batch_size=8", "data.seq_len=64", "train.max_steps=3",
              "train.eval_batches=1", "train.eval_every=0", "checkpoint.save_final=false"]
    run_inprocess(tmp_path / "m8", *common, "train.micro_batch_size=8")
    run_inprocess(tmp_path / "m2", *common, "train.micro_batch_size=2")
    a = [m["loss"] for m in read_jsonl(tmp_path / "m8/metrics.jsonl")]
    b = [m["loss"] for m in read_jsonl(tmp_path / "m2/metrics.jsonl")]
    assert a == pytest.approx(b, rel=1e-4)


KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys
    import torch.distributed.checkpoint.filesystem as fs
    real = fs.FileSystemWriter.write_data
    def write_then_die(self, plan, planner):
        fut = real(self, plan, planner)
        fut.wait()                                  # tensor files are on disk, metadata not yet
        os.kill(os.getpid(), signal.SIGKILL)
    fs.FileSystemWriter.write_data = write_then_die
    sys.path.insert(0, {root!r})
    from pathlib import Path
    from tests.trainer_utils import run_inprocess
    run_inprocess(Path({run!r}), *{overrides!r})
""")


def test_killed_save_leaves_previous_checkpoint_loadable(tmp_path, cache):
    ck = tmp_path / "ck"
    common = [*fast_overrides(tmp_path, cache), *SMALL, "train.max_steps=6", f"checkpoint.dir={ck}",
              "checkpoint.every=1"]
    run_inprocess(tmp_path / "run", *common, "train.stop_at_step=3")
    script = KILLED_SAVE.format(root=str(ROOT), run=str(tmp_path / "run"), overrides=common)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    partial = list(ck.glob(".tmp-*"))
    assert partial and any(partial[0].iterdir()), "the killed save should have left a partial temp dir"
    mgr = CheckpointManager(ck)
    assert mgr.latest().name == "step_00000003"
    assert (ck / "latest").read_text().strip() == "step_00000003"
    # Resuming picks the complete step-3 checkpoint, cleans the partial dir and trains on.
    run_inprocess(tmp_path / "run", *common)
    lines = read_jsonl(tmp_path / "run/metrics.jsonl")
    # The killed run logged step 4 before dying in its save; the resumed run cuts the log back to its
    # checkpoint (step 3) and redoes step 4: one line per step.
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5, 6]
    assert not list(ck.glob(".tmp-*"))
    assert mgr.latest().name == "step_00000006"


def test_wandb_offline_run_dir_via_cli(tmp_path, cache):
    run = tmp_path / "run"
    proc = run_cli("+exp=tiny", "train.max_steps=2", *SMALL, f"hydra.run.dir={run}", f"data.cache_dir={cache}",
                   "logging.wandb.mode=offline", "logging.progress=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    assert len(read_jsonl(run / "metrics.jsonl")) == 2
    assert "done: step 2/2" in proc.stdout + proc.stderr


@pytest.mark.parametrize("overrides,key", [
    (["model.n_limited_groups=5"], "model.n_limited_groups"),
    (["model.n_limited_groups=2", "model.n_activated_experts=3"], "model.n_activated_experts"),  # K % M != 0
    (["train.global_batch_size=15"], "train.global_batch_size"),
    (["data.seq_len=4096"], "data.seq_len"),
    (["train.precision=fp16"], "train.precision"),
    (["checkpoint.resume=/nonexistent/ckpt"], "checkpoint.resume"),
    (["parallel.ep=4"], "parallel.ep"),                                   # one process cannot hold EP=4
])
def test_invalid_config_fails_with_one_line_naming_the_key(tmp_path, overrides, key):
    proc = run_cli("+exp=tiny", *overrides, f"hydra.run.dir={tmp_path}/run", timeout=120)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {key}"), proc.stderr
    assert not (tmp_path / "run/metrics.jsonl").exists()


def test_bad_data_path_fails_before_training(tmp_path):
    proc = run_cli("+exp=tiny", "data.path=/no/such/corpus.txt", f"hydra.run.dir={tmp_path}/run", timeout=120)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: data.path"), proc.stderr


# BF16 weights update through the optimizer's own path (BF16 moments by default): torch's LR scheduler must not warn
# that it stepped before the optimizer
@pytest.mark.filterwarnings("error:Detected call of:UserWarning")
def test_bf16_training_runs(tmp_path, cache):
    run_inprocess(tmp_path / "run", *fast_overrides(tmp_path, cache), *SMALL, "train.max_steps=2",
                  "train.precision=bf16", "checkpoint.save_final=false")
    lines = read_jsonl(tmp_path / "run/metrics.jsonl")
    assert len(lines) == 2 and all(abs(m["loss"] - 6.93) < 0.3 for m in lines)


def test_expert_bias_moves_with_load(tmp_path, cache):
    from trainer.train import Trainer
    from .trainer_utils import make_config
    trainer = Trainer(make_config(*fast_overrides(tmp_path, cache), *SMALL, "train.max_steps=1",
                                  "checkpoint.resume=none"), tmp_path)
    trainer.logger = None
    trainer.train_step()
    for load, moe in zip(trainer._last_load, trainer.model.moe_layers()):
        expected = 0.001 * (load.mean() - load).sign()
        assert (moe.gate.expert_bias == expected).all()
        assert moe.tokens_per_expert.sum() == 0   # reset for the next step


def test_fp8_training_runs(tmp_path, cache):
    """train.precision=fp8: FP8 linears and experts (emulation backend on CPU) under bf16 autocast."""
    from trainer.train import Trainer
    from .trainer_utils import make_config
    trainer = Trainer(make_config(*fast_overrides(tmp_path, cache), *SMALL, "train.max_steps=2",
                                  "train.precision=fp8", "checkpoint.save_final=false"), tmp_path)
    from parallel.fp8 import FP8Linear
    assert isinstance(trainer.model.layers[0].attn.wo, FP8Linear)
    assert not isinstance(trainer.model.head, FP8Linear)
    assert trainer.model.layers[0].attn.wo.weight.dtype == torch.bfloat16   # BF16 weights, quantised per GEMM
    assert trainer.opt.master_weights()["layers.0.attn.wo.weight"].dtype == torch.float32
    summary = trainer.train()
    assert abs(summary["last"]["loss"] - 6.93) < 0.3


@pytest.mark.parametrize("overrides,key", [
    (["parallel.ep=4", "model.n_routed_experts=12", "model.n_expert_groups=3"],
     "model.n_expert_groups"),                                              # 4 EP nodes, 3 groups: neither divides
    (["parallel.ep=4", "parallel.ranks_per_node=2", "model.n_limited_groups=3", "model.n_activated_experts=3"],
     "model.n_limited_groups"),                                             # M > groups
    (["parallel.ep=3"], "parallel.ep"),                                    # ep does not divide dp
    (["parallel.ep=4", "parallel.ranks_per_node=2", "model.n_routed_experts=6", "model.n_activated_experts=2"],
     "model.n_routed_experts"),                                             # experts not divisible by ep
])
def test_invalid_layout_fails_before_any_collective(tmp_path, overrides, key):
    """As torchrun would start it (WORLD_SIZE=4), but one process: a collective would hang, an early
    one-line error does not."""
    proc = run_cli("+exp=tiny", *overrides, f"hydra.run.dir={tmp_path}/run", timeout=120,
                   env={"WORLD_SIZE": "4", "RANK": "0"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and key in err[0], proc.stderr


def test_rendezvous_port_in_use_is_one_line_naming_the_address(tmp_path):
    """Rank 0 of an srun-style launch hosts the rendezvous store on MASTER_PORT; a port another job holds is
    one line naming the address and MASTER_PORT, exit 2 (torch's own error is a 20-line traceback)."""
    import socket
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = run_cli("+exp=tiny", "parallel.ep=2", "parallel.ranks_per_node=1", f"hydra.run.dir={tmp_path}/run",
                       "logging.wandb.mode=disabled", timeout=120,
                       env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(port)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and f"127.0.0.1:{port}" in err[0] and "MASTER_PORT" in err[0], proc.stderr


def test_step_timers_sum_each_phase_and_forget_what_ran_outside_a_step():
    from trainer.timers import StepTimers, metric_key
    timers = StepTimers(torch.device("cpu"))
    with timers("checkpoint save"):
        pass
    timers.reset()   # as train_step does first
    for _ in range(2):
        with timers("forward/backward"):
            time.sleep(0.01)
    with timers("gradient reduction and optimizer step"):
        with timers("non-finite / stop check (world all-reduce)"):   # nested: counted in the outer phase
            time.sleep(0.01)
    out = timers.read()
    assert set(out) == {"time_forward_backward_s", "time_gradient_reduction_and_optimizer_step_s"}
    assert out["time_forward_backward_s"] >= 0.02 and out["time_gradient_reduction_and_optimizer_step_s"] >= 0.01
    assert timers.read() == {}   # read resets
    assert metric_key("non-finite / stop check (world all-reduce)") == "time_non_finite_stop_check_world_all_reduce_s"


def test_step_timers_on_cuda_read_events_after_the_sync(monkeypatch):
    """The CUDA branch without a GPU: each phase records a start and an end event on entry and exit, and
    ``read`` converts their elapsed milliseconds to seconds (``torch.cuda.Event`` replaced by a stand-in)."""
    from trainer.timers import StepTimers
    clock = {"ms": 0.0}

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = clock["ms"]

        def elapsed_time(self, end):
            assert self.at is not None and end.at is not None, "read before the phase's events were recorded"
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timers = StepTimers(torch.device("cuda"))
    with timers("forward/backward"):
        clock["ms"] += 250.0
        with timers("gradient reduction"):   # nested: no events of its own
            clock["ms"] += 5.0
    with timers("expert-load all-reduce"):
        clock["ms"] += 2.0
    assert timers.read() == pytest.approx({"time_forward_backward_s": 0.255, "time_expert_load_all_reduce_s": 0.002})
