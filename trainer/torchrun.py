"""``python -m trainer.torchrun [torchrun options] -m trainer [overrides]``: torchrun, quiet when a rank fails.

The same launcher (``torch.distributed.run``: same arguments, rendezvous and signal handling). When a worker
fails, stock torchrun raises ``ChildFailedError`` out of its main: a traceback of the launcher itself and a
report per failed rank, about 40 lines after the trainer's own one-line error, and exit code 1 whatever the
worker's code. Nothing a worker does shortens that: writing the elastic error file (``@record``,
``TORCHELASTIC_ERROR_FILE``) only adds the worker's traceback to the report. This one exits with the first
failed worker's code (2 config error, 3 failed, ...; 128 + N for a worker killed by signal N) and prints one
line naming that worker, or nothing for a config error (rank 0 has printed it: ``trainer/__main__.py``).

Also sets ``OMP_NUM_THREADS=1`` when unset: torchrun's own default, without its four-line banner.
"""
from __future__ import annotations

import logging
import os
import signal
import sys

from trainer.lifecycle import EXIT_CONFIG


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # The agent's routine lines when a worker fails ("failed (exitcode: N) local_rank: ...", "Sending process
    # N closing signal SIGTERM" to the others): the line below says which worker failed first.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        lambda r: not str(r.msg).startswith(("failed (exitcode", "Sending process")))
    try:
        run(parse_args(argv))
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
