"""``python -m trainer.torchrun [torchrun options] -m trainer [overrides]``: torchrun, quiet when a rank fails.

The same launcher (``torch.distributed.run``: same arguments and rendezvous), without stock torchrun's ~40-line
``ChildFailedError`` report and exit code 1 when a worker fails. This one exits with the first failed worker's
code (2 config error, 3 failed, ...; 128 + N for a worker killed by signal N) and prints one line naming that
worker, or nothing for a config error (rank 0 has printed it). The workers that the agent then ends with its
closing SIGTERM are told so (``DSV3_LAUNCHER_CLOSING``, ``trainer.lifecycle.closed_by_launcher``), so one still
starting up prints no stop line, which would read as a stop request to resume from.

The first failed worker is the first to end, by time (``ExitWatch``, to about 10 ms), among those that failed
on their own: torch stamps failures in whole seconds, so a worker killed by the OOM killer and the peer that
exited 3 a moment later would tie and torch would name the lower rank. A worker that exits 75 (stopped on
request with a checkpoint) has not failed: when every worker that ended did so with 75, the launcher says so
in one line and exits 75.

Stop signals: SIGTERM and SIGUSR1 to the launcher are forwarded to every worker, which finishes its step,
saves a checkpoint and exits 75 (``trainer/lifecycle.py``); the launcher waits for them and exits 75 with one
line (stock torchrun raises ``SignalException`` and SIGKILLs the workers still saving; SIGUSR1 ends it and
leaves the workers running). A stop signal before the workers started exits 75 at once. These two signals
are the launcher's own whatever ``--signals-to-handle`` lists, except where they are ignored when it starts
(``tools/slurm/train.sbatch``: SLURM signals the workers directly there).

Also sets ``OMP_NUM_THREADS=1`` when unset: torchrun's own default, without its four-line banner.

Before the agent starts, a c10d ``--rdzv_endpoint`` that something already listens on must answer as a
rendezvous store (``check_endpoint``), else one line naming the endpoint and exit 2 (stock torchrun waits on
it in silence). A node that never joins the rendezvous: one line naming the endpoint and the join timeout
(``--rdzv-conf join_timeout=<s>``), exit 3.
"""
from __future__ import annotations

import glob
import logging
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

from trainer.lifecycle import CLOSING_DIR_ENV, EXIT_CONFIG, EXIT_FAILED, EXIT_STOPPED


PROBE_S = 15.0   # how long a store that holds the endpoint has to answer
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)   # forwarded to the workers; the others stay torch's


def check_endpoint(endpoint: str, probe_s: float = PROBE_S) -> str | None:
    """Why ``endpoint`` (``host:port``) cannot be a c10d rendezvous store, or None. Nothing listening is fine:
    this agent will host the store, or the host's agent has not started yet. A listener must answer a store
    client within ``probe_s``; the client runs in a daemon thread that is left behind if it never returns."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    host, port = parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_PORT)
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError:
        return None
    answer: dict = {}

    def probe() -> None:
        try:
            TCPStore(host, port, is_master=False, timeout=timedelta(seconds=probe_s)).check(["probe"])
            answer["ok"] = True
        except Exception as e:   # noqa: BLE001  (any failure: the listener is not a usable store)
            answer["error"] = str(e).splitlines()[0]

    t = threading.Thread(target=probe, name="rdzv-endpoint-probe", daemon=True)
    t.start()
    t.join(probe_s + 2)
    if answer.get("ok"):
        return None
    why = f"it failed: {answer['error']}" if "error" in answer else f"no answer in {probe_s:.0f} s"
    return (f"the rendezvous endpoint {host}:{port} (--rdzv_endpoint) is held by a process that is not a rendezvous "
            f"store ({why}): another job or service on {host}; choose a free port (tools/slurm/train.sbatch: "
            "MASTER_PORT)")


def _children() -> set[int]:
    """PIDs of this process's children (Linux: ``/proc/<pid>/task/<tid>/children``; empty elsewhere)."""
    pids: set[int] = set()
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            with open(path) as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:   # the thread ended meanwhile
            pass
    return pids


class ExitWatch:
    """When each child of the launcher (the agent's workers) ended, to within about ``period`` s (``ended``:
    pid -> ``time.monotonic()``). A daemon thread looks at every child each ``period``: ``waitid`` with
    ``WNOWAIT`` sees a child that has ended without reaping it (the agent still collects its exit code), and
    one that the agent has reaped since the last look is no longer a child (``ChildProcessError``): ended by
    now at the latest."""

    def __init__(self, period: float = 0.01):
        self.period = period
        self.ended: dict[int, float] = {}
        self.alive: set[int] = set()
        threading.Thread(target=self._watch, name="worker-exits", daemon=True).start()

    def _watch(self) -> None:
        while True:
            self.look()
            time.sleep(self.period)

    def look(self) -> None:
        now, alive = time.monotonic(), set()
        for pid in self.alive | _children():
            if pid in self.ended:
                continue
            try:
                if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                    alive.add(pid)
                    continue
            except ChildProcessError:   # reaped by the agent since the last look
                pass
            self.ended.setdefault(pid, now)
        self.alive = alive


class Stops:
    """SIGTERM / SIGUSR1 to the launcher: forwarded to every running worker (``signal``: the first one's name).
    Before any worker started (the rendezvous) it raises torch's ``SignalException``, as torch's own handler
    does: the agent sends the signal to any worker it has just started, and ends."""

    def __init__(self, watch: ExitWatch):
        self.watch = watch
        self.signal: str | None = None

    def install(self, args) -> Stops:
        """Take the stop signals from torch (``--signals-to-handle``), except those ignored at start."""
        for s in STOP_SIGNALS:
            if signal.getsignal(s) is not signal.SIG_IGN:
                signal.signal(s, self._handle)
        names = [n.strip() for n in args.signals_to_handle.split(",")]
        rest = [n for n in names if n and n not in {s.name for s in STOP_SIGNALS}]
        # An empty list makes torch log a traceback per empty name; SIGHUP's default action would end the
        # launcher and leave its workers running, so torch handling it is the harmless choice.
        args.signals_to_handle = ",".join(rest) or "SIGHUP"
        return self

    def _handle(self, signum: int, frame) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        name = signal.Signals(signum).name
        self.signal = self.signal or name
        sent = 0
        for pid in _children() - self.watch.ended.keys():
            try:
                os.kill(pid, signum)
                sent += 1
            except ProcessLookupError:
                pass
        if not sent and not self.watch.ended:
            raise SignalException(f"Process {os.getpid()} got signal: {name}", sigval=signal.Signals(signum))


def first_failure(failures: dict, ended: dict[int, float], closed: set[int]) -> tuple[int, object] | None:
    """(rank, ``ProcessFailure``) of the worker that failed first, or None when none failed (all exited 75).
    Of the failures that are not a stop on request (75), those whose worker the agent did not end itself
    (``closed``: the pids it sent its closing signal once one worker had failed) come first, and among them
    the earliest to end (``ended``; torch's whole-second stamp where the watch did not see it); at the same
    look, a worker killed by a signal before one that exited with a code (the peer that lost its connection
    to it), then the lower rank."""
    bad = {r: f for r, f in failures.items() if f.exitcode != EXIT_STOPPED}
    own = {r: f for r, f in bad.items() if f.pid not in closed} or bad
    if not own:
        return None
    return min(own.items(), key=lambda rf: (ended.get(rf[1].pid, math.inf), rf[1].timestamp, rf[1].exitcode >= 0,
                                            rf[0]))


def _join_timeout(args) -> str:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout
    conf = dict(kv.split("=", 1) for kv in args.rdzv_conf.split(",") if "=" in kv)
    if "join_timeout" in conf:
        return f"{conf['join_timeout']} s (--rdzv-conf join_timeout)"
    return f"{RendezvousTimeout().join.total_seconds():.0f} s (torch's default; --rdzv-conf join_timeout=<s> sets it)"


def _quiet_agent(closed: set[int], closing: str) -> None:
    """Drop the agent's routine lines when a worker fails ("failed (exitcode: N) local_rank: ...", "Sending
    process N closing signal SIGTERM" to the others): the launcher's own line says which worker failed first.
    The second names the workers the agent ends itself, which are never that one: their pids go to ``closed``,
    and a file per pid in ``closing`` tells those workers (``trainer.lifecycle.closed_by_launcher``) that the
    signal is no stop request, so that one still starting up does not print a stop line to resume from."""
    def quiet(record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if msg.startswith("Sending process") and record.args:   # logged just before the signal is sent
            closed.add(int(record.args[0]))
            Path(closing, str(record.args[0])).touch()
        return not msg.startswith(("failed (exitcode", "Sending process"))
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(quiet)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    if args.rdzv_backend == "c10d" and args.rdzv_endpoint and not args.standalone:
        why = check_endpoint(args.rdzv_endpoint)
        if why:
            print(f"torchrun: {why}", file=sys.stderr)
            return EXIT_CONFIG

    closed: set[int] = set()
    closing = tempfile.mkdtemp(prefix="dsv3-closing-")
    os.environ[CLOSING_DIR_ENV] = closing
    _quiet_agent(closed, closing)
    watch = ExitWatch()
    stops = Stops(watch).install(args)
    try:
        run(args)
    except ChildFailedError as e:
        first = first_failure(e.failures, watch.ended, closed)
        if first is None:
            why = f"{stops.signal} received and forwarded: " if stops.signal else ""
            print(f"torchrun: {why}the {len(e.failures)} worker(s) saved a checkpoint and stopped "
                  f"(exit {EXIT_STOPPED}); resume with checkpoint.resume=auto", file=sys.stderr)
            return EXIT_STOPPED
        rank, failure = first
        code = failure.exitcode
        who = f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid})"
        if code < 0:   # killed by a signal
            name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
            print(f"torchrun: {who} was killed by {name}, the first to fail", file=sys.stderr)
            return 128 - code
        if code != EXIT_CONFIG:
            n = sum(f.exitcode != EXIT_STOPPED for f in e.failures.values())
            print(f"torchrun: {who} exited with {code}, the first of {n} to fail; its output is above", file=sys.stderr)
        return code
    except SignalException as e:
        if e.sigval not in STOP_SIGNALS:   # torch's own signals (SIGINT, SIGHUP, SIGQUIT): torch's answer
            raise
        print(f"torchrun: {e.sigval.name} received before the workers started: stopped (exit {EXIT_STOPPED})",
              file=sys.stderr)
        return EXIT_STOPPED
    except RendezvousTimeoutError:
        print(f"torchrun: the rendezvous at {args.rdzv_endpoint} (--rdzv_endpoint, run id {args.rdzv_id}) did not "
              f"complete within {_join_timeout(args)}: fewer than --nnodes={args.nnodes} nodes joined; check that "
              "every node's launcher started and reaches that endpoint", file=sys.stderr)
        return EXIT_FAILED
    finally:
        shutil.rmtree(closing, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
