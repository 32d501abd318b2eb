"""Hydra callback for ``hydra/launcher=slurm``: notice a job that ended without a result, and say why.

submitit learns that a job ended from the result file the job writes when the Hydra job returns, or from
``sacct``. A job that exits early (a config error: exit 2; a crash; a kill) writes none, and on a cluster
without accounting ``sacct`` fails ("Bypassing sacct error"), so the launcher would wait forever. ``JobWatch``
swaps submitit's job poller, in the submitting process, for ``ControllerWatcher``: the state comes from
``sacct`` while it works and otherwise from the controller (``scontrol show job``, which keeps a finished
job for ``MinJobAge``, 300 s by default; a job it no longer knows has ended), polled 2, 4, 8, ... s after
the last submission and then every minute. When a job ends other than COMPLETED (or has left no result),
it prints one line per such job (the job's own ``error:`` line or its last log line, state, exit code,
log file) and one naming the jobs still running, and the launcher exits with the job's exit code (2 for a
config error). Enabled in ``configs/hydra/launcher/slurm.yaml``.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from submitit.core.utils import JobPaths
from submitit.slurm.slurm import SlurmInfoWatcher, SlurmJob

GONE = "ENDED"   # state of a job the controller no longer knows (and no accounting to ask): it has ended
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", GONE}


class JobWatch(Callback):
    def __init__(self) -> None:
        self.stock: SlurmInfoWatcher | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        launcher = config.hydra.launcher
        # submitit keeps one poller per job class (a class attribute); this process only waits for this sweep
        self.stock, SlurmJob.watcher = SlurmJob.watcher, ControllerWatcher(
            folder=str(launcher.submitit_folder), tasks=int(launcher.tasks_per_node) * int(launcher.nodes))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.stock is not None:
            SlurmJob.watcher = self.stock


class ControllerWatcher(SlurmInfoWatcher):
    """submitit's job-state poller, asking the controller where ``sacct`` fails, and ending the launcher with
    a report when a job fails (submitit would wait for a result file that never comes)."""

    def __init__(self, folder: str, tasks: int, delay_s: int = 60) -> None:
        super().__init__(delay_s)
        self.folder, self.tasks = folder, tasks
        self.use_sacct = shutil.which("sacct") is not None

    def update(self) -> None:
        ids = self._registered - self._finished
        if not ids:
            return
        self._num_calls += 1
        info = None
        if self.use_sacct:
            try:
                out = subprocess.run(self._make_command(), capture_output=True, check=True, timeout=60).stdout
                info = self.read_info(out)
            except (OSError, subprocess.SubprocessError):   # "Slurm accounting storage is disabled"
                self.use_sacct = False
        if info is None:
            info = {}
            for base in sorted({i.split("_")[0] for i in ids}):
                info.update(controller_states(base, [i for i in ids if i.split("_")[0] == base]))
        self._info_dict.update(info)
        self._last_status_check = time.time()
        ended = [i for i in ids if self.is_done(i, mode="cache")]
        self._finished.update(ended)
        self._stop_on_failures(ended)

    def is_done(self, job_id: str, mode: str = "standard") -> bool:
        """Ended for good. (submitit's own test counts every state it does not list as running, SUSPENDED or
        REQUEUE_HOLD too, as ended; sacct writes ``CANCELLED by <uid>``.)"""
        return self.get_state(job_id, mode=mode).split(" ")[0] in ENDED

    def _stop_on_failures(self, ended: list[str]) -> None:
        jobs = [i for i in self._registered if not any(j.startswith(i + "_") for j in self._registered)]
        lines, codes = [], []   # (an array's tasks count, not the array)
        for job_id in sorted(set(ended) & set(jobs), key=_job_order):
            state = self.get_state(job_id, mode="cache").split(" ")[0]
            paths = [JobPaths(self.folder, job_id, t) for t in range(self.tasks)]
            if state == "COMPLETED" or (state == GONE and all(p.result_pickle.exists() for p in paths)):
                continue   # a COMPLETED job's result may reach this host a moment later: submitit waits for it
            code = _exit_code(self._info_dict.get(job_id, {}).get("ExitCode", ""))
            codes.append(code)
            reason, log = _reason(paths)
            point = job_id.split("_")[1] if "_" in job_id else "0"
            lines.append(f"error: sweep job #{point}: SLURM job {job_id} "
                         f"{'ended (state no longer known)' if state == GONE else state}"
                         f"{'' if code is None else f', exit code {code}'}: {reason}; log {log}")
        if not lines:
            return
        running = sorted((i for i in jobs if i not in self._finished), key=_job_order)
        if running:
            lines.append(f"still running: {' '.join(running)} (scancel "
                         f"{' '.join(sorted({i.split('_')[0] for i in running}))} stops them)")
        print("\n".join(lines), file=sys.stderr, flush=True)
        known = {c for c in codes if c}
        sys.exit(known.pop() if len(known) == 1 and None not in codes else 1)


def controller_states(base_id: str, job_ids: list[str]) -> dict[str, dict[str, str]]:
    """``{job id: {"State": ..., "ExitCode": "2:0"}}`` from ``scontrol show job``; array tasks as
    ``<array id>_<task>``. A job the controller does not know any more is ``GONE``; {} if it cannot be asked."""
    try:
        r = subprocess.run(["scontrol", "show", "job", "-o", base_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return {}
    if r.returncode:
        return {i: {"State": GONE} for i in job_ids} if "Invalid job id" in r.stderr else {}
    states = {}
    for line in r.stdout.splitlines():
        fields: dict[str, str] = {}
        for item in line.split():
            key, _, value = item.partition("=")
            fields.setdefault(key, value)
        if "JobState" not in fields:
            continue
        state = {"State": fields["JobState"], "ExitCode": fields.get("ExitCode", "")}
        states[fields["JobId"]] = state
        if fields.get("ArrayJobId") and fields.get("ArrayTaskId"):
            for task in _task_ids(fields["ArrayTaskId"]):
                states[f"{fields['ArrayJobId']}_{task}"] = state
    return states


def _task_ids(spec: str) -> list[int]:
    """``3``, ``0-7``, ``0-7%2``, ``0,2-3`` -> task ids (a pending array shows its range on one line)."""
    ids = []
    for part in spec.split("%")[0].split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit():
            ids.extend(range(int(lo), int(hi.split(":")[0]) + 1) if hi else [int(lo)])
    return ids


def _job_order(job_id: str) -> tuple[int, ...]:
    return tuple(int(p) for p in job_id.split("_") if p.isdigit())


def _exit_code(text: str) -> int | None:
    """SLURM's ``ExitCode=<code>:<signal>`` as a shell reports it (128 + signal when killed)."""
    m = re.fullmatch(r"(\d+):(\d+)", text)
    if not m:
        return None
    return 128 + int(m.group(2)) if int(m.group(2)) else int(m.group(1))


def _reason(paths: list[JobPaths]) -> tuple[str, Path]:
    """The job's own ``error: ...`` line (any task's: rank 0 prints config errors), else the last line of
    task 0's stderr; and the log to read."""
    for p in paths:
        errors = [line for line in _lines(p.stderr) if line.startswith("error: ")]
        if errors:
            return errors[-1][len("error: "):], p.stderr
    lines = _lines(paths[0].stderr)
    return (f"last line: {lines[-1]}" if lines else "no output"), paths[0].stderr


def _lines(path: Path) -> list[str]:
    try:
        return [line.rstrip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return []
