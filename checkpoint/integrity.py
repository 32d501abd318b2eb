"""What a checkpoint on disk is, and how to tell a good one: step-dir names, the manifest (size + sha256 of
every file), verification (``verify_local`` per rank, ``merge`` of the ranks' verdicts), the non-finite check
run before a save, and the errors, each naming the checkpoint and the file. ``checkpoint/manager.py`` saves,
loads, resolves and prunes with them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed.checkpoint as dcp

from errors import ConfigError
from errors import os_error as _os_error

STEP_DIR = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "dsv3-checkpoint-manifest/1"
HASH = "sha256"            # hardware-accelerated (SHA-NI / ARMv8 crypto) in OpenSSL; `sha256sum` checks it by hand
_CHUNK = 8 << 20


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _step_of(p: Path) -> int:
    m = STEP_DIR.match(p.name)
    return int(m.group(1)) if m else -1


# ---- errors ------------------------------------------------------------------------------------------
class CheckpointError(ConfigError):
    """A checkpoint problem the user fixes (``python -m trainer`` prints one line, exit 2)."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint whose files are missing, cut short, altered after the save, or unreadable."""

    def __init__(self, msg: str, path: Path | None = None, file: str | None = None):
        super().__init__(msg)
        self.path, self.file = path, file


class NoGoodCheckpointError(CheckpointError):
    """``checkpoint.resume=auto`` found checkpoints, but none of them verifies."""


class CheckpointDirError(CheckpointError):
    """``checkpoint.dir`` cannot be created or written (checked at start-up)."""


class CheckpointWriteError(CheckpointError):
    """A save failed (e.g. disk full); the temp dir is gone and earlier checkpoints are untouched."""

    def __init__(self, msg: str, errno: int | None = None):
        super().__init__(msg)
        self.errno = errno


class NonFiniteStateError(CheckpointError):
    """The state to save holds inf/nan; nothing was written."""


# ---- verification ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Verdict:
    """Outcome of verifying one checkpoint: ``problems`` are ``(file, what is wrong)``, sorted by file."""
    path: Path
    problems: list[tuple[str, str]]

    @property
    def ok(self) -> bool:
        return not self.problems

    def first(self) -> str:
        """``<path>/<file> <what is wrong>`` for the first bad file (+ how many others)."""
        name, what = self.problems[0]
        more = f" (and {len(self.problems) - 1} more bad file{'s' if len(self.problems) > 2 else ''})" \
            if len(self.problems) > 1 else ""
        return f"{self.path / name if name != '.' else self.path} {what}{more}"


def file_digest(path: Path) -> tuple[int, str]:
    """(size, sha256 hex) of a file, streamed."""
    h = hashlib.new(HASH)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def _digests(root: Path, names: list[str]) -> dict[str, tuple[int, str]]:
    """``file_digest`` of several files in threads (hashlib and file reads release the GIL)."""
    if len(names) <= 1:
        return {n: file_digest(root / n) for n in names}
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(min(len(names), os.cpu_count() or 1, 8)) as pool:
        return dict(zip(names, pool.map(lambda n: file_digest(root / n), names)))


def _oneline(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _structure_problems(path: Path) -> list[tuple[str, str]]:
    """``.metadata`` exists and unpickles, and every shard it points to exists and is long enough."""
    if not (path / ".metadata").is_file():
        return [(".metadata", "is missing (not a complete checkpoint; point checkpoint.resume at a step_* dir)")]
    try:
        with _single_process_quiet():
            meta = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:   # pickle errors, EOF, wrong classes: all mean "not readable metadata"
        return [(".metadata", f"cannot be read: it is corrupt or from an incompatible torch ({_oneline(e)})")]
    need: dict[str, int] = {}
    for info in (getattr(meta, "storage_data", None) or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), info.offset + info.length)
    problems = []
    for rel, size in sorted(need.items()):
        f = path / rel
        if not f.is_file():
            problems.append((rel, f"is missing ({len(need)} shard files expected)"))
        elif f.stat().st_size < size:
            problems.append((rel, f"has {f.stat().st_size} bytes, .metadata needs {size} (truncated)"))
    return problems


def verify_local(path: Path, rank: int = 0, world: int = 1) -> Verdict:
    """This rank's share of verifying ``path``: every rank checks presence and sizes of all listed files
    (cheap, and identical on shared storage), then hashes files ``rank::world`` of the sorted list; rank 0
    also checks ``.metadata``. Gather the verdicts of all ranks with ``merge``."""
    path = Path(path)
    if not path.is_dir():
        return Verdict(path, [(".", "is not a directory")])
    mf = path / MANIFEST
    if not mf.exists():
        return Verdict(path, [(MANIFEST, "is missing: every checkpoint this trainer writes ends with one, so the "
                                         "save did not finish or the file was removed; its files cannot be verified")])
    try:
        manifest = json.loads(mf.read_text())
        files = {str(k): (int(v["size"]), str(v[HASH])) for k, v in manifest["files"].items()}
        if manifest.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"unknown format {manifest.get('format')!r}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return Verdict(path, [(MANIFEST, f"is unreadable or corrupt ({_oneline(e)})")])
    problems = []
    names = sorted(files)
    for name in names:
        try:
            size = (path / name).stat().st_size
        except FileNotFoundError:
            problems.append((name, "is missing (listed in manifest.json)"))
            continue
        except OSError as e:
            problems.append((name, f"cannot be read ({_os_error(e)})"))
            continue
        if size != files[name][0]:
            problems.append((name, f"has {size} bytes, manifest.json says {files[name][0]} (truncated or overwritten)"))
    if ".metadata" not in files:
        problems.append((".metadata", "is not listed in manifest.json"))
    if problems:
        return Verdict(path, sorted(problems))
    mine = names[rank::world]
    try:
        got = _digests(path, mine)
    except OSError as e:
        got = {}
        problems.append((Path(e.filename).name if e.filename else mine[0], f"cannot be read ({_os_error(e)})"))
    for name in mine:
        if name in got and got[name][1] != files[name][1]:
            problems.append((name, f"fails its {HASH} check: its bytes changed after the save (bit rot, a bad copy, "
                                   f"or an overwrite)"))
    if rank == 0 and not problems:
        problems = _structure_problems(path)
    return Verdict(path, sorted(problems))


def merge(verdicts: list[Verdict]) -> Verdict:
    problems = sorted({p for v in verdicts for p in v.problems})
    return Verdict(verdicts[0].path, problems)


def check_complete(path: Path) -> None:
    """Verify ``path`` in this process (all files hashed); raise ``DamagedCheckpointError`` naming the file."""
    v = verify_local(Path(path))
    if not v.ok:
        raise DamagedCheckpointError(_explicit_message(v), v.path, v.problems[0][0])


def state_keys(path: str | os.PathLike) -> dict[str, tuple | None]:
    """The flattened keys the DCP checkpoint at ``path`` holds (``model.layers.0.attn.wo.weight``, ...) and their
    tensors' shapes (None for other objects); reads the metadata only."""
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k: tuple(m.size) if hasattr(m, "size") else None for k, m in meta.items()}


def has_state(path: str | os.PathLike, prefix: str) -> bool:
    """Whether the DCP checkpoint at ``path`` holds tensors under ``prefix`` (e.g. ``ema``); reads the metadata only."""
    return any(k == prefix or k.startswith(prefix + ".") for k in state_keys(path))


def _explicit_message(v: Verdict) -> str:
    return (f"checkpoint.resume: checkpoint {v.path} is damaged: {v.first()}. Restore it from a copy, or resume "
            f"from another checkpoint (checkpoint.resume=<another step dir>, or checkpoint.resume=auto to take the "
            f"newest one that verifies, or checkpoint.resume=none)")


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


# ---- non-finite check --------------------------------------------------------------------------------
def _tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _tensors(v, f"{prefix}.{i}" if prefix else str(i))


def first_nonfinite(state: dict) -> Optional[str]:
    """Name of the first floating tensor of ``state`` (this rank's pieces) holding inf or nan; one host sync
    per device. Each tensor is reduced to a float64 sum (no copy of the tensor; an inf or nan anywhere
    makes the sum non-finite, and float64 cannot overflow on finite float32/bf16 values)."""
    from torch.distributed.tensor import DTensor
    names: dict[torch.device, list[str]] = {}
    sums: dict[torch.device, list[torch.Tensor]] = {}
    for name, t in _tensors(state):
        if isinstance(t, DTensor):
            t = t.to_local()
        if not t.is_floating_point() or t.numel() == 0:
            continue
        t = t.detach()
        if t.element_size() == 1:   # float8: no reductions on some backends
            t = t.float()
        names.setdefault(t.device, []).append(name)
        sums.setdefault(t.device, []).append(t.sum(dtype=torch.float64))
    bad = []
    for dev, s in sums.items():
        finite = torch.isfinite(torch.stack(s)).tolist()
        bad += [names[dev][i] for i, ok in enumerate(finite) if not ok]
    if not bad:
        return None
    order = {name: i for i, (name, _) in enumerate(_tensors(state))}
    return min(bad, key=lambda n: order.get(n, 0))


_SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every call without a process group; one process is a supported layout here. Off the main
    thread it does nothing: ``catch_warnings`` swaps process-wide state (a background save's manager filters
    the warning for good instead)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
        yield
