"""The project's user-facing errors: a configuration value, file or layout that cannot work, and a file the run
cannot write.

It lives outside ``models/`` so that ``configs/``, ``parallel/``, ``trainer/``, ``data/``, ``checkpoint/`` and
``tools/`` need not import the model package for it. ``models/`` imports nothing of the project and raises its own
``models.ModelError``; the entry points catch both and print one line naming the key or file.
"""
from __future__ import annotations

import contextlib
import errno as errno_mod
import os
from typing import Iterator


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the key (e.g. ``parallel.ep``) and the fix."""


class WriteError(ConfigError):
    """A file the run writes could not be written: disk full, quota, read-only, no permission. The message
    names the key that places the file, the file, what it holds and what to do. A ``ConfigError`` (one line,
    exit 2, like a failed checkpoint save): a rerun fails the same way until the disk is fixed."""

    def __init__(self, msg: str, errno: int | None = None):
        super().__init__(msg)
        self.errno = errno


def os_error(e: OSError) -> str:
    """``<file>: errno 28 (ENOSPC: No space left on device)``; without the file when the error names none
    (a ``write`` or ``flush`` on an open file); without an errno, the error's own words (numpy's short write:
    ``OSError: 153732 requested and 30688 written``)."""
    if e.errno is None:
        text = f"{type(e).__name__}: {e}"
    else:
        text = f"errno {e.errno} ({errno_mod.errorcode.get(e.errno, str(e.errno))}: {e.strerror or e})"
    return f"{e.filename}: {text}" if e.filename is not None else text


@contextlib.contextmanager
def writing(key: str, path: str | os.PathLike, what: str, fix: str) -> Iterator[None]:
    """An ``OSError`` inside becomes one ``WriteError`` line: ``<key>: writing <what> to <path> failed: <the
    file and errno>. <fix>``. ``key`` is the config key that places ``path`` (``hydra.run.dir``,
    ``data.cache_dir``); ``fix`` says what to do."""
    try:
        yield
    except OSError as e:
        raise write_error(key, path, what, fix, e) from e


def write_error(key: str, path: str | os.PathLike, what: str, fix: str, e: OSError) -> WriteError:
    """``writing``'s error for ``e``, for an ``OSError`` caught elsewhere (inside a library's own error)."""
    where = os_error(e)
    if e.filename is not None and os.fspath(e.filename) == os.fspath(path):
        where = where.split(": ", 1)[1]   # the path is named already
    return WriteError(f"{key}: writing {what} to {path} failed: {where}. {fix}", e.errno)


def disk_error(e: BaseException) -> OSError | None:
    """The ``OSError`` of a full disk, an exceeded quota or a read-only file system in ``e``'s chain of causes, or
    None: a library that wraps every failure in its own error (``datasets``) still reads as a write error."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno_mod.ENOSPC, errno_mod.EDQUOT, errno_mod.EROFS):
            return e
        e = e.__cause__ or e.__context__
    return None


__all__ = ["ConfigError", "WriteError", "disk_error", "os_error", "write_error", "writing"]
