"""The file-level parts of checkpoint saving and loading (checkpoint/manager.py holds the manager): DCP's
writer and reader extended to name their files, fsync of files and directories, and the errors a
collective write gathers, reduced to one line naming the rank, the path and the errno."""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .integrity import DamagedCheckpointError, _oneline, _os_error

class _Writer(dcp.FileSystemWriter):
    """Remembers the files this rank wrote (to hash them while they are in the page cache)."""

    def write_data(self, plan, planner):
        self._fut = super().write_data(plan, planner)
        return self._fut

    def written(self) -> list[str]:
        fut = getattr(self, "_fut", None)
        if fut is None:
            return []
        return sorted({r.storage_data.relative_path for r in fut.value()
                       if getattr(r.storage_data, "relative_path", None)})


class _Reader(dcp.FileSystemReader):
    """Names the shard file in a read error (DCP's own error names no file)."""

    def read_data(self, plan, planner):
        self._current = None
        try:
            return super().read_data(plan, planner)
        except Exception as e:
            f = self._current
            where = f"{Path(str(self.path)) / f}" if f else f"a shard of {self.path}"
            raise DamagedCheckpointError(
                f"checkpoint.resume: {where} cannot be read ({_oneline(e)}). Restore it, or resume from another "
                f"checkpoint (checkpoint.resume=<another step dir> or none)", Path(str(self.path)), f) from e

    def _slice_file(self, file, sinfo):
        self._current = sinfo.relative_path
        return super()._slice_file(file, sinfo)


def _guard(fn):
    try:
        return fn()
    except Exception as e:   # the result goes into a collective: an error must not skip it
        return f"<could not be checked: {_oneline(e)}>"


def _from_checkpoint_exception(e: CheckpointException) -> tuple[str, int | None]:
    for rank, (exc, _) in sorted(e.failures.items()):
        cur: BaseException | None = exc
        while cur is not None:   # the OSError may be wrapped
            if isinstance(cur, OSError):
                return f"rank {rank}: {_os_error(cur)}", cur.errno
            cur = cur.__cause__ or cur.__context__
    rank, (exc, _) = sorted(e.failures.items())[0]
    return f"rank {rank}: {_oneline(exc)}", None


def _dist():
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        return torch.distributed
    return None


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """fsync a directory (its entries: renames, new files). Its files are synced one by one when written
    (DCP's ``sync_files``, ``_write_synced``)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
