"""Collective-order trace (``parallel/collective_trace.py``, ``DSV3_TRACE_COLLECTIVES``): every rank of
every group must issue the group's collectives in one order (NCCL's rule). It passes on the full layout
(DualPipe pp=2 x EP=2 with F&B overlap, ZeRO-1 and FP8 dispatch) and names the first divergence of a
deliberately reordered one."""
import json
import os

import pytest
import torch
import torch.distributed as dist

from parallel.collective_trace import Call, CollectiveOrderError, CollectiveTrace, compare, group_labels
from parallel.dims import ParallelDims

from .dist_utils import spawn
from .trainer_utils import run_torchrun


def _issue(dims, swap: bool):
    """What a step does, in miniature: same-shaped reductions on the EP group, a dp reduction, an uneven
    all-to-all and one pipeline transfer. ``swap``: rank 1 issues the two EP reductions the other way round
    (on gloo both complete — with the wrong data, as on NCCL when shapes agree)."""
    ep = dims.group("ep")
    load, top = torch.ones(8), torch.ones(8)
    pair = [lambda: dist.all_reduce(load, group=ep), lambda: dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ep)]
    for fn in (pair[::-1] if swap and dims.rank == 1 else pair):
        fn()
    dist.all_reduce(torch.zeros(3), group=dims.group("dp"))
    send = torch.arange(2 * (dims.ep_rank + 1), dtype=torch.float32)[:, None].repeat(1, 4)   # rank i: 2(i+1) rows
    out_splits = [j + 1 for j in range(dims.ep)]                                             # j sends me j+1
    recv = torch.empty(sum(out_splits), 4)
    dist.all_to_all_single(recv, send, out_splits, [len(send) // 2] * 2, group=ep)
    if dims.pp_rank == 0:
        g, dst = dims.group("pp_send")[1]
        dist.isend(torch.ones(2, 3), dst=dst, group=g).wait()
    else:
        g, src = dims.group("pp_recv")[0]
        dist.irecv(torch.empty(2, 3), src=src, group=g).wait()


def _worker(rank, world, swap, log_dir):
    dims = ParallelDims(world_size=world, rank=rank, pp=2, ep=2).build_groups()
    original = dist.all_reduce
    with CollectiveTrace(group_labels(dims), log_dir) as trace:
        assert dist.all_reduce is not original
        _issue(dims, swap)
    assert dist.all_reduce is original   # torch.distributed is restored on exit
    if not swap:
        summary = trace.check()
        assert summary.startswith("collective trace: 4 ranks,") and "same order" in summary, summary
        return
    with pytest.raises(CollectiveOrderError) as err:
        trace.check()
    msg = str(err.value)
    assert msg.startswith("group ep [0, 1] (torch group "), msg
    assert "collective #0 differs: rank 0 all_reduce SUM (float32 [8]) at tests/test_collective_trace.py:" in msg
    assert "; rank 1 all_reduce MAX (float32 [8]) at tests/test_collective_trace.py:" in msg


def test_trace_passes_in_order_and_names_the_first_divergence(tmp_path):
    spawn(_worker, 4, tmp_path, False, None)
    spawn(_worker, 4, tmp_path, True, str(tmp_path / "trace"))
    # the per-rank files (what survives a hang) give the same verdict offline
    from tools.collective_trace import main
    assert sorted(os.listdir(tmp_path / "trace")) == [f"rank{r}.jsonl" for r in range(4)]
    assert main([str(tmp_path / "trace")]) == 1


def _call(op, shape, **kw):
    return {"group": "7", "op": op, "tensors": [("float32", shape)], "reduce": kw.get("reduce", ""),
            "splits": kw.get("splits"), "peer": kw.get("peer", -1), "where": kw.get("where", "x.py:1")}


def _traces(per_rank):
    return {r: {"calls": calls, "members": {"7": [0, 1]}} for r, calls in per_rank.items()}


def test_compare_checks_splits_p2p_and_missing_calls():
    ok = {0: [_call("all_to_all_single", (3, 4), splits=[[1, 2], [1, 2]])],
          1: [_call("all_to_all_single", (5, 4), splits=[[2, 3], [2, 3]])]}
    assert "2 calls" in compare(_traces(ok))   # uneven row counts are fine when the splits agree
    bad = {0: ok[0], 1: [_call("all_to_all_single", (5, 4), splits=[[2, 3], [1, 3]])]}
    with pytest.raises(CollectiveOrderError, match=r"all_to_all_single #0: rank 1 sends 1 rows to rank 0, which "
                                                   r"expects 2"):
        compare(_traces(bad))
    short = {0: [_call("barrier", ()), _call("all_reduce", (2,), reduce="SUM", where="opt.py:9")], 1: [_call("barrier", ())]}
    with pytest.raises(CollectiveOrderError, match=r"collective #1 differs: rank 0 all_reduce SUM \(float32 \[2\]\) at "
                                                   r"opt.py:9; rank 1 issued nothing"):
        compare(_traces(short))
    p2p = {0: [_call("isend", (2, 8), peer=1), _call("isend", (2, 8), peer=1)],
           1: [_call("irecv", (2, 8), peer=0), _call("irecv", (2, 4), peer=0)]}
    with pytest.raises(CollectiveOrderError, match=r"p2p #1 from rank 0 to rank 1: rank 0 isend peer 1 \(float32 "
                                                   r"\[2, 8\]\) .*; rank 1 irecv peer 0 \(float32 \[2, 4\]\)"):
        compare(_traces(p2p))
    assert Call(**{**_call("all_reduce", (2,)), "tensors": [("float32", (2,))]}).describe().startswith("all_reduce")


@pytest.mark.slow
def test_trainer_step_traced_on_the_full_layout(tmp_path):
    """pp=2 x EP=2 DualPipe with F&B overlap on, ZeRO-1 and FP8 dispatch: the traced step (with every
    pipeline transfer, expert all-to-all, ZeRO bucket, replica sum and metric reduction) agrees across
    every group; the trace files are written and the offline comparison agrees too."""
    os.environ["DSV3_TRACE_COLLECTIVES"] = "2"
    try:
        run_torchrun(tmp_path, "traced", 4, "parallel.pp=2", "parallel.ep=2", "parallel.schedule=dualpipe",
                     "parallel.overlap=true", "parallel.zero=1", "parallel.fp8_dispatch=true", steps=2)
    finally:
        del os.environ["DSV3_TRACE_COLLECTIVES"]
    log = (tmp_path / "traced" / "collective_trace")
    counts = {}
    for r in range(4):
        calls = [json.loads(line) for line in (log / f"rank{r}.jsonl").read_text().splitlines()]
        counts[r] = {op: sum(c["op"] == op for c in calls) for op in ("all_to_all_single", "isend", "irecv",
                                                                      "all_reduce", "all_gather_single")}
    for r, c in counts.items():   # the step really went through the trace: a2a, p2p, ZeRO, replica sums
        assert c["all_to_all_single"] > 20 and c["isend"] > 0 and c["irecv"] > 0 and c["all_reduce"] > 3, (r, c)
        assert c["all_gather_single"] > 0, (r, c)   # ZeRO-1 parameter all-gather
    from tools.collective_trace import main
    assert main([str(log)]) == 0
