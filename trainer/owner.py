"""One owner per run directory: a run takes ``<dir>/.owner.json`` (host, pid, start time, job id) before it
reads or writes anything there, keeps its mtime fresh (the heartbeat: every step and at each start-up stage),
and removes it when it ends. A second run on the same directory stops with one line naming the owner.

A lock is taken over, with a warning naming whom it took it from, when it is stale:
- its job is this job (``SLURM_JOB_ID``, else torchrun's ``TORCHELASTIC_RUN_ID``): a requeued SLURM job or a
  torchrun restart continues its own run;
- its pid is dead on this host;
- on another host, its heartbeat is older than ``STALE_S``.
An unreadable owner file (a crash mid-write) counts as stale once its heartbeat is. The main rank decides; every
rank gets its verdict (``Owner.acquire`` is collective under torch.distributed), so all stop together.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from errors import ConfigError, writing

OWNER_FILE = ".owner.json"
STALE_S = 900.0   # another host's lock without a heartbeat for this long is abandoned (a step at scale: < 1 min)
_TRIES = 5        # exclusive creates a run tries while other runs starting at the same time take the lock


def job_id() -> str | None:
    """The launcher's id of this job, shared by its requeues and restarts."""
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:          # someone else's process: alive
        return True
    return True


class Owner:
    """The lock of one directory, held by this process (on the main rank)."""

    def __init__(self, directory: str | os.PathLike, key: str = "hydra.run.dir"):
        self.dir = Path(directory)
        self.key = key   # the config key that places the directory, for the error when the lock cannot be written
        self.path = self.dir / OWNER_FILE
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(),
                   "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.held = False

    # ---- one process --------------------------------------------------------------------------------------
    def take(self) -> str | None:
        """Take the lock; returns a warning line when a stale one was taken over. Raises ``ConfigError`` (one
        line, naming the owner) when another live run holds it. Only an exclusive create makes a holder: a stale
        lock is moved aside first, so two runs starting together over a stale or just released lock cannot both
        hold it."""
        note = None
        with self._writing():
            # the run directory (checkpoint.dir: created by its writability check)
            self.dir.mkdir(parents=True, exist_ok=True)
            for _ in range(_TRIES):
                try:
                    fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    note = self._clear_stale() or note
                    continue
                try:
                    with os.fdopen(fd, "w") as f:
                        json.dump(self.me, f)
                except OSError:   # a half-written lock would read as another run's for STALE_S
                    self.path.unlink(missing_ok=True)
                    raise
                self.held = True
                return note
        raise ConfigError(f"run directory {self.dir}: could not take its lock {self.path}: other runs starting on "
                          f"it at the same time took it {_TRIES} times; give each run its own hydra.run.dir / "
                          "checkpoint.dir")

    def _writing(self):
        return writing(self.key, self.path, "this run's lock on the directory",
                       "Free space on its disk or fix its permissions, then run again")

    def _clear_stale(self) -> str | None:
        """The lock file exists: raise ``ConfigError`` naming its owner if that may be running; else move it aside
        and return the warning line (None when it went meanwhile, or when the file moved turned out to be a newer
        lock, another run's: that one is put back)."""
        owner, age, text = self._read()
        why = self._stale(owner, age)
        if why is None:
            raise ConfigError(f"run directory {self.dir} is in use by another run ({_describe(owner)}, heartbeat "
                              f"{age:.0f} s ago): wait for it to end, or give this run its own hydra.run.dir / "
                              f"checkpoint.dir (a stale lock is taken over by itself: a dead pid on its host, or "
                              f"no heartbeat for {STALE_S:.0f} s from another host; else remove {self.path})")
        if owner == {}:
            return None
        aside = self.path.with_name(f"{OWNER_FILE}.stale-{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return None                          # another run moved it first
        try:
            if aside.read_text(errors="replace") != text:
                try:
                    os.link(aside, self.path)    # not the lock judged stale: put it back (unless a third run took it)
                except FileExistsError:
                    pass
                return None
        finally:
            aside.unlink(missing_ok=True)
        return f"run directory {self.dir}: took over the lock of {_describe(owner)} ({why})"

    def _read(self) -> tuple[dict | None, float, str | None]:
        """(the owner, or {} when there is no lock file, or None when it is unreadable; its heartbeat's age; the
        file's text)."""
        age = 0.0                                # unknown: as fresh as can be, so nothing is taken over on a guess
        text = None
        try:
            age = time.time() - self.path.stat().st_mtime
            text = self.path.read_text(errors="replace")
            owner = json.loads(text)
            return (owner if isinstance(owner, dict) else None), age, text
        except FileNotFoundError:
            return {}, 0.0, None                 # released meanwhile: free
        except (OSError, ValueError):
            return None, age, text

    def _stale(self, owner: dict | None, age: float) -> str | None:
        """Why the lock is stale, or None when its owner may be running."""
        if owner == {}:
            return "it was released"
        if owner is None:
            return "its owner file is unreadable and has no heartbeat" if age > STALE_S else None
        if self.me["job"] is not None and owner.get("job") == self.me["job"]:
            return f"the same job {self.me['job']}, restarted"
        if owner.get("host") == self.me["host"] and owner.get("pid") == self.me["pid"]:
            return "this process's own earlier trainer"
        if owner.get("host") == self.me["host"]:
            pid = owner.get("pid")
            return f"pid {pid} is no longer running" if not isinstance(pid, int) or not _alive(pid) else None
        return f"no heartbeat for {age:.0f} s" if age > STALE_S else None

    def beat(self) -> None:
        """The heartbeat: the owner file's mtime is now."""
        if self.held:
            try:
                os.utime(self.path)
            except OSError:
                pass                             # a full or read-only disk is reported where it matters

    def release(self) -> None:
        """Remove the owner file if it is still this process's."""
        if not self.held:
            return
        self.held = False
        owner, _, _ = self._read()
        if owner and owner.get("pid") == self.me["pid"] and owner.get("host") == self.me["host"]:
            try:
                self.path.unlink()
            except OSError:
                pass

    # ---- all ranks ----------------------------------------------------------------------------------------
    def acquire(self, dims) -> None:
        """``take`` on the main rank, its verdict on every rank (a collective when world > 1): a refusal raises
        the same ``ConfigError`` everywhere; a takeover is warned once."""
        verdict = None
        if dims.is_main:
            try:
                note = self.take()
                verdict = ("ok", note)
            except ConfigError as e:
                verdict = ("refused", str(e))
        if dims.world_size > 1:
            import torch.distributed as dist
            box = [verdict]
            dist.broadcast_object_list(box, src=0)
            verdict = box[0]
        kind, text = verdict
        if kind == "refused":
            raise ConfigError(text)
        if text and dims.is_main:
            print(f"warning: {text}", file=sys.stderr, flush=True)


def _describe(owner: dict | None) -> str:
    if not owner:
        return "an unknown owner (unreadable owner file)"
    job = f", job {owner['job']}" if owner.get("job") else ""
    return f"pid {owner.get('pid')} on {owner.get('host')}, started {owner.get('started')}{job}"
