"""``python -m trainer.torchrun [torchrun options] -m trainer [overrides]``: torchrun, quiet when a rank fails.

The same launcher (``torch.distributed.run``: same arguments, rendezvous and signal handling). When a worker
fails, stock torchrun raises ``ChildFailedError`` out of its main: a traceback of the launcher itself and a
report per failed rank, about 40 lines after the trainer's own one-line error, and exit code 1 whatever the
worker's code. Nothing a worker does shortens that: writing the elastic error file (``@record``,
``TORCHELASTIC_ERROR_FILE``) only adds the worker's traceback to the report. This one exits with the first
failed worker's code (2 config error, 3 failed, ...; 128 + N for a worker killed by signal N) and prints one
line naming that worker, or nothing for a config error (rank 0 has printed it: ``trainer/__main__.py``).

Also sets ``OMP_NUM_THREADS=1`` when unset: torchrun's own default, without its four-line banner.

Before the agent starts, a c10d ``--rdzv_endpoint`` that something already listens on must answer as a
rendezvous store (``check_endpoint``). Stock torchrun connects to whatever holds the port (another job, a
service) and waits on it in silence (minutes, with nothing printed): here that is one line naming the
endpoint, exit 2.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
from datetime import timedelta

from trainer.lifecycle import EXIT_CONFIG


PROBE_S = 15.0   # how long a store that holds the endpoint has to answer


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


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    if args.rdzv_backend == "c10d" and args.rdzv_endpoint and not args.standalone:
        why = check_endpoint(args.rdzv_endpoint)
        if why:
            print(f"torchrun: {why}", file=sys.stderr)
            return EXIT_CONFIG

    # The agent's routine lines when a worker fails ("failed (exitcode: N) local_rank: ...", "Sending process
    # N closing signal SIGTERM" to the others): the line below says which worker failed first.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        lambda r: not str(r.msg).startswith(("failed (exitcode", "Sending process")))
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        if code < 0:   # killed by a signal
            name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
            print(f"torchrun: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) was killed by {name}",
                  file=sys.stderr)
            return 128 - code
        if code != EXIT_CONFIG:
            print(f"torchrun: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) exited with {code}, "
                  f"the first of {len(e.failures)} to fail; its output is above", file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
