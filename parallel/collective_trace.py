"""Collective-order trace: check that every rank of every process group issues the group's collectives
in the same order, with matching shapes — NCCL's rule, which gloo only partly enforces.

On NCCL, two ranks of a communicator that issue its collectives in different orders deadlock, or,
worse, silently reduce or exchange the wrong tensors when the shapes agree. With F&B overlap,
hierarchical EP, ZeRO buckets and DualPipe replicas all issuing collectives on overlapping groups, the
order is easy to break and hard to see. ``CollectiveTrace`` records, per rank, every
``torch.distributed`` collective and point-to-point call made inside it — (group, op, reduce op, dtypes
and shapes, all-to-all splits, p2p peer, and the calling line) — then ``check()`` gathers the records
and compares them group by group, raising ``CollectiveOrderError`` at the first divergence:

  * collectives: the i-th call on a group must be the same op with the same dtypes and shapes on every
    member (uneven all-to-alls: same dtype and row shape, and rank a's input split for b equal to
    b's output split for a);
  * point-to-point: on each group, the k-th send a -> b must match the k-th receive b <- a in dtype and
    shape (NCCL pairs them in issue order).

Enable it in the trainer with the environment variable ``DSV3_TRACE_COLLECTIVES=<step>`` (the optimizer
step to trace, counting from 1). Each rank also appends its records as it goes to
``<run dir>/collective_trace/rank<r>.jsonl``, so that after a hang (which never reaches ``check()``) the
files can be compared offline: ``python -m tools.collective_trace <run dir>/collective_trace``.

Calls through ``torch.distributed``'s module attributes are seen (``dist.all_reduce``, also from
DeepSpeed's comm layer); functional collectives, DTensor redistribution and checkpoint I/O are not, nor calls
from other threads than the one that entered the trace (a background checkpoint write issues its own, on its own
group, whenever it gets there).
"""
from __future__ import annotations

import inspect
import json
import os
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

ENV = "DSV3_TRACE_COLLECTIVES"

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
               "all_to_all_single", "broadcast", "broadcast_object_list", "reduce", "gather", "gather_object",
               "scatter", "scatter_object_list", "barrier", "all_reduce_coalesced")
P2P = ("isend", "irecv", "send", "recv")
UNEVEN = ("all_to_all_single", "all_to_all")   # per-rank sizes may differ; splits must agree instead


class CollectiveOrderError(RuntimeError):
    pass


def step_from_env() -> int | None:
    """The step to trace from ``DSV3_TRACE_COLLECTIVES`` (None when unset or 0)."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{ENV}={value!r}: expected the optimizer step to trace (an integer >= 1), or 0/unset")
    return int(value) or None


@dataclass
class Call:
    group: str          # torch's group name: the same on every member (groups are created in one order)
    op: str
    tensors: list       # [(dtype, shape)] of the tensor arguments, in argument order
    reduce: str = ""    # reduce op of reductions
    splits: list | None = None   # all_to_all_single: [output_split_sizes, input_split_sizes]
    peer: int = -1      # p2p: the other rank (global)
    where: str = ""     # file:line of the caller outside torch

    def signature(self) -> tuple:
        """What must be equal on every member (uneven all-to-alls: row shapes only)."""
        return (self.op, self.reduce, [(d, tuple(s)[1:] if self.op in UNEVEN else tuple(s)) for d, s in self.tensors])

    def describe(self) -> str:
        shapes = ", ".join(f"{d} {list(s)}" for d, s in self.tensors)
        extra = f" {self.reduce}" if self.reduce else ""
        peer = f" peer {self.peer}" if self.peer >= 0 else ""
        return f"{self.op}{extra}{peer} ({shapes}) at {self.where}"


class CollectiveTrace:
    """Context manager: records this rank's collectives while active (see the module docstring).

    ``labels`` maps process groups to readable names (``ParallelDims.groups`` gives them); ``log_dir``,
    if given, receives ``rank<r>.jsonl`` written as the calls happen."""

    def __init__(self, labels: dict[Any, str] | None = None, log_dir: str | Path | None = None):
        self.rank = dist.get_rank()
        self.calls: list[Call] = []
        self.members: dict[str, list[int]] = {}
        self.labels = {_group_name(g): name for g, name in (labels or {}).items()}
        self.log = None
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            self.log = open(Path(log_dir) / f"rank{self.rank}.jsonl", "w")
        self._saved: dict[str, Any] = {}
        self._thread: int | None = None

    # ---- recording ---------------------------------------------------------------------------------
    def __enter__(self) -> CollectiveTrace:
        self._thread = threading.get_ident()
        for name in COLLECTIVES + P2P:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()
        if self.log is not None:
            self.log.flush()

    def _wrap(self, name: str, fn):
        sig = inspect.signature(fn)

        def traced(*args, **kwargs):
            if threading.get_ident() == self._thread:
                bound = sig.bind(*args, **kwargs)
                bound.apply_defaults()
                self._record(name, bound.arguments)
            return fn(*args, **kwargs)
        traced.__wrapped__ = fn
        return traced

    def _record(self, op: str, args: dict) -> None:
        group = args.get("group") or dist.group.WORLD
        gname = _group_name(group)
        if gname not in self.members:
            self.members[gname] = dist.get_process_group_ranks(group)
        tensors = [(str(t.dtype).replace("torch.", ""), tuple(t.shape)) for t in _tensors(args)]
        call = Call(gname, op, tensors, where=_caller())
        if isinstance(args.get("op"), dist.ReduceOp.RedOpType):
            call.reduce = str(args["op"]).split(".")[-1]
        if op == "all_to_all_single":
            call.splits = [_sizes(args.get("output_split_sizes")), _sizes(args.get("input_split_sizes"))]
        if op in P2P:
            peer = args.get("dst", args.get("src"))
            local = args.get("group_dst", args.get("group_src"))
            call.peer = peer if peer is not None else self.members[gname][local]
        self.calls.append(call)
        if self.log is not None:
            self.log.write(json.dumps({"members": self.members[gname], **asdict(call)}) + "\n")
            self.log.flush()

    # ---- checking ----------------------------------------------------------------------------------
    def check(self) -> str:
        """Gather every rank's records (on rank 0), compare them, and raise ``CollectiveOrderError`` on
        every rank at the first divergence. Returns a one-line summary. Call it outside the context."""
        mine = {"calls": [asdict(c) for c in self.calls], "members": self.members, "labels": self.labels}
        gathered = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        verdict = [None]
        if self.rank == 0:
            try:
                verdict[0] = ("ok", compare({r: t for r, t in enumerate(gathered)}))
            except CollectiveOrderError as e:
                verdict[0] = ("error", str(e))
        dist.broadcast_object_list(verdict, src=0)
        status, text = verdict[0]
        if status == "error":
            raise CollectiveOrderError(text)
        return text


def group_labels(dims, extra: dict[str, dict] | None = None) -> dict[Any, str]:
    """Readable names for the groups of ``dims`` (``ParallelDims``): ``ep``, ``dp``, ``pp 0->1`` ...;
    ``extra``: more ``{label: {key: group}}`` tables (e.g. the DualPipe replica groups)."""
    out: dict[Any, str] = {}
    for name, g in dims.groups.items():
        if isinstance(g, dist.ProcessGroup):
            out[g] = name
    for direction in ("pp_send", "pp_recv"):
        for peer, (g, _) in dims.groups.get(direction, {}).items():
            a, b = (dims.pp_rank, peer) if direction == "pp_send" else (peer, dims.pp_rank)
            out[g] = f"pp {a}->{b}"
    for label, table in (extra or {}).items():
        for key, g in table.items():
            out[g] = f"{label} {key}"
    return out


def compare(traces: dict[int, dict]) -> str:
    """``rank -> {"calls": [...], "members": {group: ranks}, "labels": {group: name}}`` -> summary line;
    raises ``CollectiveOrderError`` naming the group, the position and both ranks' calls at the first
    divergence. (Used by ``CollectiveTrace.check`` and ``tools.collective_trace``.)"""
    members: dict[str, list[int]] = {}
    labels: dict[str, str] = {}
    per_group: dict[str, dict[int, list[Call]]] = {}
    for rank, t in sorted(traces.items()):
        members.update(t["members"])
        labels.update(t.get("labels", {}))
        for c in t["calls"]:
            per_group.setdefault(c["group"], {}).setdefault(rank, []).append(Call(**_untuple(c)))
    n = 0
    for g in sorted(per_group, key=lambda g: (len(members[g]), g)):
        ranks = members[g]
        name = f"group {labels.get(g, 'ranks')} {ranks} (torch group {g})"
        colls = {r: [c for c in per_group[g].get(r, []) if c.op not in P2P] for r in ranks}
        n += _compare_collectives(name, ranks, colls, traces)
        n += _compare_p2p(name, ranks, {r: [c for c in per_group[g].get(r, []) if c.op in P2P] for r in ranks})
    return (f"collective trace: {len(traces)} ranks, {len(per_group)} groups, {n} calls; every group's members "
            f"issued the same collectives in the same order, and every p2p send matched its receive")


def _compare_collectives(name: str, ranks: list[int], colls: dict[int, list[Call]], traces) -> int:
    missing = [r for r in ranks if r not in traces]
    if missing:
        raise CollectiveOrderError(f"{name}: no trace from ranks {missing}")
    first = ranks[0]
    longest = max(len(v) for v in colls.values())
    for i in range(longest):
        ref = colls[first][i] if i < len(colls[first]) else None
        for r in ranks[1:]:
            got = colls[r][i] if i < len(colls[r]) else None
            if ref is None or got is None or got.signature() != ref.signature():
                raise CollectiveOrderError(
                    f"{name}: collective #{i} differs: rank {first} {_what(ref)}; rank {r} {_what(got)}. On NCCL "
                    f"this deadlocks or mixes tensors: every member must issue the group's collectives in one order")
        if ref.splits is not None:   # a's input split for b == b's output split for a
            pos = {r: k for k, r in enumerate(ranks)}
            for a in ranks:
                for b in ranks:
                    out_b, in_a = colls[b][i].splits[0], colls[a][i].splits[1]
                    if in_a is not None and out_b is not None and in_a[pos[b]] != out_b[pos[a]]:
                        raise CollectiveOrderError(
                            f"{name}: all_to_all_single #{i}: rank {a} sends {in_a[pos[b]]} rows to rank {b}, "
                            f"which expects {out_b[pos[a]]} ({colls[a][i].where} / {colls[b][i].where})")
    return sum(len(v) for v in colls.values())


def _compare_p2p(name: str, ranks: list[int], calls: dict[int, list[Call]]) -> int:
    n = 0
    for a in ranks:
        for b in ranks:
            sends = [c for c in calls.get(a, []) if c.op in ("isend", "send") and c.peer == b]
            recvs = [c for c in calls.get(b, []) if c.op in ("irecv", "recv") and c.peer == a]
            for k in range(max(len(sends), len(recvs))):
                s = sends[k] if k < len(sends) else None
                r = recvs[k] if k < len(recvs) else None
                if s is None or r is None or s.tensors != r.tensors:
                    raise CollectiveOrderError(
                        f"{name}: p2p #{k} from rank {a} to rank {b}: rank {a} {_what(s, 'sent nothing')}; rank {b} "
                        f"{_what(r, 'received nothing')}. Sends and receives pair in issue order on NCCL")
            n += len(sends) + len(recvs)
    return n


def _what(c: Call | None, none: str = "issued nothing") -> str:
    return none if c is None else c.describe()


def _untuple(c: dict) -> dict:
    return {**c, "tensors": [(d, tuple(s)) for d, s in c["tensors"]]}


def _group_name(group) -> str:
    return (group or dist.group.WORLD).group_name


def _tensors(args: dict) -> Iterable[torch.Tensor]:
    for v in args.values():
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (t for t in v if isinstance(t, torch.Tensor))


def _sizes(splits) -> list[int] | None:
    return None if splits is None else [int(s) for s in splits]


def _caller() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    torch_dir = os.path.dirname(torch.__file__)
    f = sys._getframe(2)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if not path.startswith(torch_dir) and path != os.path.abspath(__file__):
            root = os.path.dirname(here)
            return f"{os.path.relpath(path, root) if path.startswith(root) else path}:{f.f_lineno}"
        f = f.f_back
    return "?"
