"""How a training run ends: exit codes, stop requests from signals, and errors that end a run.

Exit codes of ``python -m trainer`` (every rank):

    0    done (``train.max_steps`` or ``train.stop_at_step`` reached)
    2    configuration or user error (one line naming the key, file or path), including a file the run writes
         that cannot be written (disk full, read-only: ``errors.WriteError``; a rerun fails the same way until
         the disk is fixed; no checkpoint is touched)
    3    the run failed: too many consecutive non-finite steps, or a rank lost its peers (a collective
         timed out or a peer died); one line per rank naming the rank, group, operation and the
         pipeline action / MoE layer in progress; or peers never joined the process group (one line
         naming them, after ``parallel.timeout_s``)
    75   stopped on request (SIGTERM, SIGINT or SIGUSR1): a checkpoint of the last finished step was
         written; resume with ``checkpoint.resume=auto`` (EX_TEMPFAIL: a scheduler may retry)
    130  a second SIGINT: exit at once, no checkpoint

Signals are handled from the first line of ``main`` (``StartupStops``): during start-up (config, process
group, data, model, checkpoint loading: minutes at scale) a stop signal ends the run at once, cleaned up
(directory locks released, process group destroyed), with exit 75 and no checkpoint (no step ran, so none
is due); from the training loop's start, ``StopRequests`` notes it and it is acted on at the next step
boundary: every step the ranks agree, in the same reduction that checks for non-finite values, whether any
rank was asked to stop; then all of them save and exit together. Once the loop is over (``done:``), a stop
signal is noted and the run finishes closing (W&B, process groups) and exits as it would have. SLURM sends
SIGTERM (preemption, ``scancel``, the time limit) and, with ``--signal=USR1@<s>``, USR1 ahead of the limit;
torchrun forwards SIGTERM/SIGINT to its workers, ``python -m trainer.torchrun`` SIGTERM/SIGUSR1. A rank that
stopped and exits 75 ignores stop signals from then on (``ignore_stops``): torchrun sends SIGTERM to the ranks
still exiting once the first has, and it must not turn their 75 into death by signal.
"""
from __future__ import annotations

import os
import signal
import threading

from parallel.errors import failure_cause, is_comm_failure  # noqa: F401  (re-exported for the trainer)

EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_FAILED = 3
EXIT_STOPPED = 75
EXIT_INTERRUPTED = 130

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class TrainingError(RuntimeError):
    """A run that cannot go on; ``python -m trainer`` prints it as one line and exits ``EXIT_FAILED``."""


class StopRequests:
    """Signal handlers that turn SIGTERM / SIGINT / SIGUSR1 into a request to stop at the next step boundary
    (``signal``: the first one's name, or None). A second SIGINT exits at once. Installed only from the
    main thread (Python delivers signals there); ``restore()`` puts the previous handlers back."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.signal: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None:
            if signum == signal.SIGINT:
                _say(f"rank {self.rank}: second SIGINT: exiting at once, no checkpoint")
                os._exit(EXIT_INTERRUPTED)
            return
        self.signal = name
        _say(f"rank {self.rank}: {name} received: stopping at the end of the current step with a checkpoint "
             f"(exit code {EXIT_STOPPED}; a second SIGINT exits at once)")


class StartupInterrupted(BaseException):
    """A stop signal during start-up (``StartupStops``). A ``BaseException``, like ``KeyboardInterrupt``, so that
    no ``except Exception`` on the way swallows it; ``python -m trainer`` cleans up and exits ``EXIT_STOPPED``."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.signal = signal_name


class StartupStops:
    """The stop signals' handlers from the first line of ``python -m trainer`` until the training loop's own
    (``StopRequests``) take over, and again after them. Three modes, in order:

    * ``exit`` (while the program imports torch and Hydra: nothing to clean up yet): one line, exit 75 at once;
    * ``raise`` (``raising()``, start-up proper): ``StartupInterrupted`` in the main thread, interrupting whatever
      is loading; ``python -m trainer`` releases the directory locks, destroys the process group, exits 75;
    * ``note`` (``finishing()``, once the trainer is built): only noted, so that closing is not cut short.
    """

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.signal: str | None = None
        self.mode = "exit"

    def install(self) -> StartupStops:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                signal.signal(s, self._handle)
        return self

    def raising(self) -> StartupStops:
        self.mode = "raise"
        return self

    def finishing(self) -> None:
        self.mode = "note"

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.mode == "note":
            if self.signal is None:
                _say(f"rank {self.rank}: {name} received outside the training loop: the run goes on to its end")
            self.signal = self.signal or name
            return
        self.signal = name
        if self.mode == "exit":
            if closed_by_launcher():
                os._exit(128 + signum)
            _say(stopped_in_startup(self.rank, name))
            os._exit(EXIT_STOPPED)
        raise StartupInterrupted(name)


def leave_on_signal(code: int) -> None:
    """For a rank already leaving with an error: a stop signal now (the launcher ending the job because another
    rank failed) exits at once with ``code`` and says nothing more."""
    if threading.current_thread() is threading.main_thread():
        for s in STOP_SIGNALS:
            signal.signal(s, lambda *_: os._exit(code))


def ignore_stops() -> None:
    """For a rank that stopped on request and now exits 75: a stop signal from here on is ignored. torchrun
    takes the first 75 for a failure and sends the ranks still exiting SIGTERM; the interpreter's shutdown puts
    back the default action of every signal with a Python handler (death), while an ignored one stays ignored."""
    if threading.current_thread() is threading.main_thread():
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)


CLOSING_DIR_ENV = "DSV3_LAUNCHER_CLOSING"


def closed_by_launcher() -> bool:
    """Whether ``python -m trainer.torchrun`` is ending this worker because another one failed: its agent sends
    the closing signal (SIGTERM) to the process group of every worker still running (each starts in a session
    of its own, led by the process it started: this one, or a wrapper such as ``tools/slurm/train.sbatch``'s),
    and the launcher notes each first, as a file named by that pid in the directory it hands its workers
    (``DSV3_LAUNCHER_CLOSING``). That signal is no stop request: the launcher names the worker that failed."""
    closing = os.environ.get(CLOSING_DIR_ENV)
    return bool(closing) and os.path.exists(os.path.join(closing, str(os.getpgrp())))


def stopped_in_startup(rank: int, name: str) -> str:
    return (f"rank {rank}: {name} received during start-up: stopped before the first step, no checkpoint needed "
            f"(exit code {EXIT_STOPPED}; resume with checkpoint.resume=auto)")


def _say(line: str) -> None:
    """One line to stderr from a signal handler: straight to the file descriptor, since the handler may run
    while the main thread is inside a write to ``sys.stderr`` (a reentrant write would raise)."""
    os.write(2, (line + "\n").encode())
