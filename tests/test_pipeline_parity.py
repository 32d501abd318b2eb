"""Pipeline executor (every schedule) against the single-device model, on gloo/CPU processes:
per-micro-batch losses equal, gradients equal (cosine distance < 1e-10), also with EP=2 inside. Zero-bubble
schedules run with the weight GEMMs deferred (B queues them, W runs only them): W issues no all-to-all."""
import copy
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from models import ModelConfig, build
from parallel.data_parallel import sync_gradients
from parallel.dims import ParallelDims
from parallel.ep import apply_ep
from parallel.pipeline.executor import PipelineExecutor
from parallel.errors import P2PError
from parallel.pipeline.p2p import PipeChannels
from parallel.pipeline.replicas import ReplicaSync
from parallel.pipeline.runner import wgrad_queue
from parallel.pipeline.schedules import Kind, get_schedule
from parallel.pipeline.stages import build_stages, prune_model
from parallel.wgrad import DeferredLinear

from .dist_utils import grads_with_reference, rel_err, spawn

CFG = dict(vocab_size=128, dim=32, n_layers=4, inter_dim=64, n_heads=2, q_lora_rank=16, kv_lora_rank=16,
           qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, moe_inter_dim=16, n_routed_experts=8,
           n_activated_experts=2, n_expert_groups=2, n_limited_groups=1, mtp_depth=1, init_std=0.2)


def cos_dist(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    if a.norm() == 0 and b.norm() == 0:
        return 0.0
    return float(1 - torch.dot(a, b) / (a.norm() * b.norm()))


def count_all_to_alls(ex: PipelineExecutor) -> tuple[Counter, callable]:
    """Counts ``dist.all_to_all_single`` calls (every dispatcher transfer, forward and backward) per B / W
    action of ``ex``; returns the counter and a function that undoes the patches."""
    counts, kind, orig = Counter(), [None], dist.all_to_all_single

    def counting(*args, **kwargs):
        counts[kind[0]] += 1
        return orig(*args, **kwargs)

    def tagged(fn, name):
        def run(a):
            kind[0] = name
            try:
                return fn(a)
            finally:
                kind[0] = None
        return run

    dist.all_to_all_single = counting
    ex._b, ex._w = tagged(ex._b, "B"), tagged(ex._w, "W")   # the executor dispatches through getattr(self, ...)

    def undo():
        dist.all_to_all_single = orig
        del ex._b, ex._w
    return counts, undo


def _worker(rank, world, schedule, pp, ep, n_mb):
    dims = ParallelDims(world_size=world, rank=rank, pp=pp, ep=ep).build_groups()
    cfg = ModelConfig(**CFG)
    ref = build(cfg, seed=0).train()
    model = copy.deepcopy(ref)
    rows = 2   # per dp rank and micro-batch
    ids = torch.randint(0, cfg.vocab_size, (n_mb * rows * dims.dp, 17), generator=torch.Generator().manual_seed(1))
    global_mbs = [ids[i * rows * dims.dp:(i + 1) * rows * dims.dp] for i in range(n_mb)]
    ref_lm = []
    for g in global_mbs:
        out = ref.compute_loss(g[:, :-1], g[:, 1:], mtp_weight=0.3, aux_alpha=0.01)
        (out.loss / n_mb).backward()
        ref_lm.append(out.lm_loss)

    model = apply_ep(model, dims)
    sched = get_schedule(schedule, dims.pp, n_mb)
    queue = wgrad_queue(model, sched)   # as PipelineRunner does
    split = any(a.kind is Kind.B for r in range(pp) for a in sched[r])
    assert (queue is not None) == split == any(isinstance(m, DeferredLinear) for m in model.modules())
    stages = build_stages(model, sched, dims.pp_rank)
    prune_model(model, stages)
    replicas = ReplicaSync(cfg, sched, dims)
    actions = sched[dims.pp_rank]
    ex = PipelineExecutor(stages, actions, PipeChannels(dims), sched.n_stages, cfg.dim, wgrad=queue)
    all_to_alls, undo = count_all_to_alls(ex)
    mine = [g[dims.dp_rank * rows:(dims.dp_rank + 1) * rows] for g in global_mbs]
    sums = ex.step([(m[:, :-1], m[:, 1:]) for m in mine], 1.0 / n_mb, 0.3, 0.01)
    undo()
    assert all_to_alls["W"] == 0, f"W issued {all_to_alls['W']} all-to-alls (it must run only weight GEMMs)"
    if ep > 1 and split:   # the counter sees the dispatchers: B sends the gradients back
        assert all_to_alls["B"] > 0, all_to_alls
    if split:
        assert queue.pending() == [] and any(a.kind is Kind.W for a in actions)
    replicas.sum_grads(model)
    sync_gradients(model, dims)

    for name, g, g_ref in grads_with_reference(model, ref, dims):
        assert cos_dist(g, g_ref) < 1e-10, (name, cos_dist(g, g_ref))
        assert rel_err(g, g_ref) < 1e-6, (name, rel_err(g, g_ref))
    # Per-micro-batch LM losses: summed over the ranks that finished micro-batches, averaged over dp.
    t = torch.tensor([float(sums["lm"]), float(sums["n"])], dtype=torch.float64)
    dist.all_reduce(t)
    assert t[1] == n_mb * dims.dp
    assert abs(t[0] / t[1] - float(torch.stack(ref_lm).double().mean())) < 1e-6   # both means in FP64


CASES = [  # schedule, pp, ep, world, micro-batches
    ("1f1b", 2, 1, 2, 4),
    ("1f1b", 4, 1, 4, 4),
    ("zb1p", 2, 1, 2, 4),
    ("dualpipe", 2, 1, 2, 4),
    ("dualpipe", 4, 1, 4, 8),
    ("dualpipev", 2, 1, 2, 4),
    ("dualpipev", 4, 1, 4, 8),
    ("dualpipev", 3, 1, 3, 7),  # odd pp; the smallest DualPipeV whose transfers needed FIFO placement
    pytest.param("dualpipe", 6, 1, 6, 12, marks=pytest.mark.slow),   # the smallest such DualPipe
    ("dualpipe", 2, 2, 4, 4),   # EP=2 inside each stage (dp=2)
    ("zb1p", 2, 2, 4, 4),       # B/W split with EP=2: the stages' all-to-alls run in B, none in W
    ("1f1b", 2, 2, 4, 4),
]


@pytest.mark.parametrize("schedule,pp,ep,world,n_mb", CASES)
def test_pipeline_matches_single_device(tmp_path, schedule, pp, ep, world, n_mb):
    spawn(_worker, world, tmp_path, schedule, pp, ep, n_mb)


def _reordered_worker(rank, world, strict, out=None):
    """DualPipe pp=2 with rank 1's two same-shape receives from rank 0 swapped (tag matching would hide it); the
    strict-mode error also goes to ``out``/rank<r>.err, since which rank's error ``spawn`` reports is timing."""
    dims = ParallelDims(world_size=world, rank=rank, pp=2).build_groups()
    cfg = ModelConfig(**CFG)
    ref = build(cfg, seed=0).train()
    model = copy.deepcopy(ref)
    n_mb, rows = 4, 2
    ids = torch.randint(0, cfg.vocab_size, (n_mb * rows, 17), generator=torch.Generator().manual_seed(1))
    for i in range(n_mb):
        g = ids[i * rows:(i + 1) * rows]
        (ref.compute_loss(g[:, :-1], g[:, 1:], mtp_weight=0.3, aux_alpha=0.01).loss / n_mb).backward()
    sched = get_schedule("dualpipe", 2, n_mb)
    stages = build_stages(model, sched, rank)
    prune_model(model, stages)
    actions = list(sched[rank])
    if rank == 1:
        i = next(i for i, (a, b) in enumerate(zip(actions, actions[1:]))
                 if a.kind is b.kind is Kind.RECV and a.peer == b.peer and a.payload is not b.payload)
        actions[i], actions[i + 1] = actions[i + 1], actions[i]
    ex = PipelineExecutor(stages, actions, PipeChannels(dims, strict=strict), 2, cfg.dim)
    try:
        ex.step([(ids[i * rows:(i + 1) * rows, :-1], ids[i * rows:(i + 1) * rows, 1:]) for i in range(n_mb)],
                1.0 / n_mb, 0.3, 0.01)
    except P2PError as e:
        if out is not None:
            Path(out, f"rank{rank}.err").write_text(str(e))
        raise
    ReplicaSync(cfg, sched, dims).sum_grads(model)
    worst = max(cos_dist(g, g_ref) for _, g, g_ref in grads_with_reference(model, ref, dims))
    worst = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    assert worst.item() > 1e-3, "the swapped receives must corrupt the gradients (pairing is FIFO, not by tag)"


def test_reordered_receives_fail_in_strict_mode(tmp_path):
    with pytest.raises(Exception):
        spawn(_reordered_worker, 2, tmp_path, True, str(tmp_path))
    assert sorted(p.name for p in tmp_path.glob("rank*.err")) == ["rank1.err"]
    assert re.search(r"NCCL-strict p2p: pipeline rank 1 \(global 1\) expected grad of micro-batch \d stage 1 .* from "
                     r"pipeline rank 0 \(global 0\), but that rank sent act of micro-batch \d stage 0",
                     (tmp_path / "rank1.err").read_text())


def test_reordered_receives_pair_in_issue_order(tmp_path):
    """Without strict mode's headers nothing stops the swap: the tensors are exchanged silently, as they
    would be on NCCL. (The reason the CPU tests run in strict mode.)"""
    spawn(_reordered_worker, 2, tmp_path, False)


@pytest.mark.parametrize("wire, stream", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_a_stage_output_of_another_dtype_than_the_wire_is_an_error(wire, stream):
    """The wire carries the residual stream's dtype (the weights'); a stage output of another dtype would be
    cast silently (rounding an FP32 stream, or promoting the next stage's BF16 stream to FP32)."""
    from types import SimpleNamespace
    from parallel.pipeline.schedules.actions import Action, Payload
    sent = []
    ex = PipelineExecutor({}, [], SimpleNamespace(pp_rank=1, isend=lambda t, peer, what: sent.append(t)), 2, 8,
                          wire_dtype=wire)
    ex.state = SimpleNamespace(outputs={(3, 0): torch.zeros(2, 4, 8, dtype=stream)}, sends=[])
    with pytest.raises(RuntimeError, match=r"pipeline rank 1: stage 0 act of micro-batch 3 is torch\.(float32|bfloat16), "
                                           r"the wire carries"):
        ex._send(Action(Kind.SEND, 3, 0, peer=0, payload=Payload.ACT))
    assert not sent
    ex.state.outputs[(3, 0)] = torch.zeros(2, 4, 8, dtype=wire)
    ex._send(Action(Kind.SEND, 3, 0, peer=0, payload=Payload.ACT))
    assert len(sent) == 1 and sent[0].dtype == wire


def test_two_holder_replica_sums_in_fp32_equal_the_fp64_sum_bit_for_bit():
    """``replicas.sum_dtype``: twin stages add their FP32 gradients in FP32. One FP32 addition rounded once
    equals the FP64 sum rounded back to FP32 (double rounding through binary64 is innocuous), including
    cancellation, far-apart exponents, subnormals and ties."""
    from parallel.pipeline.replicas import sum_dtype
    g = torch.Generator().manual_seed(0)
    n = 200_000
    a = torch.randn(n, generator=g) * torch.exp2(torch.randint(-60, 60, (n,), generator=g).float())
    b = torch.randn(n, generator=g) * torch.exp2(torch.randint(-60, 60, (n,), generator=g).float())
    b[:1000] = -a[:1000] * (1 + torch.finfo(torch.float32).eps)                      # cancellation
    a[1000:2000], b[1000:2000] = 1.0, torch.finfo(torch.float32).eps / 2            # exact ties
    a[2000:3000] = torch.finfo(torch.float32).tiny * torch.rand(1000, generator=g)  # subnormals
    assert torch.equal((a.double() + b.double()).float(), a + b)
    t32 = [torch.zeros(2), torch.zeros(3)]
    assert sum_dtype(2, t32) == torch.float32
    assert sum_dtype(3, t32) == torch.float64 and sum_dtype(2, [torch.zeros(2, dtype=torch.bfloat16)]) == torch.float64
