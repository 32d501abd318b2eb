"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), written atomically and verified on load.

Layout of ``checkpoint.dir``::

    step_00000010/        a checkpoint: DCP shards (__<rank>_<i>.distcp) + .metadata, model_config.yaml,
                          config.yaml, and manifest.json (size + sha256 of every other file; written last)
    step_00000020/
    latest                text file naming the step dir to resume from (replaced atomically after each save)
    .tmp-step_*/          a save in progress (or one killed mid-write); never read, removed at start-up

Save: every rank writes its shards into ``.tmp-step_N`` (``dcp.save`` is collective: it returns only after
every rank's files are written and fsynced and rank 0 has written ``.metadata``); each rank hashes the
files it wrote, rank 0 gathers the digests, writes the small files, hashes them, checks ``.metadata``,
writes ``manifest.json`` and fsyncs, and only then renames the temp dir to ``step_N``. A ``step_N`` dir
with a valid manifest is therefore complete by construction. A state holding inf/nan is refused before
anything is written; a failed write (full disk, ...) removes the temp dir, names the path and errno, and
touches no earlier checkpoint. Old checkpoints are pruned only after a save succeeded, and never one newer
than it (a newer dir is another timeline or damaged: left for the user).

In the background (``save_async``, ``checkpoint.async_save``): the same save, but after the non-finite check and
the temp dir the state is copied to CPU memory (``stage``) and the rest runs on one background thread, whose
collectives use a gloo group of their own, issued in the same order on every rank. One save at a time.

Load: ``resolve`` picks the newest checkpoint that verifies (order: ``_candidates``), skipping damaged ones
with a warning; errors are ``ConfigError``s (one line, exit 2). Verification checks every listed file's size
and sha256 (split over the ranks; all ranks gather the results, so all pick the same checkpoint) and that
``.metadata`` unpickles; a step dir without ``manifest.json`` is damaged.

Tensors are stored under the single-device model's names, so other layouts can load them.

``python -m checkpoint <step dir or checkpoint.dir> ...`` verifies checkpoints from the shell (``__main__.py``).
Names, manifest, verification, the non-finite check and the errors live in ``checkpoint/integrity.py``.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
import socket
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from .files import _dist, _from_checkpoint_exception, _fsync_dir, _guard, _Reader, _write_synced, _Writer
from .integrity import (CheckpointDirError, CheckpointError, CheckpointWriteError, DamagedCheckpointError, HASH,
                        MANIFEST, MANIFEST_FORMAT, NoGoodCheckpointError, NonFiniteStateError, STEP_DIR, Verdict,
                        _digests, _explicit_message, _oneline, _os_error, _single_process_quiet, _SINGLE_PROCESS,
                        _step_of, _structure_problems, _warn, file_digest, first_nonfinite, merge, step_dir_name,
                        verify_local)


HEALTH = "health.json"   # {"healthy": bool}: the trainer's health guard when the step was saved (trainer/health.py)


def written_healthy(step_dir: Path) -> bool:
    """Whether ``step_dir`` was written while training was healthy: its ``health.json`` says so, or it has none
    (the guard was off). An unreadable marker counts as unhealthy: such a checkpoint is never the one kept."""
    p = Path(step_dir) / HEALTH
    if not p.exists():
        return True
    try:
        return json.loads(p.read_text()).get("healthy") is True
    except (OSError, ValueError, AttributeError):
        return False


# ---- the manager -------------------------------------------------------------------------------------
def write_manifest(path: Path, step: int, digests: dict[str, tuple[int, str]] | None = None) -> None:
    """Write ``path``'s ``manifest.json`` (size and sha256 of every other file in it; ``digests``: those already
    hashed) and fsync the dir: the last file of a checkpoint, after which it verifies."""
    digests = digests or {}
    entries = {}
    for p in sorted(Path(path).iterdir()):
        if p.name == MANIFEST or not p.is_file():
            continue
        size, digest = digests[p.name] if p.name in digests else file_digest(p)
        if size != p.stat().st_size:
            raise DamagedCheckpointError(f"{p} changed size while being saved", Path(path), p.name)
        entries[p.name] = {"size": size, HASH: digest}
    manifest = {"format": MANIFEST_FORMAT, "step": step, "algorithm": HASH,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "files": entries}
    _write_synced(Path(path) / MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    _fsync_dir(Path(path))


def stage(tree: Any) -> Any:
    """A CPU copy of a state to save, for a background write while training changes the original: tensors
    copied (bit for bit), DTensors as DTensors over copies of their local pieces, anything else deep-copied."""
    if isinstance(tree, DTensor):
        return DTensor.from_local(stage(tree.to_local()), tree.device_mesh, tree.placements, run_check=False,
                                  shape=tree.shape, stride=tree.stride())
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: stage(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(stage(v) for v in tree)
    return copy.deepcopy(tree)


class CheckpointManager:
    def __init__(self, root: str | os.PathLike, keep: int = 3, is_writer: bool = True,
                 rank: int | None = None, world_size: int | None = None, background: bool = False,
                 timeout_s: float | None = None):
        """``background``: ``save_async`` may be used (a writer thread, and with several ranks a gloo group
        of its own, created here: every rank constructs the manager at the same point); ``timeout_s``: that
        group's collective timeout."""
        self.root = Path(root).expanduser()
        self.keep = keep
        self.is_writer = is_writer
        dist = _dist()
        self.rank = rank if rank is not None else (dist.get_rank() if dist else 0)
        self.world = world_size if world_size is not None else (dist.get_world_size() if dist else 1)
        self._pool: ThreadPoolExecutor | None = None
        self._group = None
        self._pending: Future | None = None
        if background:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
            if self.world > 1:
                self._group = torch.distributed.new_group(
                    backend="gloo", timeout=timedelta(seconds=timeout_s) if timeout_s else None,
                    group_desc="checkpoint")
            # DCP's warning for one process, for good: the writer thread cannot scope it (catch_warnings is
            # process-wide state, not thread-safe)
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)

    # ---- collectives (the default group: every rank calls save/resolve/check_writable; the background
    # write: its own group) --------------------------------------------------------------------------------
    def _all_gather(self, obj: Any, group=None) -> list:
        if self.world == 1:
            return [obj]
        out: list = [None] * self.world
        torch.distributed.all_gather_object(out, obj, group=group)
        return out

    def _broadcast(self, obj: Any, group=None) -> Any:
        if self.world == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0, group=group)
        return box[0]

    # ---- discovery -------------------------------------------------------------------------------------
    def step_dirs(self) -> list[Path]:
        """Every ``step_*`` dir, complete or not, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.iterdir() if STEP_DIR.match(p.name) and p.is_dir()), key=_step_of)

    def complete(self) -> list[Path]:
        """Step dirs with a ``.metadata``, oldest first (not verified: see ``resolve``)."""
        return [p for p in self.step_dirs() if (p / ".metadata").is_file()]

    def latest(self) -> Optional[Path]:
        """Newest step dir with a ``.metadata`` (not verified: see ``resolve``)."""
        done = self.complete()
        return done[-1] if done else None

    def remove_partial(self) -> None:
        """Delete temp dirs left by saves that were killed."""
        if self.is_writer and self.root.is_dir():
            for pattern in (".tmp-*", ".latest-*", ".probe-*"):
                for p in self.root.glob(pattern):
                    if p.is_dir():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        with contextlib.suppress(OSError):
                            p.unlink()

    def check_writable(self) -> None:
        """Create ``root`` if needed and write, fsync and remove a probe file there, on every rank (all write
        shards into it); raise ``CheckpointDirError`` naming the dir, rank and errno on all ranks if any fails."""
        err = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe-{socket.gethostname()}-{os.getpid()}-{self.rank}"
            fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            try:
                os.write(fd, b"probe\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.unlink(probe)
        except OSError as e:
            err = f"rank {self.rank}: {_os_error(e)}"
        errs = [e for e in self._all_gather(err) if e]
        if errs:
            raise CheckpointDirError(
                f"checkpoint.dir: {self.root} cannot be created or written ({errs[0]}"
                f"{f'; {len(errs) - 1} more ranks' if len(errs) > 1 else ''}). Set checkpoint.dir to a writable "
                f"directory (it is created if missing), or fix its permissions / free space")

    # ---- choosing the checkpoint to resume from ----------------------------------------------------------
    def verify(self, path: str | os.PathLike) -> Verdict:
        """Verify ``path`` (collective: each rank hashes its share; every rank returns the same verdict)."""
        path = Path(path).expanduser()
        try:
            mine = verify_local(path, self.rank, self.world)
        except Exception as e:   # never skip the gather: the other ranks are waiting in it
            mine = Verdict(path, [(".", f"could not be verified ({_oneline(e)})")])
        return merge(self._all_gather(mine))

    @staticmethod
    def _completed_ns(step_dir: Path) -> int:
        """When ``step_dir``'s save completed: its manifest's mtime (written last, before the rename); 0 if none."""
        try:
            return (step_dir / MANIFEST).stat().st_mtime_ns
        except OSError:
            return 0

    def _candidates(self) -> tuple[list[Path], Optional[Path], list[str]]:
        """(step dirs to try in order, the dir ``latest`` names if valid, notes); rank 0 decides. ``latest`` first,
        except before a newer step dir completed after ``latest`` was written (its manifest is newer): a save killed
        between its rename and the ``latest`` update, whose complete checkpoint goes first. A newer dir completed
        before ``latest`` was written belongs to an abandoned timeline (a roll-back): named, not used."""
        notes: list[str] = []
        dirs = list(reversed(self.step_dirs()))
        named = None
        lf = self.root / "latest"
        if lf.exists():
            try:
                text = lf.read_bytes().decode("utf-8").strip()
                written = lf.stat().st_mtime_ns
            except (OSError, UnicodeDecodeError) as e:
                text, why = None, f"cannot be read ({_os_error(e) if isinstance(e, OSError) else 'not UTF-8 text'})"
            else:
                why = f"names {text!r}, which is not a step dir in {self.root}"
            if text and STEP_DIR.match(text) and (self.root / text).is_dir():
                named = self.root / text
                newer = [p for p in dirs if _step_of(p) > _step_of(named)]
                unrecorded = [p for p in newer if self._completed_ns(p) > written]
                stale = [p.name for p in newer if p not in unrecorded]
                if stale:
                    notes.append(f"checkpoint.resume=auto: {lf} names {text}; the newer {', '.join(stale)} "
                                 f"{'is' if len(stale) == 1 else 'are'} older than that choice and not used (delete "
                                 f"{'it' if len(stale) == 1 else 'them'}, or point `latest` at one)")
                dirs = unrecorded + [named] + [p for p in dirs if p != named and p not in unrecorded]
            else:
                notes.append(f"checkpoint.resume=auto: {lf} {why}; ignoring it")
        return dirs, named, notes

    def resolve(self, resume: str) -> Optional[Path]:
        """The checkpoint to resume from for ``checkpoint.resume`` (``auto`` | ``none`` | a step dir), verified
        (collective). ``auto``: in ``_candidates``' order, skipping damaged ones with a warning (``latest`` is
        re-pointed at the one taken); ``None`` when there is none. A damaged explicit path raises ``DamagedCheckpointError``."""
        if resume == "none":
            return None
        if resume != "auto":
            path = Path(resume).expanduser()
            v = self.verify(path)
            if not v.ok:
                raise DamagedCheckpointError(_explicit_message(v), v.path, v.problems[0][0])
            return path
        plan = None
        if self.rank == 0:
            try:
                plan = self._candidates()
            except OSError as e:   # still broadcast: the other ranks are waiting for the plan
                plan = f"checkpoint.dir: cannot list {self.root} ({_os_error(e)}); fix it or set checkpoint.resume"
        plan = self._broadcast(plan)
        if isinstance(plan, str):
            raise CheckpointError(plan)
        dirs, named, notes = plan
        tried = []
        for path in dirs:
            v = self.verify(path)
            if v.ok:
                if self.is_writer:   # the warnings only now: when nothing verifies, the error alone says it all
                    for line in notes + [f"checkpoint.resume=auto: skipping damaged checkpoint {t.path}: {t.first()}"
                                         for t in tried]:
                        _warn(line)
                    if named is not None and named != path:
                        _warn(f"checkpoint.resume=auto: resuming from {path} instead of {named.name} named by "
                              f"{self.root / 'latest'}")
                if named != path:
                    self._write_latest(path.name, quiet=True)
                return path
            tried.append(v)
        if not tried:
            return None
        listing = "; ".join(f"{v.path.name} ({v.first()})" for v in tried)
        which = f"none of the {len(tried)} checkpoints in {self.root} verifies" if len(tried) > 1 else \
            f"the only checkpoint in {self.root} does not verify"
        raise NoGoodCheckpointError(
            f"checkpoint.resume=auto: {which}: {listing}. "
            f"Restore one from a copy, point checkpoint.resume at a good step dir, or start afresh with "
            f"checkpoint.resume=none or another checkpoint.dir")

    # ---- save / load -------------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any], files: dict[str, str | bytes] | None = None) -> Path:
        """Write ``state`` (DCP) plus small ``files`` (text or bytes, by name) as ``step_<step>`` with a manifest; atomic for
        readers. Collective: every rank calls it. Raises ``NonFiniteStateError`` (nothing written) or
        ``CheckpointWriteError`` (temp dir removed, earlier checkpoints untouched, nothing pruned)."""
        self.wait()
        tmp, final = self._begin(step, state)
        return self._write(step, state, tmp, final, files or {})

    def save_async(self, step: int, state: dict[str, Any], files: dict[str, str | bytes] | None = None) -> Path:
        """``save`` with the write in the background: waits for the previous background save (raising its
        error), checks and stages ``state`` (a CPU copy: the caller may change ``state`` once this returns),
        then writes it on the writer thread; returns the step dir it will be. ``NonFiniteStateError`` is raised
        here; a failed write is raised by ``wait`` (``failed`` says so first, without waiting)."""
        if self._pool is None:
            raise RuntimeError("CheckpointManager.save_async needs CheckpointManager(..., background=True)")
        self.wait()
        tmp, final = self._begin(step, state)
        staged = stage(state)
        t0 = time.perf_counter()

        def write() -> tuple[int, Path, float]:
            path = self._write(step, staged, tmp, final, files or {}, self._group)
            return step, path, time.perf_counter() - t0
        self._pending = self._pool.submit(write)
        return final

    def wait(self) -> Optional[tuple[int, Path, float]]:
        """Wait for the background save, if one is in flight: (step, its step dir, seconds it took); re-raises
        its ``CheckpointWriteError``. Collective in effect: the write's collectives wait for every rank's."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def poll(self) -> Optional[tuple[int, Path, float]]:
        """``wait``'s result if the background save has completed on this rank without error, else None
        (running, failed: see ``failed``, or none). Local: ranks may see the end at different steps."""
        if self._pending is not None and self._pending.done() and self._pending.exception() is None:
            return self.wait()
        return None

    def in_flight(self) -> bool:
        """Whether a background save was started and not yet waited for (it may have ended)."""
        return self._pending is not None

    def failed(self) -> bool:
        """Whether the background save ended with an error on this rank (``wait`` raises it). Local: agree on
        it across ranks (every rank's write fails together, but they may see it at different steps)."""
        return self._pending is not None and self._pending.done() and self._pending.exception() is not None

    def close(self) -> None:
        """Wait for the background save (raising its error) and stop the writer thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()

    def _begin(self, step: int, state: dict[str, Any]) -> tuple[Path, Path]:
        """The start of a save, on the caller's thread and the default group: refuse a non-finite ``state``, make
        a fresh temp dir; (temp dir, final step dir)."""
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{final.name}"   # same name on every rank
        bad = [(r, b) for r, b in enumerate(self._all_gather(_guard(lambda: first_nonfinite(state)))) if b]
        if bad:
            where = f"{bad[0][1]} (rank {bad[0][0]})" if self.world > 1 else bad[0][1]
            raise NonFiniteStateError(
                f"checkpoint: refusing to save step {step}: {where} holds inf or nan, so nothing was written "
                f"(earlier checkpoints are untouched). Resume from an earlier checkpoint "
                f"(checkpoint.resume=auto or <step dir>) with a lower optim.lr or checked data")
        err = None   # (message, errno), agreed by all ranks before each collective DCP step
        if self.is_writer:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():
                    shutil.rmtree(tmp)
            except OSError as e:
                err = (_os_error(e), e.errno)
        err = self._broadcast(err)
        if err is not None:
            self._failed(step, tmp, final, err)
        return tmp, final

    def _write(self, step: int, state: dict[str, Any], tmp: Path, final: Path, files: dict[str, str | bytes],
               group=None) -> Path:
        """The rest of a save, after ``_begin``: DCP write, digests, manifest, rename, ``latest``, pruning.
        ``group``: the process group of its collectives (None: the default)."""
        digests: dict[str, tuple[int, str]] = {}
        err = None
        writer = _Writer(str(tmp))
        try:
            with _single_process_quiet():
                dcp.save(state, storage_writer=writer, process_group=group)
            digests = _digests(tmp, writer.written())   # this rank's shards: still in the page cache
        except CheckpointException as e:      # raised on every rank when any rank failed
            err = _from_checkpoint_exception(e)
        except OSError as e:
            err = (f"rank {self.rank}: {_os_error(e)}", e.errno)
        gathered = self._all_gather((digests, err), group)
        err = next((g[1] for g in gathered if g[1] is not None), None)
        if err is None and self.is_writer:
            for d, _ in gathered:
                digests.update(d)
            try:
                self._finish(step, tmp, final, files, digests)
            except OSError as e:
                err = (_os_error(e), e.errno)
            except DamagedCheckpointError as e:
                err = (str(e), None)
        err = self._broadcast(err, group)
        if err is not None:
            self._failed(step, tmp, final, err)
        if self.is_writer:
            self._write_latest(final.name)
            self._prune(final)
        return final

    def _failed(self, step: int, tmp: Path, final: Path, err: tuple[str, int | None]) -> None:
        """Remove the temp dir (writer) and raise the ``CheckpointWriteError`` of a failed save."""
        if self.is_writer:
            shutil.rmtree(tmp, ignore_errors=True)
        msg, code = err
        prev = self.latest()
        raise CheckpointWriteError(
            f"checkpoint.dir: saving step {step} to {final} failed: {msg}. The partial save was removed; "
            f"earlier checkpoints are untouched (newest: {prev if prev else 'none'}) and none was pruned. Free "
            f"space or fix {self.root}, then resume with checkpoint.resume=auto", code)

    def _finish(self, step: int, tmp: Path, final: Path, files: dict[str, str | bytes],
                digests: dict[str, tuple[int, str]]) -> None:
        """Writer rank, after every rank's shards are on disk: small files, manifest (last), rename."""
        for name, data in files.items():
            _write_synced(tmp / name, data if isinstance(data, bytes) else data.encode())
        problems = _structure_problems(tmp)   # .metadata unpickles and covers shards that exist
        if problems:
            v = Verdict(tmp, problems)
            raise DamagedCheckpointError(f"the written checkpoint does not verify: {v.first()}", tmp, problems[0][0])
        write_manifest(tmp, step, digests)
        if final.exists():                       # re-saving a step: swap the old one out first
            old = self.root / f".tmp-old-{final.name}-{os.getpid()}"
            os.rename(final, old)
            try:
                os.rename(tmp, final)
            except OSError:
                os.rename(old, final)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(self.root)

    def load(self, path: str | os.PathLike, state: dict[str, Any], verify: bool = True) -> None:
        """Load in place into ``state`` (tensors are copied into the given ones). Verifies first unless
        ``verify=False`` (the caller did, e.g. with ``resolve``)."""
        path = Path(path).expanduser()
        if verify:
            v = self.verify(path)
            if not v.ok:
                raise DamagedCheckpointError(_explicit_message(v), v.path, v.problems[0][0])
        reader = _Reader(str(path))
        try:
            with _single_process_quiet():
                dcp.load(state, storage_reader=reader)
        except CheckpointException as e:
            exc = next((f[0] for f in e.failures.values()), None)
            if isinstance(exc, DamagedCheckpointError):
                raise DamagedCheckpointError(str(exc), exc.path, exc.file) from None
            raise DamagedCheckpointError(
                f"checkpoint.resume: checkpoint {path} could not be loaded ({_oneline(exc) if exc else e}). "
                f"Resume from another checkpoint (checkpoint.resume=<another step dir> or none)", path) from e

    def _write_latest(self, name: str, quiet: bool = False) -> None:
        """Point ``latest`` at ``name``; if that fails, remove ``latest`` (never leave it stale)."""
        if not self.is_writer:
            return
        lf, tmp = self.root / "latest", self.root / f".latest-{os.getpid()}"
        try:
            if lf.is_file() and lf.read_bytes().strip() == name.encode():
                return
            _write_synced(tmp, (name + "\n").encode())
            os.replace(tmp, lf)
        except OSError as e:
            for p in (tmp, lf):
                with contextlib.suppress(OSError):
                    p.unlink()
            if not quiet:
                _warn(f"could not update {lf} ({_os_error(e)}); removed it, so checkpoint.resume=auto takes the "
                      f"newest checkpoint that verifies")

    def _prune(self, saved: Path) -> None:
        """Keep ``saved`` (just written and verified) and older ones, newest first, until ``keep`` of the kept ones
        were written while healthy (``written_healthy``): a checkpoint of a diverging run never pushes out the
        last healthy one. Never touch a dir newer than ``saved`` (another timeline after a rollback, or damaged:
        the user's to judge)."""
        if self.keep <= 0:
            return
        healthy = 0
        for p in [saved] + [p for p in reversed(self.complete()) if _step_of(p) < _step_of(saved)]:
            if healthy >= self.keep:
                shutil.rmtree(p, ignore_errors=True)
            elif written_healthy(p):
                healthy += 1

    def newest_healthy(self, before_step: int) -> Optional[Path]:
        """The newest checkpoint older than ``before_step`` that was written while healthy and verifies, or None
        (collective: rank 0 lists, every rank verifies the same dirs in the same order)."""
        dirs = None
        if self.rank == 0:
            try:
                dirs = [p for p in reversed(self.complete()) if _step_of(p) < before_step and written_healthy(p)]
            except OSError:
                dirs = []
        for path in self._broadcast(dirs):
            v = self.verify(path)
            if v.ok:
                return path
            if self.is_writer:
                _warn(f"rollback: skipping damaged checkpoint {v.path}: {v.first()}")
        return None
