"""Communication failures, named: when a peer hangs (a collective times out after ``parallel.timeout_s``)
or dies (its connections drop), torch raises an error that says neither which rank is waiting nor what
it was doing. The layers that know add it as the error travels up — the pipeline action, the MoE layer,
the p2p channel, the trainer's step and phase — each prefixing one clause, so the line a rank prints
names its rank, the group or channel, the operation and what was in progress."""
from __future__ import annotations

import contextlib

# Fragments of the errors torch raises when a peer hung (timeout) or died (connection lost), gloo and NCCL.
# gloo's asynchronous work (an all-to-all started outside autograd, waited for later) reports its timeout
# as "Application timeout caused pair closure".
_COMM_FAILURE = ("Timed out", "timed out", "Application timeout", "Connection closed by peer",
                 "Connection reset by peer", "Broken pipe", "NCCL", "ProcessGroup", "Watchdog", "watchdog", "gloo")


# Which of those say the peer did not answer in time (gloo: "Timed out ..." from a blocking call, "Application
# timeout caused pair closure" from asynchronous work; NCCL's watchdog: "... before timing out") and which say
# its connection went (a peer that died). The wording depends on which side noticed first; the cause does not.
_TIMED_OUT = ("Timed out", "timed out", "Application timeout", "timing out")
_CONNECTION_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def failure_cause(e: BaseException) -> str:
    """``"timed out"``, ``"connection lost"`` or ``"communication failed"``: what a communication failure
    says happened, in whatever words the backend used. Only the backend's own error (the deepest one ``e``
    was raised from) is read: the clauses the layers above add may mention either cause as a guess."""
    seen = set()
    while id(e) not in seen and (e.__cause__ or e.__context__) is not None:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    text = str(e)
    if any(f in text for f in _CONNECTION_LOST):
        return "connection lost"
    if any(f in text for f in _TIMED_OUT):
        return "timed out"
    return "communication failed"


class P2PError(RuntimeError):
    """A point-to-point protocol error of ours (a transfer that is not the one expected, a channel that
    does not exist): a bug in a schedule's placement, never a peer failure."""


def is_comm_failure(e: BaseException) -> bool:
    """Whether ``e`` is a collective or point-to-point failure (a hung or dead peer), not a bug."""
    import torch.distributed as dist
    if isinstance(e, P2PError):
        return False
    if isinstance(e, (dist.DistError, CommFailure)):
        return True
    return isinstance(e, RuntimeError) and any(f in str(e) for f in _COMM_FAILURE)


class CommFailure(RuntimeError):
    """A communication failure with what was in progress prepended (``named``)."""


@contextlib.contextmanager
def named(what: str):
    """Re-raise a communication failure inside as ``CommFailure("<what>: <first line of the error>")``."""
    try:
        yield
    except RuntimeError as e:
        if not is_comm_failure(e):
            raise
        raise CommFailure(f"{what}: {str(e).splitlines()[0]}") from e
