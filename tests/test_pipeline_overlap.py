"""DualPipe's overlapped F&B (``parallel/pipeline/overlap.py``) gives the plain execution's losses and gradients
(fp32) with EP=1 (local, and all-to-all with injected latency), EP=2 inside pp=2 and FP8 dispatch; plus the
interleaving order and the injected-latency deadline."""
import time

import pytest
import torch
import torch.distributed as dist

from bench.latency import Deadline, add_latency
from models import ModelConfig, build
from parallel.dims import ParallelDims
from parallel.ep import AllToAllDispatcher, apply_ep
from parallel.pipeline.executor import PipelineExecutor
from parallel.pipeline.p2p import PipeChannels
from parallel.pipeline.overlap import run, run_pair
from parallel.pipeline.schedules import get_schedule
from parallel.pipeline.schedules.actions import Kind
from parallel.pipeline.stages import build_stages, prune_model

from .dist_utils import rel_err, spawn
from .test_pipeline_parity import CFG, cos_dist


def _cuts(moe, dim) -> int:
    """How many times the layer's forward stops for its dispatcher (drives its steps straight through on a
    small batch, in eval mode under no_grad: no load counted; every rank of the EP group runs it alike)."""
    moe.eval()
    steps, value, n = moe.steps(torch.randn(1, 4, dim, generator=torch.Generator().manual_seed(3))), None, 0
    with torch.no_grad():
        while True:
            try:
                cut = steps.send(value)
            except StopIteration:
                break
            n, value = n + 1, (cut.carry, cut.link(cut.sends))
    moe.train()
    return n


def _run(cfg, dims, schedule, n_mb, mbs, overlap, dispatcher, latency_s):
    model = apply_ep(build(cfg, seed=0).train(), dims, "alltoall" if dispatcher == "alltoall" else "hierarchical")
    if dispatcher in ("solo", "solo-fp8"):   # EP=1 through an all-to-all dispatcher over a one-rank group
        for moe in model.moe_layers():
            moe.dispatcher = AllToAllDispatcher(cfg.n_routed_experts, dims.group("solo"), 1,
                                                fp8=dispatcher == "solo-fp8")
    add_latency(model, latency_s)
    for moe in model.moe_layers():   # every MoE layer is cut at its all-to-alls (none runs as one piece)
        assert _cuts(moe, cfg.dim) >= 2, type(moe.dispatcher)
    sched = get_schedule(schedule, dims.pp, n_mb)
    stages = build_stages(model, sched, dims.pp_rank)
    prune_model(model, stages)
    actions = sched[dims.pp_rank]
    assert any(a.kind is Kind.FB for a in actions)
    ex = PipelineExecutor(stages, actions, PipeChannels(dims), sched.n_stages, cfg.dim,
                          overlap=overlap)
    sums = ex.step(mbs, 1.0 / n_mb, 0.3, 0.01)
    assert bool(ex.state.fb_pieces) == overlap   # the F&Bs ran interleaved exactly when overlap is on
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    loads = {n: b.clone() for n, b in model.named_buffers() if n.endswith("tokens_per_expert")}
    return sums, grads, loads, set(n for n, _ in model.named_parameters())


def _worker(rank, world, schedule, pp, ep, n_mb, dispatcher, latency_s):
    dims = ParallelDims(world_size=world, rank=rank, pp=pp, ep=ep).build_groups()
    solo = [dist.new_group([r]) for r in range(world)]   # every rank creates every group
    dims.groups["solo"] = solo[rank]
    cfg = ModelConfig(**{**CFG, "dim": 128 if dispatcher == "solo-fp8" else CFG["dim"]})
    ids = torch.randint(0, cfg.vocab_size, (n_mb * 2, 17), generator=torch.Generator().manual_seed(10 + dims.dp_rank))
    mbs = [(ids[i * 2:(i + 1) * 2, :-1], ids[i * 2:(i + 1) * 2, 1:]) for i in range(n_mb)]
    off = _run(cfg, dims, schedule, n_mb, mbs, False, dispatcher, latency_s)
    on = _run(cfg, dims, schedule, n_mb, mbs, True, dispatcher, latency_s)
    for k in ("lm", "mtp", "aux", "n"):
        assert abs(float(on[0][k]) - float(off[0][k])) <= 1e-6 * max(1.0, abs(float(off[0][k]))), (k, on[0], off[0])
    assert set(on[1]) == set(off[1]) == on[3], "every local parameter gets a gradient, in both modes"
    for name, g in off[1].items():
        assert cos_dist(on[1][name], g) < 1e-10, (name, cos_dist(on[1][name], g))
        assert rel_err(on[1][name], g) < 1e-6, (name, rel_err(on[1][name], g))
    for name, load in off[2].items():
        assert torch.equal(on[2][name], load), name


CASES = [  # schedule, pp, ep, world, micro-batches, dispatcher, injected latency
    ("dualpipe", 2, 1, 2, 4, "local", 0.0),
    ("dualpipe", 2, 1, 2, 4, "solo", 0.002),
    ("dualpipev", 2, 1, 2, 4, "solo", 0.0),
    ("dualpipe", 2, 1, 2, 4, "solo-fp8", 0.0),   # FP8 dispatch (straight-through backward)
    ("dualpipe", 2, 2, 4, 4, "hierarchical", 0.001),   # EP=2 (two EP nodes) inside each of the pp=2 stages
    ("dualpipe", 2, 2, 4, 4, "alltoall", 0.0),
]


@pytest.mark.parametrize("schedule,pp,ep,world,n_mb,dispatcher,latency_s", CASES)
def test_overlapped_fb_matches_sequential(tmp_path, schedule, pp, ep, world, n_mb, dispatcher, latency_s):
    spawn(_worker, world, tmp_path, schedule, pp, ep, n_mb, dispatcher, latency_s)


class _Handle:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append("wait " + self.name)
        return self.name


def _steps(log, name, n):
    got = None
    for i in range(n):
        log.append(f"compute {name}{i}" + (f" ({got})" if got else ""))
        got = yield _Handle(log, f"{name}{i}")
    log.append(f"compute {name}{n} ({got})")
    return name


def test_run_pair_interleaves_launch_compute_wait():
    log = []
    assert run_pair(_steps(log, "f", 2), _steps(log, "b", 1)) == ("f", "b")
    assert log == ["compute f0", "compute b0",            # f0's transfer in flight while b0 computes
                   "wait f0", "compute f1 (f0)",           # b0's transfer in flight while f1 computes
                   "wait b0", "compute b1 (b0)",
                   "wait f1", "compute f2 (f1)"]
    log.clear()
    assert run(_steps(log, "f", 1)) == "f"
    assert log == ["compute f0", "wait f0", "compute f1 (f0)"]


def test_injected_latency_is_a_deadline():
    """``Deadline.wait`` sleeps only what is left of the latency: work done meanwhile hides it."""
    p = Deadline(_Handle([], "t"), 0.2)
    t0 = time.perf_counter()
    p.wait()
    assert time.perf_counter() - t0 >= 0.19          # waited at once: the whole latency
    p = Deadline(_Handle([], "t"), 0.2)
    time.sleep(0.2)                                  # "compute" for as long as the transfer takes
    t0 = time.perf_counter()
    p.wait()
    assert time.perf_counter() - t0 < 0.05
