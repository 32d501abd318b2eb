"""Fault injection at run time (CPU, gloo, tiny model): non-finite steps, stop signals, hung and dead peers.

Ranks are started the two ways a cluster starts them: one process per rank with RANK / WORLD_SIZE /
MASTER_ADDR in the environment (as ``srun`` does), and under ``torchrun``. Exit codes are
``trainer/lifecycle.py``'s: 3 failed, 75 stopped on request with a checkpoint.
"""
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainer.lifecycle import EXIT_FAILED, EXIT_STOPPED

from .dist_utils import spawn
from .trainer_utils import ROOT, make_config, read_jsonl

TIMEOUT_S = 8   # parallel.timeout_s of the hang tests: every waiting rank must give up about this long after


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmd(run_dir: Path, cache: Path, steps: int, *overrides: str) -> list[str]:
    return ["-m", "trainer", "+exp=tiny", f"train.max_steps={steps}", "logging.wandb.mode=disabled",
            "logging.progress=false", f"hydra.run.dir={run_dir}", f"data.cache_dir={cache}", "train.eval_every=0",
            *overrides]


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", **extra}


def launch_ranks(run_dir: Path, cache: Path, world: int, steps: int, *overrides: str,
                 only: list[int] | None = None) -> list[subprocess.Popen]:
    """One process per rank, rendezvous through the environment (how ``srun`` starts a job); ``only``: start
    just these ranks (the others never arrive)."""
    port = _free_port()
    return [subprocess.Popen([sys.executable, *_cmd(run_dir, cache, steps, *overrides)], cwd=ROOT,
                             env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                                      RANK=str(r), LOCAL_RANK=str(r)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in (range(world) if only is None else only)]


def launch_torchrun(run_dir: Path, cache: Path, world: int, steps: int, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                             *_cmd(run_dir, cache, steps, *overrides)], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_steps(run_dir: Path, n: int, procs, limit_s: float = 240) -> None:
    """Until metrics.jsonl has ``n`` lines (the ranks are past start-up and training)."""
    path, t0 = run_dir / "metrics.jsonl", time.monotonic()
    while not (path.is_file() and len(path.read_text().splitlines()) >= n):
        assert time.monotonic() - t0 < limit_s, "the run did not reach its first steps"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.1)


def workers_of(torchrun: subprocess.Popen) -> list[int]:
    """PIDs of torchrun's worker processes (its children running the trainer)."""
    out = subprocess.run(["pgrep", "-P", str(torchrun.pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per-step losses of an uninterrupted 2-rank EP run (12 steps): what a stopped-and-resumed run must give."""
    tmp = tmp_path_factory.mktemp("reference")
    procs = launch_ranks(tmp / "run", tmp / "cache", 2, 12, "parallel.ep=2")
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    return losses(tmp / "run")


# ---- non-finite losses and gradients -------------------------------------------------------------------
def _poison(trainer, steps: set[int], rank: int | None = None):
    """Make the loss (hence every gradient) NaN on the given steps (1-based), on one rank or all."""
    compute_loss = trainer.model.compute_loss

    def poisoned(*args, **kwargs):
        out = compute_loss(*args, **kwargs)
        if trainer.step + 1 in steps and (rank is None or trainer.dims.rank == rank):
            out.loss = out.loss * float("nan")         # the objective: every gradient becomes NaN
            out.lm_loss = out.lm_loss * float("nan")   # and the logged loss
        return out
    trainer.model.compute_loss = poisoned


def test_nan_step_is_skipped_and_training_goes_on(tmp_path):
    from trainer.train import Trainer
    cfg = make_config("logging.wandb.mode=disabled", "logging.progress=false", "train.max_steps=6",
                      "train.eval_every=0", f"data.cache_dir={tmp_path}/cache", "checkpoint.every=2")
    trainer = Trainer(cfg, tmp_path / "run")
    _poison(trainer, {3})
    summary = trainer.train()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in rows] == [1, 2, 3, 4, 5, 6]
    assert [bool(m.get("skipped")) for m in rows] == [False, False, True, False, False, False]
    assert rows[2]["nonfinite_ranks"] == [0] and rows[2]["loss"] is None   # strict JSON: NaN -> null
    assert all(math.isfinite(m["loss"]) for i, m in enumerate(rows) if i != 2)
    assert trainer.scheduler.last_epoch == 5          # the skipped step did not advance the LR schedule
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert summary["last"]["step"] == 6 and trainer.skipped_in_a_row == 0


def test_persistent_nan_stops_the_run_with_one_line(tmp_path):
    """``optim.lr=1e6`` diverges: after train.max_skipped_steps skipped steps in a row the run exits 3 with one
    line, and every checkpoint it wrote holds finite weights."""
    from checkpoint import CheckpointManager
    proc = subprocess.run([sys.executable, *_cmd(tmp_path / "run", tmp_path / "cache", 40, "optim.lr=1e6",
                                                 "optim.warmup_steps=0", "train.max_skipped_steps=2",
                                                 "checkpoint.every=2", "checkpoint.keep=0")],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == EXIT_FAILED, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: step ") and "2 steps in a row had a non-finite loss or gradients" in last, last
    assert "train.max_skipped_steps=2" in last and "Traceback" not in proc.stderr
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [bool(m.get("skipped")) for m in rows[-2:]] == [True, True]   # the two skipped steps are logged
    ckpts = CheckpointManager(tmp_path / "run" / "checkpoints").complete()
    assert ckpts, "the steps before the divergence were saved"
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    for c in ckpts:
        dcp_to_torch_save(str(c), str(tmp_path / "flat.pt"))
        state = torch.load(tmp_path / "flat.pt", weights_only=False)
        tensors = [v for v in state["model"].values() if torch.is_tensor(v) and v.is_floating_point()]
        assert tensors and all(torch.isfinite(v).all() for v in tensors), c
    del dcp


def _one_rank_nan_worker(rank, world, tmp):
    """dp=2 without EP: rank 1's NaN stays on rank 1 until the gradient all-reduce, which the check precedes
    (with EP it would reach rank 0's experts through the backward all-to-all, and both would report it)."""
    from parallel.dims import ParallelDims
    from trainer.train import Trainer
    cfg = make_config("logging.wandb.mode=disabled", "logging.progress=false", "train.max_steps=4",
                      "train.eval_every=0", f"data.cache_dir={tmp}/cache", world_size=world)
    dims = ParallelDims(world_size=world, rank=rank, timeout_s=60).build_groups()
    trainer = Trainer(cfg, Path(tmp) / "run", dims, torch.device("cpu"))
    _poison(trainer, {2}, rank=1)
    trainer.logger = type("L", (), {"write": lambda self, line: None})()
    rows = [trainer.train_step() for _ in range(4)]
    assert [bool(r.get("skipped")) for r in rows] == [False, True, False, False], rank
    assert rows[1]["nonfinite_ranks"] == [1], rows[1]     # every rank agrees, and knows who saw it
    assert all(math.isfinite(r["loss"]) for r in (rows[0], rows[2], rows[3]))


def test_nan_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    spawn(_one_rank_nan_worker, 2, tmp_path, str(tmp_path))


# ---- stop signals -----------------------------------------------------------------------------------------
def test_sigterm_saves_and_exits_75_then_resume_matches(tmp_path, reference):
    """SIGTERM to one of two ranks (started like srun): both finish the step, save, exit 75; resuming gives
    the losses of the uninterrupted run."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    procs = launch_ranks(run, cache, 2, 12, "parallel.ep=2")
    wait_for_steps(run, 3, procs)
    t0 = time.monotonic()
    os.kill(procs[1].pid, signal.SIGTERM)
    outs = [p.communicate(timeout=300) for p in procs]
    stop_s = time.monotonic() - t0
    assert [p.returncode for p in procs] == [EXIT_STOPPED, EXIT_STOPPED], [o[1][-2000:] for o in outs]
    assert "SIGTERM received" in outs[1][1]
    stopped = next(line for line in outs[0][0].splitlines() if line.startswith("stopping at step"))
    step = int(stopped.split()[3])
    assert f"checkpoints/step_{step:08d}" in stopped and "resume with checkpoint.resume=auto" in stopped
    assert max(losses(run)) == step < 12
    procs = launch_ranks(run, cache, 2, 12, "parallel.ep=2")   # same run dir: checkpoint.resume=auto
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    got = losses(run)
    assert sorted(got) == list(range(1, 13))
    for s, want in reference.items():
        assert abs(got[s] - want) <= 1e-5 * abs(want), (s, got[s], want)
    print(f"SIGTERM -> exit 75 in {stop_s:.1f} s (checkpoint of step {step}); no step lost")


def test_sigterm_during_a_save_finishes_it_then_stops(tmp_path, monkeypatch):
    from checkpoint import CheckpointManager
    from trainer.train import Trainer
    cfg = make_config("logging.wandb.mode=disabled", "logging.progress=false", "train.max_steps=8",
                      "train.eval_every=0", f"data.cache_dir={tmp_path}/cache", "checkpoint.every=2")
    trainer = Trainer(cfg, tmp_path / "run")
    save = CheckpointManager.save

    def interrupted(self, step, *args, **kwargs):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)   # arrives while the save is under way
        return save(self, step, *args, **kwargs)
    monkeypatch.setattr(CheckpointManager, "save", interrupted)
    summary = trainer.train()
    assert summary["stopped"] == "SIGTERM"
    assert trainer.step == 3                         # finished the next step, saved it, stopped
    done = [p.name for p in CheckpointManager(tmp_path / "run" / "checkpoints").complete()]
    assert done == ["step_00000002", "step_00000003"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL   # handlers restored after train()


def test_sigterm_to_torchrun_saves_and_stops(tmp_path):
    """torchrun forwards SIGTERM to its workers; they save at the step boundary and exit 75."""
    run = tmp_path / "run"
    tr = launch_torchrun(run, tmp_path / "cache", 2, 200, "parallel.ep=2")
    wait_for_steps(run, 2, [tr])
    os.kill(tr.pid, signal.SIGTERM)
    out, err = tr.communicate(timeout=300)
    assert "SIGTERM received" in err, err[-3000:]
    assert any(line.startswith("stopping at step") for line in out.splitlines()), (out[-2000:], err[-2000:])
    from checkpoint import CheckpointManager
    assert CheckpointManager(run / "checkpoints").complete(), "a checkpoint was written before the exit"


# ---- hung and dead peers ------------------------------------------------------------------------------------
HANG_LAYOUTS = {
    "ep": (["parallel.ep=2"],
           # any MoE layer, the MTP module's included: where the peer stopped is a matter of timing
           r"expert all-to-all of (layers\.\d+|mtp\.\d+\.block)\.ffn \(EP group \[0, 1\]\)( \(backward\))? failed "
           r"on rank 0"),
    "pipeline": (["parallel.pp=2", "parallel.schedule=1f1b"],
                 r"pipeline rank 0, action \d+ \(.*\): (receiving|send)|pipeline rank 0, the step's sends"),
}


@pytest.mark.parametrize("layout", sorted(HANG_LAYOUTS))
def test_stopped_peer_makes_the_other_rank_exit_naming_what_it_waited_for(tmp_path, layout):
    """SIGSTOP one rank (srun-style launch): the other exits 3 about ``parallel.timeout_s`` later, with one
    line naming its rank, the step, the phase, and the MoE layer + EP group or the pipeline action + channel."""
    import re
    overrides, pattern = HANG_LAYOUTS[layout]
    run = tmp_path / "run"
    procs = launch_ranks(run, tmp_path / "cache", 2, 400, *overrides, f"parallel.timeout_s={TIMEOUT_S}")
    try:
        wait_for_steps(run, 3, procs)
        t0 = time.monotonic()
        os.kill(procs[1].pid, signal.SIGSTOP)
        _, err = procs[0].communicate(timeout=TIMEOUT_S + 60)
        waited = time.monotonic() - t0
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode == EXIT_FAILED, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: rank 0: step "), line
    # gloo words the timeout by which side noticed it ("Timed out ..." / "Application timeout caused pair
    # closure"); the trainer names the cause the same either way
    assert re.search(pattern, line) and "(timed out: a peer hung or died" in line, line
    assert f"parallel.timeout_s={TIMEOUT_S}" in line, line
    assert waited < TIMEOUT_S + 20, waited
    print(f"{layout}: rank 0 exited {waited:.1f} s after its peer stopped (timeout {TIMEOUT_S} s): {line}")


def _peer_misses_worker(rank, world, tmp, phase):
    """EP=2; rank 1 never reaches ``phase`` (it sleeps past the timeout): rank 0 fails with one line naming the
    phase and, for validation, the MoE layer and EP group it waited in."""
    import re
    from parallel.dims import ParallelDims
    from trainer.lifecycle import TrainingError
    from trainer.train import Trainer
    cfg = make_config("logging.wandb.mode=disabled", "logging.progress=false", "train.max_steps=2",
                      "train.eval_every=0", f"data.cache_dir={tmp}/cache", "parallel.ep=2", "parallel.timeout_s=3",
                      world_size=world)
    dims = ParallelDims(world_size=world, rank=rank, ep=2, timeout_s=3).build_groups()
    trainer = Trainer(cfg, Path(tmp) / "run", dims, torch.device("cpu"))
    if rank == 1:
        time.sleep(8)
        return
    t0 = time.monotonic()
    with pytest.raises(TrainingError) as e:
        if phase == "validation":
            trainer.train()            # validates before the first step
        else:
            trainer.step = 1
            trainer._save_once()
    msg = str(e.value)
    assert time.monotonic() - t0 < 3 + 4, msg
    want = {"validation": r"^rank 0: step 0, validation before the first step: expert all-to-all of "
                          r"layers\.\d+\.ffn \(EP group \[0, 1\]\) failed on rank 0",
            "save": r"^rank 0: step 1, checkpoint save: "}[phase]
    assert re.search(want, msg) and "a peer hung or died" in msg and "\n" not in msg, msg


@pytest.mark.parametrize("phase", ["validation", "save"])
def test_peer_missing_from_validation_or_save_is_named(tmp_path, phase):
    # Tokenize here first: the ranks' 3 s timeout covers their start-up barrier too, and training the BPE on
    # a loaded machine can take longer than that (seen in CI with other jobs on both cores).
    from data import load_corpus
    cfg = make_config(f"data.cache_dir={tmp_path}/cache")
    load_corpus(cfg.data, cfg.model.vocab_size)
    spawn(_peer_misses_worker, 2, tmp_path, str(tmp_path), phase, timeout_s=3)


@pytest.mark.slow
def test_stopped_rank_of_four_makes_every_other_rank_exit(tmp_path):
    """pp=2 x ep=2 (DualPipe), srun-style: SIGSTOP rank 3. Its EP peer and its pipeline peer time out waiting
    for it; the ranks that wait only for those then see them gone. Every other rank exits 3 within about
    ``parallel.timeout_s``, each with its own one-line error."""
    run = tmp_path / "run"
    procs = launch_ranks(run, tmp_path / "cache", 4, 400, "parallel.pp=2", "parallel.ep=2", "parallel.schedule=dualpipe",
                         "train.global_batch_size=16", "train.micro_batch_size=2", f"parallel.timeout_s={TIMEOUT_S}")
    try:
        wait_for_steps(run, 2, procs)
        t0 = time.monotonic()
        os.kill(procs[3].pid, signal.SIGSTOP)
        exited = {}
        while len(exited) < 3 and time.monotonic() - t0 < TIMEOUT_S + 60:
            for r in range(3):
                if r not in exited and procs[r].poll() is not None:
                    exited[r] = time.monotonic() - t0
            time.sleep(0.05)
        errs = {r: procs[r].communicate(timeout=30)[1] for r in exited}
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert sorted(exited) == [0, 1, 2], exited
    for r in range(3):
        assert procs[r].returncode == EXIT_FAILED, errs[r][-3000:]
        line = errs[r].strip().splitlines()[-1]
        assert line.startswith(f"error: rank {r}: step ") and "a peer hung or died" in line, line
        assert exited[r] < TIMEOUT_S + 20, exited
    print("4 ranks, rank 3 stopped: ranks 0-2 exited after " +
          ", ".join(f"{exited[r]:.1f}" for r in range(3)) + f" s (timeout {TIMEOUT_S} s)")


def test_killed_peer_makes_the_other_rank_exit_at_once(tmp_path):
    run = tmp_path / "run"
    procs = launch_ranks(run, tmp_path / "cache", 2, 400, "parallel.ep=2", f"parallel.timeout_s={TIMEOUT_S}")
    wait_for_steps(run, 3, procs)
    t0 = time.monotonic()
    procs[1].kill()
    _, err = procs[0].communicate(timeout=TIMEOUT_S + 60)
    waited = time.monotonic() - t0
    procs[1].communicate()
    assert procs[0].returncode == EXIT_FAILED, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: rank 0: step ") and "(connection lost: a peer hung or died" in line, line
    assert waited < TIMEOUT_S + 20, waited
    print(f"killed peer: rank 0 exited {waited:.1f} s later: {line}")


@pytest.mark.slow
def test_stopped_worker_under_torchrun_ends_the_job(tmp_path):
    """Under torchrun the waiting worker exits 3 after the timeout and torchrun then ends the job (it kills
    the stopped worker after its own grace period)."""
    run = tmp_path / "run"
    tr = launch_torchrun(run, tmp_path / "cache", 2, 400, "parallel.ep=2", f"parallel.timeout_s={TIMEOUT_S}")
    wait_for_steps(run, 3, [tr])
    workers = workers_of(tr)
    assert len(workers) == 2, workers
    t0 = time.monotonic()
    os.kill(max(workers), signal.SIGSTOP)
    try:
        out, err = tr.communicate(timeout=TIMEOUT_S + 90)
    finally:
        for w in workers:
            try:
                os.kill(w, signal.SIGKILL)
            except ProcessLookupError:
                pass
    waited = time.monotonic() - t0
    assert tr.returncode != 0
    assert "(timed out: a peer hung or died" in err, err[-3000:]
    print(f"torchrun ended {waited:.1f} s after a worker stopped (timeout {TIMEOUT_S} s)")


@pytest.mark.parametrize("text, cause", [
    ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 8000ms for recv", "timed out"),
    ("Application timeout caused pair closure", "timed out"),
    ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLTOALL_BASE) ran for "
     "600000 milliseconds before timing out.", "timed out"),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242",
     "connection lost"),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection reset by peer", "connection lost"),
    ("NCCL error in: ProcessGroupNCCL.cpp:1968, unhandled system error", "communication failed"),
])
def test_failure_cause_reads_the_backends_words(text, cause):
    """The one-line error names the cause whichever words gloo or NCCL used, also below a layer's prefix."""
    from parallel.errors import CommFailure, failure_cause, named
    assert failure_cause(RuntimeError(text)) == cause
    with pytest.raises(CommFailure) as e:
        with named("expert all-to-all of layer 3"):
            raise RuntimeError(text)
    assert failure_cause(e.value) == cause
    # a layer's own clause guessing at the cause does not override the backend's words below it
    try:
        try:
            raise RuntimeError(text)
        except RuntimeError as inner:
            raise CommFailure("all-to-all failed (a peer may have died, timed out, or skipped this layer)") from inner
    except CommFailure as outer:
        assert failure_cause(outer) == cause


def test_gloo_async_timeout_is_named_as_a_comm_failure():
    """gloo's wording for a timed-out asynchronous collective (seen in CI on an EP backward all-to-all)."""
    from parallel.errors import CommFailure, named
    with pytest.raises(CommFailure, match="expert all-to-all of layer 3: Application timeout caused pair closure"):
        with named("expert all-to-all of layer 3"):
            raise RuntimeError("Application timeout caused pair closure")
    with pytest.raises(ValueError):   # anything else passes through unchanged
        with named("expert all-to-all of layer 3"):
            raise ValueError("Application timeout")
