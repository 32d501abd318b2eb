"""Stop signals from the first line of ``python -m trainer``: during start-up (imports, data, model, checkpoint
loading) a SIGTERM/SIGUSR1 ends the run with one line and exit 75, the run directory's lock released; after
the training loop, a signal no longer cuts the closing short."""
import os
import signal
import subprocess
import sys
import time

import pytest

from trainer.lifecycle import EXIT_STOPPED, StartupInterrupted, StartupStops
from trainer.owner import OWNER_FILE

from .trainer_utils import ROOT, fast_overrides, read_jsonl


@pytest.fixture
def handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_modes_raise_then_note(handlers):
    stops = StartupStops(rank=3).install().raising()
    with pytest.raises(StartupInterrupted) as e:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(1)                            # the handler runs at the next bytecode boundary
    assert e.value.signal == "SIGUSR1" and stops.signal == "SIGUSR1"
    stops.finishing()
    os.kill(os.getpid(), signal.SIGTERM)         # noted only: nothing raised, the process goes on
    time.sleep(0.1)
    assert stops.signal == "SIGUSR1"


def _start(tmp_path, *extra, merge=False):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    cmd = [sys.executable, "-m", "trainer", "+exp=tiny", *fast_overrides(tmp_path, tmp_path / "cache"),
           f"hydra.run.dir={tmp_path}/run", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge else subprocess.PIPE,
                            text=True, env=env)


def _wait_for(path, proc, timeout=120):
    t0 = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < timeout, f"{path} never appeared"
        time.sleep(0.02)


@pytest.mark.parametrize("sig,delay", [(signal.SIGUSR1, 0.3), (signal.SIGTERM, 0.8), (signal.SIGUSR1, 1.3)])
def test_signal_while_importing_exits_75_with_one_line(tmp_path, sig, delay):
    """At these delays the program is importing (Hydra, torch: before main() or inside it); a signal that cut an
    import of torch short once left a half-initialised module behind (a segfault or an AttributeError at exit)."""
    proc = _start(tmp_path)
    time.sleep(delay)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED, err[-2000:]
    lines = [ln for ln in err.splitlines() if "received during start-up" in ln]
    assert len(lines) == 1 and sig.name in lines[0] and "Traceback" not in err


@pytest.mark.slow
def test_signal_while_loading_releases_the_lock_and_exits_75(tmp_path):
    proc = _start(tmp_path)                      # a fresh data.cache_dir: the tokenizer is trained first (seconds)
    _wait_for(tmp_path / "run" / OWNER_FILE, proc)   # the trainer exists and holds the run directory
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED, err[-2000:]
    assert sum("SIGUSR1 received during start-up" in ln for ln in err.splitlines()) == 1, err[-2000:]
    assert "Traceback" not in err
    assert not (tmp_path / "run" / OWNER_FILE).exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()       # no step ran
    # the directory is free again: the same command runs to its end
    rerun = _start(tmp_path, "train.max_steps=3")
    out, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err[-2000:]
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]


def test_signal_after_done_lets_the_run_close(tmp_path):
    """A SIGTERM the moment the last line is written: the run still closes its logs and exits 0."""
    proc = _start(tmp_path, "train.max_steps=3", merge=True)
    seen = []
    for line in proc.stdout:                     # ends when the process closes its output
        seen.append(line)
        if "done: step" in line:
            proc.send_signal(signal.SIGTERM)
            break
    out, _ = proc.communicate(timeout=120)
    assert any("done: step" in ln for ln in seen), "".join(seen)[-2000:]
    assert proc.returncode == 0, ("".join(seen) + out)[-2000:]
    assert "Traceback" not in out
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 3
