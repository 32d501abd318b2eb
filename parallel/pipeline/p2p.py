"""Point-to-point transfers between pipeline ranks, under NCCL's rules.

NCCL ignores tags: between two ranks, the k-th send is paired with the k-th receive, whatever either
side meant by it. So correctness here never depends on a tag (every transfer uses tag 0); it depends on
the schedule's placement, which ``schedules.actions.add_p2p`` makes FIFO-consistent and the simulator
checks (the k-th SEND a -> b and the k-th RECV b <- a carry the same (payload, micro-batch, stage)).

**One channel per direction.** Each ordered pair of adjacent pipeline ranks (a -> b) gets its own
two-rank process group, used only for a's sends to b and b's receives from a. Torch's NCCL p2p runs on one
CUDA stream per rank pair (or group), in order; with one channel for both directions, a receive posted early
(``add_p2p`` forces some) would sit in front of a later send to the same peer while the peer's stream holds
its own receive in front of the send we wait for: a deadlock that gloo never shows. With a channel per
direction the only order that matters is the FIFO order the schedule already guarantees.

**NCCL-strict mode** (``DSV3_NCCL_STRICT=1``; the test suite sets it): every transfer is preceded on
its channel by a small header naming what the sender meant to send ((payload, micro-batch, stage),
dtype, shape). The receiver checks it against what it expected and raises, naming both ranks and
both transfers, instead of silently using a swapped tensor (same shapes) or hanging (different shapes)
as NCCL would. It costs one extra tiny message per transfer, so it is off by default.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..errors import P2PError, named

STRICT_ENV = "DSV3_NCCL_STRICT"

# Header: [magic, kind, mb, stage, dtype code, ndim, shape (up to 4 dims, zero-padded)]
_MAGIC = 0x5EED
_KINDS = ("act", "grad", "eval")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_HEADER = 10


def strict_from_env() -> bool:
    return os.environ.get(STRICT_ENV, "0") not in ("", "0", "false", "False")


class PipeChannels:
    """This rank's directional channels to its pipeline neighbours (from ``ParallelDims``'s groups
    ``pp_send`` / ``pp_recv``: pipeline rank of the peer -> (group, global rank of the peer))."""

    def __init__(self, dims, strict: bool | None = None):
        self.dims = dims
        self.pp_rank = dims.pp_rank
        self.send_to = dims.group("pp_send")
        self.recv_from = dims.group("pp_recv")
        self.strict = strict_from_env() if strict is None else strict

    # ---- the two operations --------------------------------------------------------------------
    def isend(self, t: torch.Tensor, peer: int, what: tuple[str, int, int]):
        """Start sending ``t`` to pipeline rank ``peer``; ``what`` = (payload, micro-batch, stage) names it
        in errors (and, in strict mode, on the wire). Keep ``t`` alive until the returned work is done."""
        group, dst = self._channel(self.send_to, peer, "send to")
        if self.strict:
            header = _encode(what, t)
            # the header is small and fire-and-forget: returned with the payload's work so both stay alive
            hw = dist.isend(header, dst=dst, group=group)
            return _Both(hw, header, dist.isend(t, dst=dst, group=group))
        return dist.isend(t, dst=dst, group=group)

    def recv(self, buf: torch.Tensor, peer: int, what: tuple[str, int, int]) -> torch.Tensor:
        """Receive the next transfer from pipeline rank ``peer`` into ``buf``; waits (on CUDA: the current
        stream waits, the host does not) and returns ``buf``."""
        group, src = self._channel(self.recv_from, peer, "receive from")
        with named(f"receiving {what[0]} of micro-batch {what[1]} stage {what[2]} from pipeline rank {peer} "
                   f"(global {src}, channel pp {peer}->{self.pp_rank})"):
            return self._recv(buf, group, src, peer, what)

    def _recv(self, buf: torch.Tensor, group, src: int, peer: int, what: tuple[str, int, int]) -> torch.Tensor:
        if self.strict:
            header = torch.empty(_HEADER, dtype=torch.int64, device=buf.device)
            dist.irecv(header, src=src, group=group).wait()
            got = _decode(header)
            want = (what[0], what[1], what[2], buf.dtype, tuple(buf.shape))
            if got != want:
                raise P2PError(
                    f"NCCL-strict p2p: pipeline rank {self.pp_rank} (global {dist.get_rank()}) expected "
                    f"{_describe(want)} as its next transfer from pipeline rank {peer} (global {src}), but that "
                    f"rank sent {_describe(got)}. Sends and receives between two ranks pair in issue order "
                    f"(NCCL ignores tags): the schedule's SEND/RECV placement is not FIFO-consistent "
                    f"(check it with parallel.pipeline.simulator.simulate)")
        dist.irecv(buf, src=src, group=group).wait()
        return buf

    def _channel(self, table: dict, peer: int, verb: str):
        if peer not in table:
            raise P2PError(f"pipeline rank {self.pp_rank} cannot {verb} pipeline rank {peer}: channels exist only "
                           f"between adjacent pipeline ranks ({sorted(table)})")
        return table[peer]


class _Both:
    """Work of a header + payload pair; keeps the header tensor alive until both are done."""

    def __init__(self, header_work, header: torch.Tensor, work):
        self.header_work, self.header, self.work = header_work, header, work

    def wait(self) -> bool:
        self.header_work.wait()
        return self.work.wait()


def _encode(what: tuple[str, int, int], t: torch.Tensor) -> torch.Tensor:
    if t.dim() > _HEADER - 6:
        raise P2PError(f"NCCL-strict p2p: tensors of up to {_HEADER - 6} dims, got shape {tuple(t.shape)}")
    dtype = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else -1
    vals = [_MAGIC, _KINDS.index(what[0]), what[1], what[2], dtype, t.dim(), *t.shape]
    vals += [0] * (_HEADER - len(vals))
    return torch.tensor(vals, dtype=torch.int64, device=t.device)


def _decode(h: torch.Tensor) -> tuple:
    v = h.tolist()   # strict mode is a debugging mode: this host sync is accepted there
    if v[0] != _MAGIC:
        return ("<not a header: the peer sent a payload where a header was due>", -1, -1, None, ())
    kind = _KINDS[v[1]] if 0 <= v[1] < len(_KINDS) else f"kind {v[1]}"
    dtype = _DTYPES[v[4]] if 0 <= v[4] < len(_DTYPES) else None
    return (kind, v[2], v[3], dtype, tuple(v[6:6 + v[5]]))


def _describe(x: tuple) -> str:
    kind, mb, stage, dtype, shape = x
    return f"{kind} of micro-batch {mb} stage {stage} ({str(dtype).replace('torch.', '')} {list(shape)})"
