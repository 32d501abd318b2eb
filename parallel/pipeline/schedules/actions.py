"""The action vocabulary shared by every pipeline schedule, the simulator and the executor.

A schedule is one ordered list of actions per pipeline rank (``schedule.Schedule`` holds them). A rank
runs its list top to bottom; nothing else decides order. Compute actions name the micro-batch, the
*global* stage whose module runs, and the *chunk* (which of the rank's modules: 0, or 1 for the second
module that DualPipe/DualPipeV place on every rank). Communication actions name the peer rank and the payload.

Kinds (costs in the simulator are in brackets):
  F    forward of one stage for one micro-batch                                  [f]
  B    backward for the input gradient only (zero-bubble split); its W comes later [b]
  W    backward for the weight gradient of an earlier B                          [w]
  BW   full backward, B and W together                                           [b + w]
  FB   "F&B": a forward and a full backward (BW) of two different micro-batches
       (or chunks) run as one overlapped action; ``mb/stage/chunk`` describe the
       forward half and ``bwd`` is the backward half (an ``Action`` of kind BW)   [fb, default f + b + w]
  SEND / RECV  point-to-point transfer of ``payload`` with rank ``peer``.

Communication convention: ``stage`` on SEND and RECV is the stage that *produced* the tensor, so both
ends of one transfer carry the same ``(payload, mb, stage)``:
  ACT  the output of F(mb, stage), consumed by F(mb, stage + 1) on ``peer``;
  GRAD the input gradient from B/BW(mb, stage), consumed by the backward of (mb, stage - 1).
``chunk`` on a SEND is the sending module, on a RECV the module that will consume the tensor.
Transfers between two stages on the same rank (DualPipeV's turn of the V, the loss on the last stage)
are local and have no actions.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    FB = "F&B"
    SEND = "SEND"
    RECV = "RECV"


class Payload(str, Enum):
    ACT = "act"    # forward activation, flows to the next stage
    GRAD = "grad"  # gradient w.r.t. that activation, flows back to the previous stage


COMPUTE = (Kind.F, Kind.B, Kind.W, Kind.BW, Kind.FB)
COMM = (Kind.SEND, Kind.RECV)


@dataclass(frozen=True)
class Action:
    kind: Kind
    mb: int                        # micro-batch index, 0..n_microbatches-1
    stage: int                     # global stage index (for SEND/RECV: the producing stage)
    chunk: int = 0                 # which of the rank's stage modules (0 or 1)
    peer: int | None = None        # SEND/RECV: the other rank
    payload: Payload | None = None  # SEND/RECV: ACT or GRAD
    bwd: Action | None = None      # FB: the overlapped backward half (kind BW)

    def __post_init__(self):
        if (self.kind in COMM) != (self.peer is not None and self.payload is not None):
            raise ValueError(f"{self.kind.value}: peer and payload are required exactly for SEND/RECV")
        if (self.kind is Kind.FB) != (self.bwd is not None):
            raise ValueError(f"{self.kind.value}: bwd is required exactly for F&B")
        if self.bwd is not None and self.bwd.kind is not Kind.BW:
            raise ValueError(f"F&B: bwd must be a BW action, got {self.bwd.kind.value}")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    def parts(self) -> tuple[Action, ...]:
        """The compute halves: (F, BW) for an F&B, the action itself otherwise."""
        if self.kind is Kind.FB:
            return (Action(Kind.F, self.mb, self.stage, self.chunk), self.bwd)
        return (self,)

    def __str__(self) -> str:
        if self.kind is Kind.FB:
            return f"F{self.mb}.{self.chunk}&B{self.bwd.mb}.{self.bwd.chunk}"
        if self.kind in COMM:
            arrow = "->" if self.kind is Kind.SEND else "<-"
            return f"{self.kind.value.lower()} {self.payload.value} mb{self.mb} s{self.stage} {arrow} r{self.peer}"
        return f"{self.kind.value}{self.mb}.{self.chunk}"


def fb(fwd: Action, bwd: Action) -> Action:
    """Overlapped F&B from a forward action and a full-backward (BW) action."""
    return Action(Kind.FB, fwd.mb, fwd.stage, fwd.chunk, bwd=bwd)


def add_p2p(compute: list[list[Action]]) -> list[list[Action]]:
    """Insert SEND/RECV actions around compute-only rank lists, FIFO-consistent per rank pair.

    Each SEND goes right after the action that produced its tensor (sends are asynchronous: they never
    hold up the sender, see the simulator), so rank a's sends to rank b leave in production order. NCCL
    pairs the k-th send a -> b with the k-th receive b <- a whatever the tags, so b must post its receives
    from a in exactly that order. A receive is therefore placed right before the first compute action
    on b that needs it *or any later item of the same a -> b stream*: as late as possible without
    overtaking an item that a sends after it. Receiving early never delays anything: the later item
    that forces it is consumed there and was sent after it. Compute order is left exactly as given.
    Which rank runs a (mb, stage) is read off the compute lists themselves.
    """
    sends_after, streams, consumer = _sends(compute)
    recvs_before = _recvs(compute, streams, consumer)
    out: list[list[Action]] = []
    for rank, actions in enumerate(compute):
        seq: list[Action] = []
        for i, a in enumerate(actions):
            seq += recvs_before[rank][i] + [a] + sends_after[rank][i]
        out.append(seq)
    return out


def _producers(compute: list[list[Action]]) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int]]:
    """``(mb, stage) -> rank`` of its forward and of its backward (B or BW)."""
    fwd_rank: dict[tuple[int, int], int] = {}
    bwd_rank: dict[tuple[int, int], int] = {}
    for rank, actions in enumerate(compute):
        for a in actions:
            for p in a.parts():
                if p.kind is Kind.F:
                    fwd_rank[p.mb, p.stage] = rank
                elif p.kind in (Kind.B, Kind.BW):
                    bwd_rank[p.mb, p.stage] = rank
    return fwd_rank, bwd_rank


def _sends(compute: list[list[Action]]):
    """The SENDs after each compute action (per rank, per index), the sends of each ``(src, dst)``
    stream in issue order, and ``(dst, payload, mb, stage) -> index`` of the compute action on dst
    that consumes a received tensor."""
    fwd_rank, bwd_rank = _producers(compute)
    sends_after: list[list[list[Action]]] = [[[] for _ in actions] for actions in compute]
    streams: dict[tuple[int, int], list[Action]] = {}   # (src, dst) -> sends in issue order
    consumer: dict[tuple[int, Payload, int, int], int] = {}   # (dst, payload, mb, stage) -> compute index
    for rank, actions in enumerate(compute):
        for i, a in enumerate(actions):
            for p in a.parts():
                if p.kind is Kind.F:
                    src = fwd_rank.get((p.mb, p.stage - 1), rank)
                    dst = fwd_rank.get((p.mb, p.stage + 1), rank)
                    payload, received, sent = Payload.ACT, p.stage - 1, p.stage
                elif p.kind in (Kind.B, Kind.BW):
                    src = bwd_rank.get((p.mb, p.stage + 1), rank)
                    dst = bwd_rank.get((p.mb, p.stage - 1), rank)
                    payload, received, sent = Payload.GRAD, p.stage + 1, p.stage
                else:
                    continue
                if src != rank:
                    consumer[rank, payload, p.mb, received] = i
                if dst != rank:
                    send = Action(Kind.SEND, p.mb, sent, p.chunk, dst, payload)
                    sends_after[rank][i].append(send)
                    streams.setdefault((rank, dst), []).append(send)
    return sends_after, streams, consumer


def _recvs(compute: list[list[Action]], streams: dict[tuple[int, int], list[Action]],
           consumer: dict[tuple[int, Payload, int, int], int]) -> list[list[list[Action]]]:
    """The RECVs before each compute action: each stream's receives in its send order, each posted no
    later than any later item of that stream is needed."""
    recvs_before: list[list[list[Action]]] = [[[] for _ in actions] for actions in compute]
    chunk_of = {(r, p.mb, p.stage): p.chunk for r, actions in enumerate(compute) for a in actions for p in a.parts()}
    for (src, dst), sends in sorted(streams.items()):
        at = [consumer[dst, s.payload, s.mb, s.stage] for s in sends]
        for k in range(len(at) - 2, -1, -1):
            at[k] = min(at[k], at[k + 1])
        for s, i in zip(sends, at):
            consumer_stage = s.stage + 1 if s.payload is Payload.ACT else s.stage - 1
            chunk = chunk_of[dst, s.mb, consumer_stage]
            recvs_before[dst][i].append(Action(Kind.RECV, s.mb, s.stage, chunk, src, s.payload))
    return recvs_before


def p2p_streams(schedule: list[list[Action]]) -> dict[tuple[int, int], tuple[list[Action], list[Action]]]:
    """``(a, b) -> (SENDs a -> b, RECVs b <- a)``, each in issue order, for every ordered rank pair that
    communicates. FIFO consistency (what NCCL needs) is ``sends[k]`` and ``recvs[k]`` naming the same
    ``(payload, mb, stage)`` for every k."""
    out: dict[tuple[int, int], tuple[list[Action], list[Action]]] = {}
    for rank, actions in enumerate(schedule):
        for a in actions:
            if a.kind is Kind.SEND:
                out.setdefault((rank, a.peer), ([], []))[0].append(a)
            elif a.kind is Kind.RECV:
                out.setdefault((a.peer, rank), ([], []))[1].append(a)
    return out


def check_counts(name: str, arg: str, value: int, minimum: int = 1, bound: str = "", even: bool = False) -> None:
    """Precondition check whose message names the argument and prints the values, e.g.
    ``dualpipe: n_microbatches (6) must be >= 2*pp (8)``."""
    if value < minimum:
        raise ValueError(f"{name}: {arg} ({value}) must be >= {f'{bound} ({minimum})' if bound else minimum}")
    if even and value % 2:
        raise ValueError(f"{name}: {arg} ({value}) must be even")
