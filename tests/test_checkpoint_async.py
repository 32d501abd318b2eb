"""checkpoint.async_save: periodic saves staged to CPU memory and written on a background thread. The
checkpoints are bit for bit those of synchronous saves and resume to the same losses (one and two ranks); a
stop signal while a save is in flight completes it, saves the stop's step and stops; a failed background
write ends the run with the one line and exit 2 of a failed synchronous save, leaving nothing that resume
would pick."""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import checkpoint.manager as ckpt_mod
from checkpoint import CheckpointManager, CheckpointWriteError
from trainer.lifecycle import EXIT_CONFIG

from .dist_utils import spawn
from .trainer_utils import ROOT, assert_losses_match, fast_overrides, make_config, read_jsonl, run_inprocess, \
    run_torchrun

SMALL = ["train.global_batch_size=8", "train.micro_batch_size=4", "data.seq_len=64", "train.eval_batches=1",
         "train.eval_every=0"]
ASYNC = "checkpoint.async_save=true"


def sd(step: int) -> str:
    return f"step_{step:08d}"


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # 2 shared cores: oversubscribed intra-op threads stall badly
    yield
    torch.set_num_threads(threads)


def flat_state(step_dir: Path, out: Path) -> dict:
    """A checkpoint's tensors and values, read back in one process whatever the layout that wrote it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(str(step_dir), str(out))
    return torch.load(out, weights_only=False)


def assert_identical(a, b, where: str = "") -> int:
    """``a`` and ``b`` hold the same keys, and tensors equal bit for bit (dtype, shape, bytes); returns how many
    tensors were compared."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        raw = lambda t: t.contiguous().reshape(-1).view(torch.uint8)   # noqa: E731  (bits: NaNs and -0.0 too)
        assert torch.equal(raw(a), raw(b)), where
        return 1
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), (where, sorted(a), sorted(b))
        return sum(assert_identical(a[k], b[k], f"{where}.{k}") for k in a)
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        return sum(assert_identical(x, y, f"{where}.{i}") for i, (x, y) in enumerate(zip(a, b)))
    if isinstance(a, np.ndarray):
        assert np.array_equal(a, b), where
        return 0
    assert a == b, (where, a, b)
    return 0


def assert_same_checkpoints(sync: Path, background: Path, steps, tmp: Path, separate_processes: bool = False) -> None:
    """Every tensor and value equal bit for bit. ``separate_processes``: the two runs ran in processes of their own,
    so the states of Python's ``random`` and NumPy's global generator differ (the trainer saves them but never seeds
    them: it draws nothing from them): those two are left out, and the shards holding them cannot be compared
    byte for byte."""
    for s in steps:
        a, b = (flat_state(d / sd(s), tmp / f"{d.name}{s}.pt") for d in (sync, background))
        if separate_processes:
            for unseeded in ("python", "numpy"):
                assert a["extra"]["rng"].pop(unseeded)[0] == b["extra"]["rng"].pop(unseeded)[0]
        n = assert_identical(a, b)
        assert n > 20, n   # the model, optimizer moments, RNG states: not an empty comparison
        if not separate_processes:
            shards = lambda d: {k: v for k, v in json.loads((d / sd(s) / "manifest.json").read_text())["files"].items()
                                if k.endswith(".distcp")}   # noqa: E731
            assert shards(sync) == shards(background)   # the very same bytes on disk (size and sha256)
    assert CheckpointManager(background).verify(background / sd(steps[-1])).ok


def losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_jsonl(run / "metrics.jsonl")}


# ---- the same checkpoints as synchronous saves ---------------------------------------------------------
def test_async_saves_equal_sync_saves_bit_for_bit_and_resume_to_the_same_losses(tmp_path):
    common = [*fast_overrides(tmp_path, tmp_path / "cache"), *SMALL, "train.max_steps=6", "checkpoint.every=2",
              "checkpoint.keep=0"]
    run_inprocess(tmp_path / "sync", *common, f"checkpoint.dir={tmp_path / 'ck_sync'}")
    run_inprocess(tmp_path / "bg", *common, f"checkpoint.dir={tmp_path / 'ck_bg'}", ASYNC)
    log = (tmp_path / "bg" / "train.log").read_text()
    assert all(f"checkpoint staged: {tmp_path / 'ck_bg' / sd(s)}" in log for s in (2, 4, 6)), log
    assert f"checkpoint saved: {tmp_path / 'ck_bg' / sd(6)} (step 6, " in log, log   # waited for at the end
    want = losses(tmp_path / "sync")
    assert losses(tmp_path / "bg") == want   # training itself is unchanged
    assert_same_checkpoints(tmp_path / "ck_sync", tmp_path / "ck_bg", (2, 4, 6), tmp_path)
    # resume from the background save of step 2: the uninterrupted run's losses, exactly
    ck = tmp_path / "ck_resume"
    ck.mkdir()
    shutil.copytree(tmp_path / "ck_bg" / sd(2), ck / sd(2))
    (ck / "latest").write_text(sd(2) + "\n")
    run_inprocess(tmp_path / "resumed", *common, f"checkpoint.dir={ck}", ASYNC)
    got = losses(tmp_path / "resumed")
    assert sorted(got) == [3, 4, 5, 6] and all(got[s] == want[s] for s in got), (got, want)


def test_staged_copy_is_what_is_written_while_the_state_changes(tmp_path, monkeypatch):
    """The caller may change its tensors as soon as ``save_async`` returns: the write holds until they changed."""
    changed = threading.Event()
    write_data = ckpt_mod._Writer.write_data

    def held(self, plan, planner):
        assert changed.wait(60)
        return write_data(self, plan, planner)
    monkeypatch.setattr(ckpt_mod._Writer, "write_data", held)
    m = CheckpointManager(tmp_path / "ck", background=True)
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"w": w, "extra": {"step": 7, "rng": torch.get_rng_state()}}
    want = {"w": w.clone(), "extra": {"step": 7, "rng": state["extra"]["rng"].clone()}}
    path = m.save_async(7, state)
    assert path == tmp_path / "ck" / sd(7) and not path.exists() and m.in_flight()
    w.add_(1)
    state["extra"]["step"] = 8
    changed.set()
    assert m.wait()[:2] == (7, path)
    assert (tmp_path / "ck" / "latest").read_text().strip() == sd(7) and m.verify(path).ok
    assert_identical(flat_state(path, tmp_path / "flat.pt"), want)
    m.close()


@pytest.mark.slow
def test_two_ranks_async_saves_equal_sync_saves_and_resume(tmp_path):
    """EP=2 under torchrun (DSV3_NCCL_STRICT=1 from conftest): the background write's collectives run on a gloo
    group of their own while the training step's run on the others."""
    common = ["parallel.ep=2", "checkpoint.every=2", "checkpoint.keep=0", "parallel.timeout_s=120", *SMALL]
    sync = run_torchrun(tmp_path, "sync", 2, *common, f"checkpoint.dir={tmp_path / 'ck_sync'}", steps=4)
    bg = run_torchrun(tmp_path, "bg", 2, *common, f"checkpoint.dir={tmp_path / 'ck_bg'}", ASYNC, steps=4)
    assert_losses_match(bg, sync, rel=0)
    assert_same_checkpoints(tmp_path / "ck_sync", tmp_path / "ck_bg", (2, 4), tmp_path, separate_processes=True)
    ck = tmp_path / "ck_resume"
    ck.mkdir()
    shutil.copytree(tmp_path / "ck_bg" / sd(2), ck / sd(2))
    rest = run_torchrun(tmp_path, "resumed", 2, *common, f"checkpoint.dir={ck}", ASYNC, steps=4)
    assert_losses_match(rest, sync[2:], rel=0)


# ---- a stop while a save is in flight -----------------------------------------------------------------
def _hold_step_2_until_the_stop(trainer, monkeypatch, signal_it: bool) -> list:
    """``signal_it``: this rank sends itself SIGTERM as soon as step 2 is staged, so every rank agrees to stop in
    step 3's check; the background write of step 2 holds (after its first collectives) until then, so the stop is
    acted on while that save is in flight. Returns (step written, whether the stop was agreed) in write order."""
    save_async, write_data = CheckpointManager.save_async, ckpt_mod._Writer.write_data
    order = []

    def staged(self, step, *args, **kwargs):
        path = save_async(self, step, *args, **kwargs)
        if step == 2 and signal_it:
            os.kill(os.getpid(), signal.SIGTERM)   # noted by the trainer's handler, acted on after step 3
        return path

    def held(self, plan, planner):
        step = int(str(self.path)[-8:])
        t0 = time.monotonic()
        while step == 2 and not trainer.stop_requested:
            assert time.monotonic() - t0 < 120, "the stop was never agreed"
            time.sleep(0.01)
        order.append((step, trainer.stop_requested))
        return write_data(self, plan, planner)
    monkeypatch.setattr(CheckpointManager, "save_async", staged)
    monkeypatch.setattr(ckpt_mod._Writer, "write_data", held)
    return order


def test_stop_during_a_background_save_completes_it_then_saves_and_stops(tmp_path, monkeypatch):
    from trainer.train import Trainer
    cfg = make_config(*fast_overrides(tmp_path, tmp_path / "cache"), *SMALL, "train.max_steps=8",
                      "checkpoint.every=2", ASYNC)
    trainer = Trainer(cfg, tmp_path / "run")
    order = _hold_step_2_until_the_stop(trainer, monkeypatch, signal_it=True)
    summary = trainer.train()
    assert summary["stopped"] == "SIGTERM" and trainer.step == 3
    assert order == [(2, True), (3, True)]   # step 2 written once the stop was agreed, then the stop's step 3
    ck = tmp_path / "run" / "checkpoints"
    assert [p.name for p in CheckpointManager(ck).complete()] == [sd(2), sd(3)]
    assert all(CheckpointManager(ck).verify(ck / sd(s)).ok for s in (2, 3))
    assert (ck / "latest").read_text().strip() == sd(3) and not list(ck.glob(".tmp-*"))
    log = (tmp_path / "run" / "train.log").read_text()
    lines = [line for line in log.splitlines() if line.startswith(("checkpoint", "stopping"))]
    assert [line.split(":")[0] for line in lines] == ["checkpoint staged", "checkpoint saved", "checkpoint saved",
                                                      "stopping at step 3 on request (SIGTERM)"], lines
    assert "(step 2, " in lines[1] and "in the background" in lines[1] and "(step 3, " in lines[2], lines


def _stop_worker(rank, world, tmp):
    from parallel.dims import ParallelDims
    from trainer.train import Trainer
    mp = pytest.MonkeyPatch()
    cfg = make_config(*fast_overrides(Path(tmp), Path(tmp) / "cache"), *SMALL, "train.max_steps=8",
                      "checkpoint.every=2", "parallel.ep=2", "parallel.timeout_s=120", ASYNC, world_size=world)
    dims = ParallelDims(world_size=world, rank=rank, ep=2, timeout_s=120).build_groups()
    trainer = Trainer(cfg, Path(tmp) / "run", dims, torch.device("cpu"))
    order = _hold_step_2_until_the_stop(trainer, mp, signal_it=rank == 1)   # one rank gets the signal
    summary = trainer.train()
    assert summary["stopped"] == ("SIGTERM" if rank == 1 else "peer") and trainer.step == 3, (rank, summary)
    assert order == [(2, True), (3, True)], (rank, order)
    mp.undo()


def test_two_ranks_stop_during_a_background_save(tmp_path):
    from data import load_corpus
    cfg = make_config(f"data.cache_dir={tmp_path}/cache")
    load_corpus(cfg.data, cfg.model.vocab_size)   # tokenize once, before the ranks start
    spawn(_stop_worker, 2, tmp_path, str(tmp_path))
    ck = tmp_path / "run" / "checkpoints"
    assert [p.name for p in CheckpointManager(ck).complete()] == [sd(2), sd(3)]
    assert all(CheckpointManager(ck).verify(ck / sd(s)).ok for s in (2, 3))
    assert (ck / "latest").read_text().strip() == sd(3)


# ---- a failed background write --------------------------------------------------------------------------
FAIL_STEP_4 = """
import errno, runpy, sys
import torch.distributed.checkpoint.filesystem as fs
real = fs.FileSystem.create_stream
def create_stream(self, path, mode):
    if "step_00000004" in str(path) and str(path).endswith(".distcp") and "w" in mode:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    return real(self, path, mode)
fs.FileSystem.create_stream = create_stream
sys.argv = ["trainer", *sys.argv[1:]]
runpy.run_module("trainer", run_name="__main__", alter_sys=True)
"""


def test_failed_background_write_is_one_line_exit_2_and_resume_takes_the_previous(tmp_path):
    ck, run = tmp_path / "ck", tmp_path / "run"
    common = [*fast_overrides(tmp_path, tmp_path / "cache"), *SMALL, "train.max_steps=8", "checkpoint.every=2",
              f"checkpoint.dir={ck}", ASYNC]
    args = ["+exp=tiny", *common, f"hydra.run.dir={run}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    proc = subprocess.run([sys.executable, "-c", FAIL_STEP_4, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == EXIT_CONFIG, proc.stderr[-3000:]
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr and len(err) == 1, proc.stderr[-3000:]
    want = (f"error: checkpoint.dir: saving step 4 to {ck / sd(4)} failed: rank 0: {ck / ('.tmp-' + sd(4))}/__0_0"
            f".distcp: errno 28 (ENOSPC: No space left on device). The partial save was removed; earlier "
            f"checkpoints are untouched (newest: {ck / sd(2)}) and none was pruned.")
    assert err[0].startswith(want), err[0]
    assert max(losses(run)) < 8   # found while training went on, and the run ended there
    assert sorted(p.name for p in ck.iterdir() if not p.name.startswith(".owner")) == ["latest", sd(2)]
    assert (ck / "latest").read_text().strip() == sd(2)
    assert CheckpointManager(ck).resolve("auto") == ck / sd(2)
    # resumed without the fault: from step 2, to the end
    run_inprocess(tmp_path / "run2", *common)
    assert min(losses(tmp_path / "run2")) == 3 and CheckpointManager(ck).verify(ck / sd(8)).ok


def _fail_worker(rank, world, tmp):
    """Rank 1's shard write fails: every rank ends with the same one-line error at the same step."""
    import torch.distributed.checkpoint.filesystem as fs
    from parallel.dims import ParallelDims
    from trainer.train import Trainer
    real = fs.FileSystem.create_stream

    def create_stream(self, path, mode):
        if rank == 1 and sd(4) in str(path) and str(path).endswith(".distcp") and "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(self, path, mode)
    fs.FileSystem.create_stream = create_stream
    cfg = make_config(*fast_overrides(Path(tmp), Path(tmp) / "cache"), *SMALL, "train.max_steps=8",
                      "checkpoint.every=2", "parallel.ep=2", "parallel.timeout_s=120", ASYNC, world_size=world)
    dims = ParallelDims(world_size=world, rank=rank, ep=2, timeout_s=120).build_groups()
    trainer = Trainer(cfg, Path(tmp) / "run", dims, torch.device("cpu"))
    with pytest.raises(CheckpointWriteError) as e:
        trainer.train()
    msg = str(e.value)
    assert msg.startswith(f"checkpoint.dir: saving step 4 to {Path(tmp) / 'run' / 'checkpoints' / sd(4)} failed: "
                          f"rank 1: ") and "errno 28 (ENOSPC" in msg and "\n" not in msg, msg
    Path(tmp, f"failed_at_rank{rank}").write_text(str(trainer.step))


def test_two_ranks_failed_background_write_ends_both_at_the_same_step(tmp_path):
    from data import load_corpus
    cfg = make_config(f"data.cache_dir={tmp_path}/cache")
    load_corpus(cfg.data, cfg.model.vocab_size)
    spawn(_fail_worker, 2, tmp_path, str(tmp_path))
    steps = {(tmp_path / f"failed_at_rank{r}").read_text() for r in range(2)}
    assert len(steps) == 1 and 4 < int(steps.pop()) < 8, steps
    ck = tmp_path / "run" / "checkpoints"
    assert [p.name for p in CheckpointManager(ck).step_dirs()] == [sd(2)] and not list(ck.glob(".tmp-*"))
    assert (ck / "latest").read_text().strip() == sd(2)
