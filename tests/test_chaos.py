"""Chaos: one run directory survives a seeded mix of SIGKILL and SIGTERM (in start-up and mid-run, mid-save
included), a second trainer started on it at the same moment as the first, and a token dataset with a bad token
id (``data.on_bad_document=skip``), and ends with exactly the per-step losses and skipped windows of an
uninterrupted run.

What each fault must do (docs/operations.md §5): SIGTERM saves the step and exits 75 (in start-up: exit 75, no
checkpoint); SIGKILL loses the steps since the last periodic checkpoint (``checkpoint.every``) and leaves a lock
with a dead pid, taken over by the next start; of two trainers started together, the one that does not get the
lock exits 2 with one line naming the owner; ``checkpoint.resume=auto`` continues after each. The schedule comes
from ``random.Random(SEED)``; ``DSV3_CHAOS_SEED`` tries another, and a failure prints the seed and what happened.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from checkpoint.integrity import verify_local
from checkpoint.manager import CheckpointManager
from data.shards import write_shard
from trainer.lifecycle import EXIT_CONFIG, EXIT_OK, EXIT_STOPPED
from trainer.owner import OWNER_FILE

from .trainer_utils import ROOT, read_jsonl

SEED = int(os.environ.get("DSV3_CHAOS_SEED", "7"))
VOCAB, SEQ, STEPS, EVERY = 1024, 16, 25, 2      # +exp=tiny's vocabulary; ~100 windows: the bad one is read twice
BAD_TOKEN = 65535
FAULTS = ["SIGKILL", "SIGKILL", "SIGKILL", "SIGTERM", "SIGTERM", "SIGTERM"]
WAIT_S = 300                                     # per wait, generous: the machine is shared


def _dataset(root: Path) -> Path:
    """Two shards (70 documents); document 45 (the second shard's 6th) holds token id 65535 at position 3."""
    root.mkdir()
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, VOCAB, rng.integers(5, 40)), 0) for _ in range(70)]
    docs[45][3] = BAD_TOKEN
    write_shard(root / "shard_a", docs[:40], np.uint16)
    write_shard(root / "shard_b", docs[40:], np.uint16)
    return root


def _cmd(run: Path, data: Path, cache: Path) -> list[str]:
    return [sys.executable, "-m", "trainer", "+exp=tiny", f"data.blend=[{{path: {data}}}]",
            "data.on_bad_document=skip", f"data.seq_len={SEQ}", "train.global_batch_size=8", "train.micro_batch_size=4",
            f"train.max_steps={STEPS}", "train.eval_every=0", f"checkpoint.every={EVERY}", "checkpoint.keep=3",
            "logging.wandb.mode=disabled", "logging.progress=false", f"data.cache_dir={cache}", f"hydra.run.dir={run}"]


@dataclass
class Attempt:
    """One ``python -m trainer`` on the run directory: what was meant, and what happened."""
    plan: str
    proc: subprocess.Popen
    out: Path
    err: Path
    rc: int | None = None
    notes: list[str] = field(default_factory=list)

    def wait(self) -> int:
        self.rc = self.proc.wait(timeout=WAIT_S)
        return self.rc

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def start_step(self) -> int | None:
        """The step it started from, once it said so (by then metrics.jsonl was cut back to it): the ``resumed
        from`` line, or 0 for a fresh start's first lines; None if it never got that far."""
        lines = self.stdout().splitlines()
        resumed = [ln for ln in lines if ln.startswith("resumed from ") and " at step " in ln]
        if resumed:
            return int(resumed[0].rsplit(" at step ", 1)[1])
        return 0 if any(ln.startswith("layout: ") for ln in lines) else None


def _start(run: Path, data: Path, cache: Path, logs: Path, name: str, plan: str) -> Attempt:
    out, err = logs / f"{name}.out", logs / f"{name}.err"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(_cmd(run, data, cache), cwd=ROOT, env=env, stdout=o, stderr=e)
    return Attempt(plan, proc, out, err)


def _last_step(run: Path) -> int:
    path = run / "metrics.jsonl"
    steps = [0]
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                steps.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                pass   # a line being written
    return max(steps)


def _wait_until(what: str, cond, procs: list[Attempt]) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < WAIT_S, f"timed out waiting for {what}"
        if any(a.proc.poll() is not None for a in procs):
            return   # ended first (finished, or failed: judged by its exit code)
        time.sleep(0.02)


def _owner_pid(run: Path) -> int | None:
    try:
        return json.loads((run / OWNER_FILE).read_text()).get("pid")
    except (OSError, ValueError):
        return None


def _schedule(rng: random.Random) -> list[dict]:
    """The faults in order: each a signal sent ``delay`` s after ``after`` new steps past the furthest step logged
    so far; one of them (``after`` None) ``delay`` s after the start, in start-up. The start after the second
    SIGKILL (a stale lock, unless that one came before the lock was taken) is two trainers at once."""
    plan = []
    for sig in rng.sample(FAULTS, len(FAULTS)):
        plan.append({"signal": sig, "after": rng.randint(1, 3), "delay": round(rng.uniform(0.0, 0.4), 2)})
    startup = rng.randrange(len(plan))
    plan[startup] |= {"after": None, "delay": round(rng.uniform(1.0, 3.0), 2)}
    second_kill = [i for i, p in enumerate(plan) if p["signal"] == "SIGKILL"][1]
    if second_kill + 1 < len(plan):
        plan[second_kill + 1]["concurrent"] = True
    else:
        plan.append({"signal": None, "concurrent": True})
    return plan


def _skips_per_step(rows: list[dict], starts: dict[int, int]) -> dict[int, int]:
    """Windows skipped in each step. ``skipped_windows`` counts since the process started; ``starts[s]`` is the
    step the process that wrote step s's line started from."""
    out, prev = {}, None
    for r in rows:
        s, n = r["step"], r.get("skipped_windows", 0)
        same = prev is not None and starts[s] == starts[prev["step"]]
        out[s] = n - (prev.get("skipped_windows", 0) if same else 0)
        prev = r
    return {s: n for s, n in out.items() if n}


def _start_pair(run: Path, data: Path, cache: Path, logs: Path, name: str) -> tuple[Attempt, Attempt]:
    """Two trainers started at once on ``run``: (the one that took the lock, the other). The owner is held
    (SIGSTOP) until the other has exited: it takes seconds of imports to reach the lock, and the owner must still
    be running then."""
    pair = [_start(run, data, cache, logs, f"{name}{x}", "concurrent") for x in "xy"]
    pids = {p.proc.pid for p in pair}
    _wait_until("the lock", lambda: _owner_pid(run) in pids, pair)
    owner = next((p for p in pair if p.proc.pid == _owner_pid(run)), None)
    assert owner is not None, f"neither took the lock: {[(p.proc.returncode, p.stderr()[-2000:]) for p in pair]}"
    other = pair[1 - pair.index(owner)]
    other.plan = f"concurrent, lost the lock to pid {owner.proc.pid}"
    owner.proc.send_signal(signal.SIGSTOP)
    try:
        other.wait()
    finally:
        owner.proc.send_signal(signal.SIGCONT)
    return owner, other


@pytest.mark.slow
def test_chaos_run_ends_with_the_uninterrupted_losses(tmp_path):
    data, cache, logs = _dataset(tmp_path / "data"), tmp_path / "cache", tmp_path / "logs"
    logs.mkdir()
    ref = _start(tmp_path / "ref", data, cache, logs, "ref", "uninterrupted")   # runs beside the chaos
    run, rng = tmp_path / "chaos", random.Random(SEED)
    plan = _schedule(rng)
    attempts: list[Attempt] = []

    def report() -> str:
        lines = [f"seed {SEED} (DSV3_CHAOS_SEED), plan {plan}"]
        for i, a in enumerate(attempts):
            lines.append(f"  #{i} {a.plan}: rc {a.rc} {'; '.join(a.notes)}\n    stderr: "
                         + " | ".join(a.stderr().strip().splitlines()[-3:]))
        return "\n".join(lines)

    seen = 0   # the furthest step any attempt logged: each fault waits for new steps past it
    try:
        for i, fault in enumerate([*plan, {"signal": None}]):
            sig = fault["signal"]
            if fault.get("concurrent"):
                a, other = _start_pair(run, data, cache, logs, f"a{i}")
                attempts += [other, a]
                assert other.rc == EXIT_CONFIG, report()
                assert other.stderr().strip().splitlines()[-1].startswith(
                    f"error: run directory {run} is in use by another run (pid {a.proc.pid} "), report()
                a.plan = f"concurrent, took the lock; {sig or 'to the end'}"
            else:
                a = _start(run, data, cache, logs, f"a{i}", sig or "to the end")
                attempts.append(a)
            if sig is None:
                a.wait()
                break
            if fault["after"] is None:
                time.sleep(fault["delay"])
                a.notes.append(f"{sig} {fault['delay']} s after the start")
            else:
                target = min(seen + fault["after"], STEPS - 3)
                _wait_until(f"step {target}", lambda: _last_step(run) >= target, [a])
                time.sleep(fault["delay"])
                a.notes.append(f"{sig} at step {_last_step(run)} + {fault['delay']} s")
            if a.proc.poll() is None:
                a.proc.send_signal(getattr(signal, sig))
            a.wait()
            seen = max(seen, _last_step(run))
        assert ref.wait() == EXIT_OK, ref.stderr()[-3000:]
    finally:
        for a in [ref, *attempts]:
            if a.proc.poll() is None:
                a.proc.kill()
                a.proc.wait()
    print(report())

    # every attempt ended as its fault says (a SIGKILL or SIGTERM that came after the last step: 0), with at most
    # one error line, last, and never a traceback; a 75 said why
    expected = {"SIGKILL": {-signal.SIGKILL, EXIT_OK}, "SIGTERM": {EXIT_STOPPED, EXIT_OK}, "end": {EXIT_OK}}
    for a in attempts:
        err = a.stderr()
        errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert "Traceback" not in err and len(errors) <= 1 and (not errors or err.strip().endswith(errors[0])), report()
        assert a.rc in ({EXIT_CONFIG} if "lost the lock" in a.plan else expected[a.plan.split()[-1]]), report()
        if a.rc == EXIT_STOPPED:
            said = [ln for ln in a.stdout().splitlines() if ln.startswith("stopping at step")] + \
                [ln for ln in err.splitlines() if "SIGTERM received during start-up" in ln]
            assert len(said) == 1, report()
    rcs = [a.rc for a in attempts]
    assert attempts[-1].rc == EXIT_OK and -signal.SIGKILL in rcs and EXIT_STOPPED in rcs, report()

    # the losses, step for step, and the windows skipped for the bad token, as without the faults
    want = read_jsonl(tmp_path / "ref" / "metrics.jsonl")
    got = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in want] == list(range(1, STEPS + 1))
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), report()
    diff = [(r["step"], r["loss"], w["loss"]) for r, w in zip(got, want) if r["loss"] != w["loss"]]
    assert not diff, f"losses differ from the uninterrupted run (step, got, want): {diff}\n{report()}"
    assert not any(r.get("unhealthy") or r.get("skipped") for r in got + want), report()
    # skipped_windows counts from the process's start; step s's line is from the latest attempt that started
    # before s (each start cuts metrics.jsonl back to its step)
    ref_skips = _skips_per_step(want, {s: 0 for s in range(1, STEPS + 1)})
    starts = [st for st in (a.start_step() for a in attempts) if st is not None]
    assert ref_skips and _skips_per_step(got, {s: [st for st in starts if st < s][-1] for s in range(1, STEPS + 1)}) \
        == ref_skips, (ref_skips, report())
    warned = [ln.split(" - ", 1)[-1] for a in [ref, *attempts] for ln in a.stdout().splitlines() if str(BAD_TOKEN) in ln]
    assert warned and "document 45, position 3" in warned[0] and len(set(warned)) == 1, warned

    # what is left: checkpoints that verify, no partial save, no lock
    ckpts = CheckpointManager(run / "checkpoints", is_writer=False).step_dirs()
    assert ckpts and ckpts[-1].name == f"step_{STEPS:08d}", ckpts
    damaged = [(c, v.first()) for c in ckpts if not (v := verify_local(c)).ok]
    assert not damaged, damaged
    assert not list((run / "checkpoints").glob(".tmp-*")) and not (run / OWNER_FILE).exists()
