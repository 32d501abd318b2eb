"""One owner per run directory (``trainer/owner.py``): a second run on a directory in use stops with one line
naming the owner; stale locks (a dead pid here, the same job restarted, no heartbeat from another host) are
taken over with a warning; the lock goes when the run ends."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from errors import ConfigError
from parallel.dims import ParallelDims
from trainer.owner import OWNER_FILE, STALE_S, Owner

from .trainer_utils import fast_overrides, read_jsonl, run_cli, start_cli

ONE = ParallelDims(world_size=1)


def write_owner(d, **owner):
    d.mkdir(parents=True, exist_ok=True)
    base = {"host": socket.gethostname(), "pid": os.getpid(), "job": None, "started": "2026-11-26T00:00:00Z"}
    (d / OWNER_FILE).write_text(json.dumps(base | owner))


@pytest.fixture
def other_process():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    p.kill()
    p.wait()


def test_a_live_owner_refuses_a_second_run(tmp_path, other_process):
    write_owner(tmp_path, pid=other_process.pid, job="77")
    with pytest.raises(ConfigError) as e:
        Owner(tmp_path).acquire(ONE)
    msg = str(e.value)
    assert f"run directory {tmp_path} is in use by another run (pid {other_process.pid} on {socket.gethostname()}" in msg
    assert "job 77" in msg and "\n" not in msg


@pytest.mark.parametrize("case", ["dead pid", "same job", "silent other host", "unreadable, silent"])
def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path, capsys, monkeypatch, case):
    if case == "dead pid":
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        write_owner(tmp_path, pid=dead.pid)
        why = f"pid {dead.pid} is no longer running"
    elif case == "same job":
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        write_owner(tmp_path, pid=1, job="4242")          # pid 1 is alive: only the job id makes it stale
        why = "the same job 4242, restarted"
    else:
        if case == "silent other host":
            write_owner(tmp_path, host="elsewhere", pid=1)
        else:
            (tmp_path / OWNER_FILE).write_text('{"host": "elsew')
        old = time.time() - STALE_S - 5
        os.utime(tmp_path / OWNER_FILE, (old, old))
        why = "no heartbeat" if case == "silent other host" else "unreadable and has no heartbeat"
    o = Owner(tmp_path)
    o.acquire(ONE)
    warning = capsys.readouterr().err
    assert warning.startswith(f"warning: run directory {tmp_path}: took over the lock of ") and why in warning
    assert json.loads((tmp_path / OWNER_FILE).read_text())["pid"] == os.getpid()
    o.release()
    assert not (tmp_path / OWNER_FILE).exists()


def test_another_host_with_a_heartbeat_keeps_its_lock(tmp_path):
    write_owner(tmp_path, host="elsewhere", pid=1)
    with pytest.raises(ConfigError, match="in use by another run .*on elsewhere.*heartbeat 0 s ago"):
        Owner(tmp_path).take()


def test_beat_and_release_touch_only_a_lock_this_process_holds(tmp_path, other_process):
    o = Owner(tmp_path)
    assert o.take() is None
    old = time.time() - 100
    os.utime(tmp_path / OWNER_FILE, (old, old))
    o.beat()
    assert time.time() - (tmp_path / OWNER_FILE).stat().st_mtime < 5
    write_owner(tmp_path, pid=other_process.pid)          # someone took it over meanwhile: not ours to remove
    o.release()
    assert (tmp_path / OWNER_FILE).exists()


def test_two_runs_on_one_directory(tmp_path):
    """The CLI: while one run trains, a second on its directory exits 2 with one line naming it; the first
    finishes undisturbed and leaves no lock behind. The first is held (SIGSTOP) between its first step and the
    second's exit, so the second meets it mid-run however slowly either starts."""
    run, steps = tmp_path / "run", 6
    args = ["+exp=tiny", f"hydra.run.dir={run}", "checkpoint.every=0", "checkpoint.save_final=false",
            *fast_overrides(tmp_path, tmp_path / "cache")]
    first = start_cli(*args, f"train.max_steps={steps}")
    try:
        deadline = time.time() + 120
        while not (run / "metrics.jsonl").is_file() and first.proc.is_alive() and time.time() < deadline:
            time.sleep(0.05)
        assert first.proc.is_alive(), first.wait(0).stderr[-3000:]
        os.kill(first.pid, signal.SIGSTOP)            # training, holding the lock
        try:
            second = run_cli(*args, "train.max_steps=5", timeout=120)
        finally:
            os.kill(first.pid, signal.SIGCONT)
        assert second.returncode == 2, second.stderr[-2000:]
        lines = second.stderr.strip().splitlines()
        assert lines[-1].startswith(f"error: run directory {run} is in use by another run (pid {first.pid} "), lines
        done = first.wait(300)
    finally:
        first.kill()
    assert done.returncode == 0, done.stderr[-3000:]
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == list(range(1, steps + 1))
    assert not (run / OWNER_FILE).exists()


@pytest.mark.parametrize("lock", ["dead pid", "released"])
def test_two_starts_taking_over_at_once_leave_one_owner(tmp_path, other_process, lock):
    """Two runs start together on a directory whose lock is stale (a killed run's dead pid) or is released as
    they start: the second takes it between the first's verdict and the first's own write. Exactly one may hold
    it; the other stops with the one line naming it."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_owner(tmp_path, pid=dead.pid)
    first, second = Owner(tmp_path), Owner(tmp_path)
    second.me["pid"] = other_process.pid           # another live process on this host
    read, judge = first._read, first._stale

    def read_after_release():
        if lock == "released" and not second.held:
            (tmp_path / OWNER_FILE).unlink()       # its run ended just after the first found the file there
        return read()

    def judged_then_the_second_takes_it(owner, age):
        why = judge(owner, age)
        if not second.held:
            second.take()
        return why
    first._read, first._stale = read_after_release, judged_then_the_second_takes_it
    with pytest.raises(ConfigError, match=rf"in use by another run \(pid {other_process.pid} "):
        first.take()
    assert second.held and not first.held
    assert json.loads((tmp_path / OWNER_FILE).read_text())["pid"] == other_process.pid
