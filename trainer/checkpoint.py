"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), written atomically.

Layout of ``checkpoint.dir``::

    step_00000010/        a complete checkpoint: DCP files + .metadata, model_config.yaml, config.yaml
    step_00000020/
    latest                text file naming the newest complete step dir (replaced atomically)
    .tmp-step_*/          a save in progress (or one killed mid-write); never read, removed at start-up

A save writes into a temp dir and renames it into place only when DCP has finished, so a killed save
never leaves a half-written ``step_*`` dir; ``latest()`` only ever returns complete checkpoints.
Tensors are stored under the single-device model's names, so other layouts can load them.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional

import torch.distributed.checkpoint as dcp

from models.config import ConfigError

STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


class CheckpointManager:
    def __init__(self, root: str | os.PathLike, keep: int = 3, is_writer: bool = True):
        self.root = Path(root).expanduser()
        self.keep = keep
        self.is_writer = is_writer

    # ---- discovery -----------------------------------------------------------------------------
    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = STEP_DIR.match(p.name)
            if m and p.is_dir() and (p / ".metadata").is_file():
                found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found)]

    def latest(self) -> Optional[Path]:
        done = self.complete()
        return done[-1] if done else None

    def remove_partial(self) -> None:
        """Delete temp dirs left by saves that were killed."""
        if self.is_writer and self.root.is_dir():
            for p in self.root.glob(".tmp-*"):
                shutil.rmtree(p, ignore_errors=True)

    # ---- save / load ---------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], files: dict[str, str] | None = None) -> Path:
        """Write ``state`` (DCP) plus small text ``files`` as ``step_<step>``; atomic for readers."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{final.name}"   # same name on every rank
        if self.is_writer and tmp.exists():
            shutil.rmtree(tmp)
        with _single_process_quiet():
            dcp.save(state, checkpoint_id=str(tmp))
        if self.is_writer:
            for name, text in (files or {}).items():
                (tmp / name).write_text(text)
            _fsync_dir(tmp)
            if final.exists():                       # re-saving a step: swap the old one out first
                old = self.root / f".tmp-old-{final.name}-{os.getpid()}"
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
            self._write_latest(final.name)
            self._prune()
        return final

    def load(self, path: str | os.PathLike, state: dict[str, Any]) -> None:
        """Load in place into ``state`` (tensors are copied into the given ones)."""
        path = Path(path).expanduser()
        if not (path / ".metadata").is_file():
            raise FileNotFoundError(
                f"{path} is not a complete checkpoint (no .metadata); point checkpoint.resume at a step_* dir")
        check_complete(path)
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path))

    def _write_latest(self, name: str) -> None:
        tmp = self.root / f".latest-{os.getpid()}"
        tmp.write_text(name + "\n")
        os.replace(tmp, self.root / "latest")

    def _prune(self) -> None:
        if self.keep > 0:
            for p in self.complete()[:-self.keep]:
                shutil.rmtree(p, ignore_errors=True)


class TornCheckpointError(ConfigError):
    """``checkpoint.resume`` points at a checkpoint whose files are not all there (exits 2, one line)."""


def check_complete(path: Path) -> None:
    """Every data file that ``.metadata`` points to exists and is long enough (a shard lost or cut short
    after the save — a copy that missed a file, a full disk — fails here, naming the file, instead of
    loading a partial state or failing deep inside DCP)."""
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    need: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        f = path / rel
        if not f.is_file():
            raise TornCheckpointError(
                f"checkpoint.resume: checkpoint {path} is incomplete: shard file {rel} is missing ({len(need)} files expected). "
                f"Restore it, or resume from another checkpoint (checkpoint.resume=<step dir> or "
                f"checkpoint.resume=none)")
        if f.stat().st_size < size:
            raise TornCheckpointError(
                f"checkpoint.resume: checkpoint {path} is incomplete: shard file {rel} has {f.stat().st_size} bytes, the metadata "
                f"needs {size}. Restore it, or resume from another checkpoint (checkpoint.resume=<step dir> or "
                f"checkpoint.resume=none)")


def _fsync_dir(path: Path) -> None:
    for p in [*path.iterdir(), path]:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)



@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every call without a process group; one process is a supported layout here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
