"""Activation recomputation (``train.recompute``, ``parallel/recompute.py``): the same losses and gradients
with none / selective / full (fp32: bitwise on one device; rel 1e-6 across pipeline schedules, F&B overlap,
the B/W split, EP and ZeRO), fewer saved bytes in the order none > selective > full and as ``tools.size``
predicts them, FP8 emulation with selective, and the cost of the B/W split (a region is recomputed by B and
again by W)."""
import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

import models
from configs import model_preset
from errors import ConfigError
from models import ModelConfig, build
from models.attention import MLA
from models.layers import RMSNorm, SwiGLU
from parallel.data_parallel import sync_gradients
from parallel.dims import ParallelDims
from parallel.ep import apply_ep
from parallel.pipeline.executor import PipelineExecutor
from parallel.pipeline.p2p import PipeChannels
from parallel.pipeline.replicas import ReplicaSync
from parallel.pipeline.runner import wgrad_queue
from parallel.pipeline.schedules import get_schedule
from parallel.pipeline.stages import build_stages, prune_model
from parallel.recompute import MODES, apply_recompute, regions
from trainer.activations import activation_bytes_per_token

from .dist_utils import grads_with_reference, rel_err, spawn
from .test_pipeline_parity import CFG, cos_dist
from .trainer_utils import assert_losses_match, fast_overrides, make_config, read_jsonl, run_inprocess, run_torchrun

IDS = torch.randint(0, 1024, (2, 33), generator=torch.Generator().manual_seed(0))


def _loss_and_grads(model, autocast=False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model.compute_loss(IDS[:, :-1], IDS[:, 1:], mtp_weight=0.3, aux_alpha=1e-2)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def saved_bytes(model, T=64, keep=None) -> int:
    """Bytes of the distinct storages autograd saves in one training forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    ids = torch.randint(0, model.cfg.vocab_size, (2, T + 1), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model.compute_loss(ids[:, :-1], ids[:, 1:], mtp_weight=0.3, aux_alpha=1e-4)
    if keep is not None:
        keep.update(saved)
    out.loss.backward()
    return sum(saved.values())


# ---------------------------------------------------------------------------------------- one device
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_losses_and_gradients_are_bitwise_identical(autocast):
    base = models.build(model_preset("tiny"), seed=0).train()
    keys, params = set(base.state_dict()), dict(base.named_parameters())
    ref_loss, ref_grads = _loss_and_grads(copy.deepcopy(base), autocast)
    for mode in ("selective", "full"):
        model = copy.deepcopy(base)
        names = apply_recompute(model, mode)
        assert names and regions(model) == names
        assert set(model.state_dict()) == keys and set(dict(model.named_parameters())) == set(params)
        loss, grads = _loss_and_grads(model, autocast)
        assert torch.equal(loss, ref_loss), mode
        for n, g in ref_grads.items():
            assert torch.equal(grads[n], g), (mode, n)


def test_regions_of_each_mode():
    cfg = model_preset("tiny")   # layer 0 dense, 1-3 MoE, one MTP (MoE) block
    sel = apply_recompute(models.build(cfg, "meta"), "selective")
    assert {"layers.0.attn_norm.forward", "layers.0.attn.core", "layers.0.ffn.act.forward",
            "layers.2.ffn.shared_experts.act.forward", "layers.2.ffn.experts.act.forward", "norm.forward", "mtp.0.enorm.forward",
            "mtp.0.block.attn.core"} <= set(sel)
    assert not any("q_norm" in n or "kv_norm" in n or "_up" in n or "experts.forward" in n for n in sel)   # in core
    full = apply_recompute(models.build(cfg, "meta"), "full")
    assert "layers.0.forward" in full and "layers.1.forward" not in full        # a MoE block is not one region
    assert {"layers.1.attention", "layers.1.ffn_norm.forward",
            "layers.1.ffn.experts.forward", "layers.1.ffn.shared_experts.forward",
            "mtp.0.block.ffn.experts.forward"} <= set(full)
    assert not any(".gate" in n or n.endswith("ffn.forward") or "attn" in n for n in full)   # attention: one region


def test_apply_is_idempotent_and_checked():
    model = models.build(model_preset("tiny"), "meta")
    assert apply_recompute(model, "none") == [] and regions(model) == []
    names = apply_recompute(model, "selective")
    assert apply_recompute(model, "selective") == names
    with pytest.raises(ValueError, match="one mode per model"):
        apply_recompute(model, "full")
    with pytest.raises(ValueError, match="train.recompute: 'some'"):
        apply_recompute(model, "some")
    copied = copy.deepcopy(model)
    assert regions(copied) == names and type(copied.layers[0].attn) is type(model.layers[0].attn)
    with pytest.raises(ConfigError, match="train.recompute: 'partial' is not one of none, selective, full"):
        make_config("train.recompute=partial")
    assert make_config().train.recompute == "none" and MODES == ("none", "selective", "full")


def test_saved_bytes_drop_in_order_and_match_tools_size():
    """fp32, PyTorch's math attention on CPU: none > selective > full, each within 8 % of the formula."""
    tiny = model_preset("tiny")
    for cfg in (tiny, dataclasses.replace(tiny, q_lora_rank=0)):
        measured = {}
        for mode in MODES:
            model = models.build(cfg, seed=0).train()
            apply_recompute(model, mode)
            measured[mode] = saved_bytes(model) / (2 * 64)
            per = activation_bytes_per_token(cfg, 4, 64, True, mode)
            n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
            predicted = (n_moe * per["moe_layer"] + (cfg.n_layers - n_moe) * per["dense_layer"] + per["head"]
                         + cfg.mtp_depth * per["mtp"])
            assert predicted == pytest.approx(measured[mode], rel=0.08), (mode, cfg.q_lora_rank)
        assert measured["none"] > 1.05 * measured["selective"] > 1.05 * 1.5 * measured["full"], measured


def test_b_w_split_recomputes_in_b_and_again_in_w(monkeypatch):
    """Each backward call is its own graph task: a full backward recomputes a region once; an input-only
    backward (B, ``retain_graph``) then a weight backward (W) recompute it twice. Same gradients."""
    calls = []

    def counting(fn, label):
        def run(self, *args):
            calls.append(label)
            return fn(self, *args)
        return run

    for cls, name in ((SwiGLU, "forward"), (MLA, "q_up"), (RMSNorm, "forward")):
        monkeypatch.setattr(cls, name, counting(getattr(cls, name), f"{cls.__name__}.{name}"))
    cfg = dataclasses.replace(model_preset("tiny"), n_layers=2, mtp_depth=0)
    base = models.build(cfg, seed=0).train()
    x = base.embed(IDS[:, :-1]).detach().requires_grad_()
    rope = models.layers.rope_cos_sin(cfg, 32, "cpu")
    ref = copy.deepcopy(base)
    ref.layers[1](ref.layers[0](x, rope), rope).square().sum().backward()
    counts = {}
    for split in (False, True):
        model = copy.deepcopy(base)
        apply_recompute(model, "selective")
        xi = x.detach().requires_grad_()
        y = model.layers[1](model.layers[0](xi, rope), rope).square().sum()
        calls.clear()
        if split:
            torch.autograd.backward([y], inputs=[xi], retain_graph=True)
            torch.autograd.backward([y], inputs=[p for p in model.parameters() if p.requires_grad])
        else:
            y.backward()
        counts[split] = {n: calls.count(n) for n in set(calls)}
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), n
    # 2 layers: 2 MLA (q_up, inside core), 4 norms (attn_norm, ffn_norm), the dense layer's, the shared and the
    # routed SwiGLU
    assert counts[False] == {"MLA.q_up": 2, "RMSNorm.forward": 4 + 4, "SwiGLU.forward": 3}   # q_norm, kv_norm inside
    assert counts[True] == {k: 2 * v for k, v in counts[False].items()}


def test_routed_experts_selective_and_deferred_wgrad_compose(monkeypatch):
    """Routed experts compute their SwiGLU product through ``GroupedExperts.act``, so selective covers them;
    DeferredGroupedExperts (parallel/wgrad.py) keeps h13 and recomputes the product itself: with both,
    the product runs once in forward and never again (no double recompute), and B then W gives the
    gradients of the plain backward, bitwise."""
    from parallel.wgrad import DeferredGroupedExperts, WeightGradQueue, apply_deferred_wgrad
    calls = []
    monkeypatch.setattr(SwiGLU, "forward", (lambda fn: lambda self, *a: calls.append(self) or fn(self, *a))(
        SwiGLU.forward))
    base = models.build(model_preset("tiny"), seed=0).train()
    ref_loss, ref_grads = _loss_and_grads(copy.deepcopy(base))
    plain = copy.deepcopy(base)
    assert "layers.1.ffn.experts.act.forward" in apply_recompute(plain, "selective")
    model, queue = copy.deepcopy(base), WeightGradQueue()
    apply_deferred_wgrad(model, queue)   # parallelize's order: deferred modules, then recompute
    apply_recompute(model, "selective")
    routed = {id(m.act) for m in model.modules() if isinstance(m, DeferredGroupedExperts)}
    assert len(routed) == 4   # layers 1-3 and the MTP block
    calls.clear()
    loss = model.compute_loss(IDS[:, :-1], IDS[:, 1:], mtp_weight=0.3, aux_alpha=1e-2).loss
    queue.backward("k", [loss], [None], [], model.parameters())
    queue.run("k")
    assert not routed & {id(m) for m in calls}
    assert torch.equal(loss.detach(), ref_loss)
    assert all(torch.equal(p.grad, ref_grads[n]) for n, p in model.named_parameters()), "deferred + selective"
    calls.clear()
    loss, grads = _loss_and_grads(plain)
    routed = [m.act for m in plain.modules() if isinstance(m, models.moe.GroupedExperts)]
    assert [sum(c is a for c in calls) for a in routed] == [2] * 4   # forward, then once more in backward
    assert torch.equal(loss, ref_loss) and all(torch.equal(grads[n], g) for n, g in ref_grads.items())


class _RoundTripFn(torch.autograd.Function):
    """The exact forward value; backward: autograd's gradient of silu(h1) * h3 at the FP8 round trip (1×128
    tiles) of h13 = [h1 | h3]."""

    @staticmethod
    def forward(ctx, h13):
        ctx.save_for_backward(h13)
        h1, h3 = h13.chunk(2, dim=-1)
        return torch.nn.functional.silu(h1) * h3

    @staticmethod
    def backward(ctx, g):
        from kernels.reference import dequant, quant_act
        (h13,) = ctx.saved_tensors
        trip = dequant(*quant_act(h13.reshape(-1, h13.shape[-1]))).view(h13.shape).requires_grad_()
        with torch.enable_grad():
            h1, h3 = trip.chunk(2, dim=-1)
            return torch.autograd.grad(torch.nn.functional.silu(h1) * h3, trip, g)


class _RoundTripSwiGLU(SwiGLU):
    """Reference for ``FP8CachedSwiGLU``: the exact forward value, differentiated by autograd at the FP8 round
    trip of h13."""

    def forward(self, h13):
        return _RoundTripFn.apply(h13)


def test_fp8_emulation_with_selective():
    """FP8 linears keep their inputs as FP8 copies, so with selective no full-precision RMSNorm output is kept
    where only FP8 linears read it (attention norms, the dense FFN norm): V3's layout. The MoE SwiGLUs keep their
    inputs as FP8 too (``FP8CachedSwiGLU``, unit tests in ``tests/test_fp8_swiglu.py``): the loss is unchanged bit
    for bit, and the gradients are those of a model whose MoE SwiGLUs differentiate at the FP8 round trip of
    h13 (to fp32 rounding; they differ from the uncached run's by up to ~10 % in early layers here)."""
    from parallel.fp8 import FP8CachedSwiGLU, apply_fp8
    base = models.build(model_preset("tiny"), seed=0).train()
    apply_fp8(base, backend="emulation")
    ref_loss, ref_grads = _loss_and_grads(copy.deepcopy(base))
    model = copy.deepcopy(base)
    apply_recompute(model, "selective")
    cached = [n for n, m in model.named_modules() if isinstance(m, FP8CachedSwiGLU)]
    moe_layers = [i for i, blk in enumerate(model.layers) if hasattr(blk.ffn, "gate")] + ["mtp"]
    assert len(cached) == 2 * len(moe_layers), cached        # routed and shared experts of every MoE layer
    assert all(n.endswith(("experts.act", "shared_experts.act")) for n in cached)
    loss, grads = _loss_and_grads(model)
    assert torch.equal(loss, ref_loss)
    qdq = copy.deepcopy(base)
    for n in cached:
        qdq.get_submodule(n).__class__ = _RoundTripSwiGLU
    _, qdq_grads = _loss_and_grads(qdq)
    errs = {n: rel_err(grads[n], g) for n, g in qdq_grads.items()}
    assert max(errs.values()) < 1e-4, max(errs.items(), key=lambda kv: kv[1])
    assert max(rel_err(grads[n], g) for n, g in ref_grads.items()) > 1e-3     # the caching does change them
    outs = []   # held, so that no saved tensor can reuse their memory
    for blk in model.layers:
        norms = [blk.attn_norm] + ([blk.ffn_norm] if not hasattr(blk.ffn, "gate") else [])
        for norm in norms:
            norm.register_forward_hook(lambda m, i, o: outs.append(o))
    kept = {}
    with_fp8 = saved_bytes(model, keep=kept)
    assert len(outs) == 5 and not {o.untyped_storage().data_ptr() for o in outs} & set(kept)
    assert with_fp8 < saved_bytes(copy.deepcopy(base))


# ------------------------------------------------------------------------------- pipeline, EP (gloo)
def _pipe_worker(rank, world, schedule, pp, ep, n_mb, mode, overlap):
    dims = ParallelDims(world_size=world, rank=rank, pp=pp, ep=ep).build_groups()
    cfg = ModelConfig(**CFG)
    ref = build(cfg, seed=0).train()
    model = copy.deepcopy(ref)
    rows = 2
    ids = torch.randint(0, cfg.vocab_size, (n_mb * rows * dims.dp, 17), generator=torch.Generator().manual_seed(1))
    global_mbs = [ids[i * rows * dims.dp:(i + 1) * rows * dims.dp] for i in range(n_mb)]
    ref_lm = []
    for g in global_mbs:   # the single-device reference, without recomputation
        out = ref.compute_loss(g[:, :-1], g[:, 1:], mtp_weight=0.3, aux_alpha=0.01)
        (out.loss / n_mb).backward()
        ref_lm.append(out.lm_loss)
    model = apply_ep(model, dims)
    sched = get_schedule(schedule, dims.pp, n_mb)
    queue = wgrad_queue(model, sched)   # zero-bubble schedules: deferred weight GEMMs, swapped before recompute
    assert apply_recompute(model, mode)
    stages = build_stages(model, sched, dims.pp_rank)
    prune_model(model, stages)
    ex = PipelineExecutor(stages, sched[dims.pp_rank], PipeChannels(dims), sched.n_stages, cfg.dim, overlap=overlap,
                          wgrad=queue)
    mine = [g[dims.dp_rank * rows:(dims.dp_rank + 1) * rows] for g in global_mbs]
    sums = ex.step([(m[:, :-1], m[:, 1:]) for m in mine], 1.0 / n_mb, 0.3, 0.01)
    ReplicaSync(cfg, sched, dims).sum_grads(model)
    sync_gradients(model, dims)
    for name, g, g_ref in grads_with_reference(model, ref, dims):
        assert cos_dist(g, g_ref) < 1e-10 and rel_err(g, g_ref) < 1e-6, (name, rel_err(g, g_ref))
    t = torch.tensor([float(sums["lm"]), float(sums["n"])], dtype=torch.float64)
    dist.all_reduce(t)
    assert t[1] == n_mb * dims.dp
    mean = float(torch.stack(ref_lm).mean())
    assert abs(t[0] / t[1] - mean) <= 1e-6 * mean


PIPE_CASES = [  # schedule, pp, ep, world, micro-batches, recompute, F&B overlap
    ("1f1b", 2, 1, 2, 4, "selective", True),
    ("zb1p", 2, 1, 2, 4, "full", True),                  # B/W split
    ("dualpipe", 2, 1, 2, 4, "full", True),              # F&B overlap: pieces cut at the all-to-alls
    ("dualpipe", 2, 2, 4, 4, "selective", True),         # EP=2 (hierarchical dispatcher) inside pp=2
    pytest.param("1f1b", 2, 1, 2, 4, "full", True, marks=pytest.mark.slow),
    pytest.param("zb1p", 2, 1, 2, 4, "selective", True, marks=pytest.mark.slow),
    pytest.param("dualpipe", 2, 1, 2, 4, "selective", True, marks=pytest.mark.slow),
    pytest.param("dualpipe", 2, 1, 2, 4, "full", False, marks=pytest.mark.slow),
    pytest.param("dualpipe", 2, 1, 2, 4, "selective", False, marks=pytest.mark.slow),
    pytest.param("dualpipe", 2, 2, 4, 4, "full", True, marks=pytest.mark.slow),
    pytest.param("dualpipe", 2, 2, 4, 4, "full", False, marks=pytest.mark.slow),
    pytest.param("1f1b", 2, 2, 4, 4, "full", True, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("schedule,pp,ep,world,n_mb,mode,overlap", PIPE_CASES)
def test_pipeline_with_recompute_matches_single_device(tmp_path, schedule, pp, ep, world, n_mb, mode, overlap):
    spawn(_pipe_worker, world, tmp_path, schedule, pp, ep, n_mb, mode, overlap)


# ------------------------------------------------------------------------------------------- trainer
SMALL = ["train.global_batch_size=8", "train.micro_batch_size=4", "data.seq_len=64", "train.eval_batches=1",
         "train.eval_every=0", "checkpoint.save_final=false"]


def test_trainer_losses_equal_with_each_mode(tmp_path):
    """One process, 3 steps: the trainer applies train.recompute (startup.build_model) and logs the same losses."""
    losses = {}
    for mode in MODES:
        run_inprocess(tmp_path / mode, *fast_overrides(tmp_path, tmp_path / "cache"), *SMALL, "train.max_steps=3",
                      f"train.recompute={mode}")
        losses[mode] = [m["loss"] for m in read_jsonl(tmp_path / mode / "metrics.jsonl")]
    assert len(losses["none"]) == 3 and losses["selective"] == losses["none"] == losses["full"]


@pytest.mark.slow
@pytest.mark.parametrize("nproc,overrides", [
    (2, ("parallel.zero=1", "train.recompute=selective")),
    (4, ("parallel.zero=1", "parallel.pp=2", "parallel.ep=2", "parallel.schedule=dualpipe", "train.recompute=full")),
], ids=["zero1-dp2-selective", "zero1-dualpipe-ep2-full"])
@pytest.mark.slow
def test_trainer_layouts_with_recompute_match_single_device(tmp_path, nproc, overrides):
    shape = ("data.seq_len=32", "train.eval_batches=1")   # 8 micro-batches of 2 short rows: the parity is the same
    single = run_torchrun(tmp_path, "single", 1, *shape, "optim.moment_dtype=fp32", steps=4)
    got = run_torchrun(tmp_path, "layout", nproc, *shape, "optim.moment_dtype=fp32", *overrides, steps=4)
    assert_losses_match(got, single, rel=1e-6)


@pytest.mark.slow
def test_measured_pipeline_peak_matches_tools_size():
    """Acceptance: ``bench/recompute_memory.py`` (DualPipe pp=2, tiny scaled to dim 512, fp32): per rank, the
    peak of saved bytes and of all live bytes within 15 % of tools.size, and none > selective > full."""
    from bench.recompute_memory import MB, measure, parse_args
    rows = measure(parse_args([]))
    for x in rows:
        assert x["saved_predicted"] == pytest.approx(x["saved"], rel=0.15), x
        assert x["alive_predicted"] == pytest.approx(x["alive"], rel=0.15), x
    for r in (0, 1):
        peak = {x["mode"]: x["alive"] for x in rows if x["rank"] == r}
        assert peak["none"] > peak["selective"] + MB > peak["full"] + 10 * MB, peak
