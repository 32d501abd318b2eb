"""Fault injection at the launcher, ``python -m trainer.torchrun`` (CPU, gloo, tiny model, 2 workers): a worker
killed by SIGKILL is the one named, not the peer it took down; SIGTERM/SIGUSR1 to the launcher itself stop the
run with a checkpoint and exit 75; a peer that never joins the process group (or a node that never joins the
rendezvous) is named in one line, exit 3. The same for ranks started the way ``srun`` starts them."""
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainer.lifecycle import EXIT_FAILED, EXIT_STOPPED

from .test_faults_runtime import _cmd, _env, _free_port, launch_ranks, wait_for_steps, workers_of
from .trainer_utils import ROOT

JOIN_TIMEOUT_S = 5   # parallel.timeout_s of the tests where a peer never joins


def launch(run_dir: Path, cache: Path, *launcher_args: str, overrides=(), wrap=()) -> subprocess.Popen:
    """``python -m trainer.torchrun --standalone --nproc_per_node=2 [launcher_args] [wrap] python -m trainer ...``
    for 200 steps (``wrap``: a command that runs each worker's command, with ``--no-python``)."""
    trainer = _cmd(run_dir, cache, 200, *overrides)
    worker = [*wrap, sys.executable, *trainer] if wrap else trainer
    return subprocess.Popen([sys.executable, "-m", "trainer.torchrun", "--standalone", "--nproc_per_node=2",
                             *launcher_args, *(["--no-python"] if wrap else []), *worker],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def rank_of(pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in env if v.startswith(b"RANK=")).split(b"=", 1)[1])


def finish(proc: subprocess.Popen, workers=(), timeout: float = 120) -> tuple[str, str]:
    """The launcher's output once it exited; the workers (and the launcher) killed if they outlive it."""
    try:
        return proc.communicate(timeout=timeout)
    finally:
        for pid in [*workers, proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


# ---- the first failure ---------------------------------------------------------------------------------------
def test_killed_worker_is_named_not_the_peer_it_took_down(tmp_path):
    """SIGKILL rank 1; rank 0 exits 3 a moment later, in the same 3 s poll (where torch's ``get_first_failure``
    names rank 0): the launcher names rank 1 and exits 128 + 9."""
    run = tmp_path / "run"
    tr = launch(run, tmp_path / "cache", "--monitor-interval=3", overrides=["parallel.ep=2"])
    wait_for_steps(run, 2, [tr])
    workers = workers_of(tr)
    victim = next(p for p in workers if rank_of(p) == 1)
    os.kill(victim, signal.SIGKILL)
    out, err = finish(tr, workers)
    assert tr.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert last_line(err) == f"torchrun: rank 1 (local rank 1, pid {victim}) was killed by SIGKILL, the first to fail"
    assert "(connection lost: a peer hung or died" in err and "Traceback" not in err, err[-3000:]


def _failure(pid, exitcode, timestamp=100):
    return SimpleNamespace(pid=pid, exitcode=exitcode, timestamp=timestamp, local_rank=0)


def test_first_failure_is_the_first_to_end_among_those_the_agent_did_not_end():
    from trainer.torchrun import first_failure
    killed, peer = _failure(11, -9), _failure(10, 3)
    # by the watch's times, whatever torch's whole-second stamps and the rank order say
    assert first_failure({0: peer, 1: killed}, {10: 2.0, 11: 1.5}, set()) == (1, killed)
    # seen ended at the same look: the signal death before the exit with a code; then the lower rank
    assert first_failure({0: peer, 1: killed}, {10: 2.0, 11: 2.0}, set()) == (1, killed)
    assert first_failure({0: _failure(10, 3), 1: _failure(11, 3)}, {10: 2.0, 11: 2.0}, set())[0] == 0
    # a worker the agent sent its closing SIGTERM (it exits -15, 75 or 3) is never named while another is known,
    # even when the watch saw it end first or did not see it at all
    termed = _failure(10, -15, timestamp=99)
    assert first_failure({0: termed, 1: killed}, {10: 1.0}, {10}) == (1, killed)
    # 75 is a stop with a checkpoint, not a failure: none when every worker exited so ...
    assert first_failure({0: _failure(10, 75), 1: _failure(11, 75)}, {}, set()) is None
    # ... and after a first 75, the one that then failed is named though the agent had closed it
    hung = _failure(11, -9)
    assert first_failure({0: _failure(10, 75), 1: hung}, {10: 1.0, 11: 31.0}, {11}) == (1, hung)


def test_config_error_is_the_one_line_while_a_peer_is_still_starting(tmp_path):
    """Rank 0 fails its config while rank 1 is still starting (under a wrapper that stays its parent, as
    train.sbatch's does): the agent's SIGTERM to rank 1 is no stop request, and the config error is the only line."""
    starting = ("import os, time; from trainer.lifecycle import StartupStops; "
                "StartupStops(int(os.environ['RANK'])).install(); time.sleep(60)")
    code = tmp_path / "rank1.code"
    slow = ["bash", "-c", f'if [ "$RANK" = 1 ]; then trap : TERM; {sys.executable} -c "{starting}"; '
                          f'echo $? > {code}; exit 0; fi; exec "$@"', "slow"]
    tr = launch(tmp_path / "run", tmp_path / "cache", wrap=slow, overrides=["optim.eps=0"])
    t0 = time.monotonic()
    out, err = finish(tr, timeout=60)
    assert tr.returncode == 2, err[-3000:]
    assert err.strip().splitlines() == ["error: optim.eps: must be finite and > 0, got 0"], err[-3000:]
    assert time.monotonic() - t0 < 45, "rank 1 was not ended by the launcher"
    assert code.read_text().strip() == str(128 + signal.SIGTERM)   # not 75: no stop to resume from


# ---- stop signals to the launcher -----------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_stop_signal_to_the_launcher_saves_and_exits_75(tmp_path, sig):
    """SIGTERM or SIGUSR1 to the launcher reaches both workers, which save and exit 75; the launcher exits 75 with
    one line (stock torchrun: a traceback, or dying at once with its workers left running)."""
    from checkpoint import CheckpointManager
    run = tmp_path / "run"
    tr = launch(run, tmp_path / "cache", overrides=["parallel.ep=2"])
    wait_for_steps(run, 2, [tr])
    workers = workers_of(tr)
    assert len(workers) == 2, workers
    os.kill(tr.pid, sig)
    out, err = finish(tr, workers)
    assert tr.returncode == EXIT_STOPPED, err[-3000:]
    assert last_line(err) == (f"torchrun: {sig.name} received and forwarded: the 2 worker(s) saved a checkpoint and "
                              f"stopped (exit {EXIT_STOPPED}); resume with checkpoint.resume=auto"), err[-3000:]
    assert sum(f"{sig.name} received: stopping" in line for line in err.splitlines()) == 2, err[-3000:]
    assert "Traceback" not in err and any(line.startswith("stopping at step") for line in out.splitlines())
    assert CheckpointManager(run / "checkpoints").complete(), "a checkpoint was written before the exit"
    assert not any(Path(f"/proc/{p}").exists() for p in workers), "a worker outlived the launcher"


def test_stop_signal_during_the_rendezvous_exits_75(tmp_path):
    """``--nnodes=2`` with one node: SIGTERM while the agent waits for the other; no worker to forward to."""
    port = _free_port()
    cmd = [sys.executable, "-m", "trainer.torchrun", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=early", "--rdzv-conf=join_timeout=60",
           *_cmd(tmp_path / "run", tmp_path / "cache", 3)]
    tr = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while True:   # the agent hosts the rendezvous store: it waits in the rendezvous once that port answers
        assert tr.poll() is None and time.monotonic() - t0 < 60, tr.communicate()
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    tr.send_signal(signal.SIGTERM)
    _, err = finish(tr, timeout=60)
    assert tr.returncode == EXIT_STOPPED, err[-3000:]
    assert last_line(err) == f"torchrun: SIGTERM received before the workers started: stopped (exit {EXIT_STOPPED})"
    assert "Traceback" not in err and not (tmp_path / "run").exists()


# ---- peers that never join ------------------------------------------------------------------------------------
def test_worker_that_never_joins_is_named(tmp_path):
    """Rank 1 hangs before ``init_process_group`` (a wrapper that sleeps): rank 0 names it after
    ``parallel.timeout_s`` and exits 3, the launcher names rank 0 (not rank 1, which it ended itself)."""
    hang = ["bash", "-c", 'if [ "$RANK" = 1 ]; then sleep 120; fi; exec "$@"', "hang"]
    tr = launch(tmp_path / "run", tmp_path / "cache", wrap=hang, overrides=[f"parallel.timeout_s={JOIN_TIMEOUT_S}"])
    out, err = finish(tr, timeout=150)
    assert tr.returncode == EXIT_FAILED, err[-3000:]
    lines = err.strip().splitlines()
    assert lines[-2].startswith("error: rank 0: rank 1 of 2 did not join the process group at ") and \
        f"within {JOIN_TIMEOUT_S} s (parallel.timeout_s)" in lines[-2], err[-3000:]
    assert lines[-1].startswith("torchrun: rank 0 (local rank 0, pid ") and "exited with 3" in lines[-1], err[-3000:]
    assert "Traceback" not in err


@pytest.mark.parametrize("present", [0, 1])
def test_rank_that_never_starts_is_named_srun_style(tmp_path, present):
    """One process per rank (srun), world size 2, only one of them started: rank 0 names rank 1; rank 1 names
    the store rank 0 would have hosted (MASTER_ADDR:MASTER_PORT). Exit 3 after ``parallel.timeout_s``."""
    (proc,) = launch_ranks(tmp_path / "run", tmp_path / "cache", 2, 3,
                           f"parallel.timeout_s={JOIN_TIMEOUT_S}", only=[present])
    _, err = finish(proc, timeout=150)
    assert proc.returncode == EXIT_FAILED, err[-3000:]
    line = last_line(err)
    want = {0: "error: rank 0: rank 1 of 2 did not join the process group at 127.0.0.1:",
            1: "error: rank 1: the rendezvous store at 127.0.0.1:"}[present]
    assert line.startswith(want) and f"{JOIN_TIMEOUT_S} s (parallel.timeout_s)" in line, line
    assert "(MASTER_ADDR:MASTER_PORT)" in line and "Traceback" not in err


def test_node_that_never_joins_the_rendezvous_is_named(tmp_path):
    """``--nnodes=2`` with one node: the agent's rendezvous times out (``join_timeout``); one line, exit 3."""
    port = _free_port()
    cmd = [sys.executable, "-m", "trainer.torchrun", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=alone", "--rdzv-conf=join_timeout=3",
           *_cmd(tmp_path / "run", tmp_path / "cache", 3)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_FAILED, proc.stderr[-3000:]
    assert last_line(proc.stderr) == (
        f"torchrun: the rendezvous at 127.0.0.1:{port} (--rdzv_endpoint, run id alone) did not complete within 3 s "
        "(--rdzv-conf join_timeout): fewer than --nnodes=2 nodes joined; check that every node's launcher started "
        "and reaches that endpoint"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and time.monotonic() - t0 < 60
