"""Simulate and check a pipeline schedule (a ``Schedule`` or any ``list[list[Action]]``, one list per rank).

``simulate(schedule, costs)`` runs every rank's list in order and returns each action's start/end,
the makespan, per-rank bubble and peak live activations. While it runs it checks the schedule and
raises ``ScheduleError`` (with the rank, the action's position and what is wrong) when
  - a compute action runs before its inputs: F(mb, s) needs F(mb, s-1) earlier on the same rank or an
    earlier RECV of that activation; B/BW(mb, s) needs F(mb, s) earlier on the same rank and the
    gradient of (mb, s+1) (local or received); W(mb, s) needs B(mb, s) earlier on the same rank;
  - a SEND ships something its rank has not produced, or is never received; a RECV is not matched by
    exactly one SEND with the same (payload, mb, stage) from its peer;
  - the transfers between two ranks are not FIFO-consistent: sends and receives pair in issue order per
    ordered rank pair, as NCCL pairs them (it ignores tags), so the k-th RECV that rank b posts from
    rank a must be for the same (payload, mb, stage) as the k-th SEND a posts to b;
  - the ranks stop making progress (deadlock: every unfinished rank waits on a RECV no one sends);
  - some (mb, stage) does not get exactly one F and either one B and one W, or one BW.

Timing model. Compute actions take their cost from ``Costs``; F&B takes ``costs.fb`` (default F + BW,
i.e. no overlap; set it lower to model overlap). A SEND takes no time and never blocks its rank; a
RECV completes at max(now, time of the matching SEND + ``costs.p2p``), the matching SEND being the next
unmatched one from its peer (FIFO). This is the contract for the executor too: sends must not hold up the
sender's compute; only a RECV waits (under rendezvous semantics the DualPipe lists as placed here can deadlock).

Bubble: the idle time of a rank between the start of its first compute action and the end of its
last, ``span - busy`` (idle while waiting on a RECV counts, the start-up delay of a rank whose first
input arrives late does not). The schedule's bubble, the number the report's table gives, is the
largest per-rank bubble (on rank 0 for every schedule here: ``makespan - busy(rank 0)``). The table's
formulas (``table_bubble``) hold exactly under its cost model: p2p = 0, W <= F, and for DualPipe/DualPipeV
also F = b and F&B = F + B. With overlap (F&B < F + B) the simulated DualPipe bubble is smaller than the
formula by (PP/2-2)(F+B-F&B): the simulation also credits the overlap of the F&Bs on the critical path
through the other ranks.

Activations: a forward's activation is live from the start of its F until the end of the backward
that consumes it (B for zero-bubble, BW otherwise); the inputs a deferred W keeps are not counted. In
an F&B both the new activation and the one being freed are live for the whole action.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .schedules.actions import Action, Kind, Payload
from .schedules.schedule import count_stages


class ScheduleError(ValueError):
    pass


@dataclass(frozen=True)
class Costs:
    f: float = 1.0           # forward of one stage (chunk)
    b: float = 1.0           # input-gradient backward (zero-bubble B)
    w: float = 1.0           # weight-gradient backward
    bw: float | None = None  # full backward; default b + w
    fb: float | None = None  # overlapped forward + full backward; default f + bw (no overlap)
    p2p: float = 0.0         # latency of one transfer

    def of_bw(self) -> float:
        return self.b + self.w if self.bw is None else self.bw

    def of_fb(self) -> float:
        return self.f + self.of_bw() if self.fb is None else self.fb

    def of(self, a: Action) -> float:
        return {Kind.F: self.f, Kind.B: self.b, Kind.W: self.w, Kind.BW: self.of_bw(),
                Kind.FB: self.of_fb()}.get(a.kind, 0.0)


@dataclass(frozen=True)
class Span:
    action: Action
    start: float
    end: float


@dataclass
class Simulation:
    spans: list[list[Span]]      # per rank, every action in list order (RECV: posted -> data arrived)
    makespan: float
    busy: list[float]            # compute time per rank
    bubble: list[float]          # per rank: span of its actions minus busy
    peak_activations: list[int]  # per rank

    @property
    def max_bubble(self) -> float:
        return max(self.bubble)


@dataclass
class _Rank:
    actions: list[Action]
    pos: int = 0
    time: float = 0.0
    spans: list[Span] = field(default_factory=list)
    fwd: set = field(default_factory=set)    # (mb, stage) forwards done here
    bwd: set = field(default_factory=set)    # (mb, stage) backwards (B or BW) done here
    split: set = field(default_factory=set)  # (mb, stage) zero-bubble Bs waiting for their W
    got: set = field(default_factory=set)    # (payload, mb, stage) received here


def simulate(schedule: Sequence[Sequence[Action]], costs: Costs = Costs(),
             n_microbatches: int | None = None) -> Simulation:
    """Time and check ``schedule``; raises ``ScheduleError`` on the first problem (see module doc).
    ``n_microbatches``: also require micro-batches 0..n-1 (default: up to the largest one seen)."""
    sim = _Simulator(schedule, costs)
    sim.run()
    sim.check_transfers()
    sim.check_complete(n_microbatches)
    return sim.result()


class _Simulator:
    """The state of one simulation: every rank's progress and the transfers posted so far."""

    def __init__(self, schedule: Sequence[Sequence[Action]], costs: Costs):
        self.ranks = [_Rank(list(a)) for a in schedule]
        self.costs = costs
        self.n_stages = count_stages(schedule)
        self.posted: dict[tuple, float] = {}  # (kind, payload, mb, stage, src, dst) -> time the op was posted
        self.queued: dict[tuple[int, int], list[tuple[tuple, float]]] = {}   # (src, dst) -> SENDs in issue order
        self.received: dict[tuple[int, int], int] = {}                        # (src, dst) -> RECVs matched so far
        self.done = {Kind.F: {}, Kind.B: {}, Kind.W: {}, Kind.BW: {}}  # (mb, stage) -> rank

    def fail(self, r: int, msg: str):
        st = self.ranks[r]
        raise ScheduleError(f"rank {r}, action {st.pos} ({st.actions[st.pos]}): {msg}")

    def run(self) -> None:
        """Advance the ranks until all are done; a deadlock is an error."""
        progress = True
        while progress:
            progress = False
            for r, st in enumerate(self.ranks):
                while st.pos < len(st.actions) and self.step(r):
                    progress = True
        stuck = [r for r, st in enumerate(self.ranks) if st.pos < len(st.actions)]
        if stuck:
            waits = "; ".join(f"rank {r} at action {self.ranks[r].pos} ({self.ranks[r].actions[self.ranks[r].pos]})"
                              for r in stuck)
            raise ScheduleError(f"deadlock: no rank can make progress; waiting: {waits}")

    def step(self, r: int) -> bool:
        """Advance rank r by one action; False if it waits on a RECV whose SEND has not been posted."""
        st = self.ranks[r]
        a = st.actions[st.pos]
        if a.is_compute:
            self.compute(r, a)
            return True
        sent_at = self.matching_send(r, a) if a.kind is Kind.RECV else None
        if a.kind is Kind.RECV and sent_at is None:
            return False
        self.post(r, a)
        end = st.time if a.kind is Kind.SEND else max(st.time, sent_at + self.costs.p2p)
        if a.kind is Kind.RECV:
            self.received[a.peer, r] = self.received.get((a.peer, r), 0) + 1
            st.got.add((a.payload, a.mb, a.stage))
        st.spans.append(Span(a, st.time, end))
        st.time, st.pos = end, st.pos + 1
        return True

    def compute(self, r: int, a: Action) -> None:
        st = self.ranks[r]
        for p in a.parts():
            self.check_inputs(r, p)
            ms = (p.mb, p.stage)
            self.done[p.kind][ms] = r
            if p.kind is Kind.F:
                st.fwd.add(ms)
            elif p.kind in (Kind.B, Kind.BW):
                st.bwd.add(ms)
            if p.kind is Kind.B:
                st.split.add(ms)
            elif p.kind is Kind.W:
                st.split.discard(ms)
        end = st.time + self.costs.of(a)
        st.spans.append(Span(a, st.time, end))
        st.time, st.pos = end, st.pos + 1

    def check_inputs(self, r: int, p: Action) -> None:
        """Compute part ``p`` on rank r runs once and after its inputs."""
        st, done, ms = self.ranks[r], self.done, (p.mb, p.stage)
        backward = p.kind in (Kind.B, Kind.BW)
        prior = done[Kind.B].get(ms, done[Kind.BW].get(ms)) if backward else done[p.kind].get(ms)
        if prior is not None:
            self.fail(r, f"second {'backward' if backward else p.kind.value} of micro-batch "
                         f"{p.mb} stage {p.stage} (the first ran on rank {prior})")
        if p.kind is Kind.F and p.stage > 0 and (p.mb, p.stage - 1) not in st.fwd \
                and (Payload.ACT, p.mb, p.stage - 1) not in st.got:
            self.fail(r, f"F of micro-batch {p.mb} stage {p.stage} before its input: no earlier F of stage "
                         f"{p.stage - 1} on this rank and no RECV of that activation (missing send/recv?)")
        if backward:
            if ms not in st.fwd:
                self.fail(r, f"backward of micro-batch {p.mb} stage {p.stage} before its F on this rank")
            if p.stage < self.n_stages - 1 and (p.mb, p.stage + 1) not in st.bwd \
                    and (Payload.GRAD, p.mb, p.stage + 1) not in st.got:
                self.fail(r, f"backward of micro-batch {p.mb} stage {p.stage} before the gradient of stage "
                             f"{p.stage + 1} (no earlier backward on this rank, no RECV; missing send/recv?)")
        if p.kind is Kind.W and ms not in st.split:
            self.fail(r, f"W of micro-batch {p.mb} stage {p.stage} without an earlier B on this rank")

    def post(self, r: int, a: Action) -> None:
        st = self.ranks[r]
        src, dst = (r, a.peer) if a.kind is Kind.SEND else (a.peer, r)
        k = (a.kind, a.payload, a.mb, a.stage, src, dst)
        if k in self.posted:
            self.fail(r, "the same transfer is posted twice")
        if a.kind is Kind.SEND and (a.mb, a.stage) not in (st.fwd if a.payload is Payload.ACT else st.bwd):
            self.fail(r, f"SEND of {a.payload.value} of micro-batch {a.mb} stage {a.stage} before it is computed here")
        self.posted[k] = st.time
        if a.kind is Kind.SEND:
            self.queued.setdefault((r, a.peer), []).append((k, st.time))

    def matching_send(self, r: int, a: Action) -> float | None:
        """Post time of the SEND a RECV pairs with under FIFO (None: not posted yet); a FIFO violation
        (that SEND carries another tensor) is an error."""
        stream, k = self.queued.get((a.peer, r), []), self.received.get((a.peer, r), 0)
        if k >= len(stream):
            return None
        (_, payload, mb, stage, _, _), t = stream[k]
        if (payload, mb, stage) != (a.payload, a.mb, a.stage):
            self.fail(r, f"FIFO violation: this is RECV #{k} from rank {a.peer}, but rank {a.peer}'s SEND #{k} to "
                         f"rank {r} is {payload.value} of micro-batch {mb} stage {stage}; NCCL pairs them in issue "
                         f"order (tags are ignored), so the tensors would be swapped or the ranks would hang")
        return t

    def check_transfers(self) -> None:
        """Every SEND has its RECV and every RECV its SEND."""
        posted = self.posted
        unmatched = [k for k in posted if (Kind.RECV if k[0] is Kind.SEND else Kind.SEND, *k[1:]) not in posted]
        if unmatched:
            kind, payload, mb, stage, src, dst = unmatched[0]
            raise ScheduleError(f"{kind.value} of {payload.value} of micro-batch {mb} stage {stage} from rank {src} "
                                f"to rank {dst} has no matching {'RECV' if kind is Kind.SEND else 'SEND'} "
                                f"({len(unmatched)} unmatched)")

    def check_complete(self, n_microbatches: int | None) -> None:
        """Every (mb, stage) has one F and one BW, or one B and one W."""
        done = self.done
        n_mb = n_microbatches if n_microbatches is not None else 1 + max((mb for mb, _ in done[Kind.F]), default=-1)
        for mb in range(n_mb):
            for s in range(self.n_stages):
                ms = (mb, s)
                if ms not in done[Kind.F] or not (ms in done[Kind.BW] or (ms in done[Kind.B] and ms in done[Kind.W])):
                    have = [k.value for k in done if ms in done[k]] or ["nothing"]
                    raise ScheduleError(f"micro-batch {mb} stage {s} needs one F and one BW (or one B and one W); "
                                        f"it has {', '.join(have)}")

    def result(self) -> Simulation:
        busy, bubble, peak = [], [], []
        for st in self.ranks:
            work = [s for s in st.spans if s.action.is_compute]
            busy.append(sum(s.end - s.start for s in work))
            bubble.append((work[-1].end - work[0].start - busy[-1]) if work else 0.0)
            peak.append(peak_live(work))
        makespan = max((st.time for st in self.ranks), default=0.0)
        return Simulation([st.spans for st in self.ranks], makespan, busy, bubble, peak)


def peak_live(spans: Sequence[Span], weight: Callable[[int], float] = lambda stage: 1,
              held: Callable[[int], float] = lambda stage: 0) -> float:
    """The most activations one rank holds at once (module doc), each weighted by ``weight(stage)``; a B frees
    its stage's activations but keeps ``held(stage)`` until the matching W (the deferred weight-gradient
    GEMMs' operands, ``parallel/wgrad.py``)."""
    live = top = 0
    for span in spans:
        if not span.action.is_compute:
            continue
        parts = span.action.parts()
        live += sum(weight(p.stage) for p in parts if p.kind is Kind.F)
        top = max(top, live)
        live += sum(held(p.stage) for p in parts if p.kind is Kind.B)
        top = max(top, live)
        live -= sum(weight(p.stage) for p in parts if p.kind in (Kind.B, Kind.BW))
        live -= sum(held(p.stage) for p in parts if p.kind is Kind.W)
    return top


def table_bubble(name: str, pp: int, costs: Costs) -> float:
    """The bubble the report's table predicts for schedule ``name`` on ``pp`` ranks, with B the full
    backward (b + w) and F&B ``costs.fb`` (default F + B). DualPipeV on pp ranks is the table's
    DualPipeV row with PP = 2*pp stages (PP/2 devices): (pp-1)(F&B+B-3W)."""
    c, full, fb = costs, costs.of_bw(), costs.of_fb()
    formulas = {
        "1f1b": lambda: (pp - 1) * (c.f + full),
        "zb1p": lambda: (pp - 1) * (c.f + full - 2 * c.w),
        "dualpipe": lambda: (pp / 2 - 1) * (fb + full - 3 * c.w),
        "dualpipev": lambda: (pp - 1) * (fb + full - 3 * c.w),
    }
    if name not in formulas:
        raise ValueError(f"schedule ({name!r}) must be one of {sorted(formulas)}")
    return formulas[name]()
