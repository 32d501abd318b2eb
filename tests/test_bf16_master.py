"""BF16 weights with an FP32 master copy (``train.precision=bf16|fp8``; parallel/zero/master.py): the update
goes to the FP32 master, micro-batches accumulate in FP32, checkpoints hold the master (bit-exact resume,
fp32 <-> bf16 interchange, resharding), EMA of the master, skip-on-NaN, memory accounting, and the ZeRO /
pipeline layouts against their single-device bf16 run."""
import dataclasses
import types

import pytest
import torch
from torch import nn

from models.layers import RMSNorm
from parallel.dims import ParallelDims
from parallel.zero import build_optimizer
from tools.convert_hf import load_model_checkpoint
from trainer.train import Trainer

from .test_trainer import SMALL, cache  # noqa: F401 - the same small run and data-cache fixture
from .trainer_utils import fast_overrides, make_config, read_jsonl, run_torchrun

ONE = ParallelDims(world_size=1)
FP32_MOMENTS = "optim.moment_dtype=fp32"


def _optim(**kw):
    return dataclasses.replace(make_config().optim, **{"moment_dtype": "fp32", **kw})


def _not_bf16(t: torch.Tensor) -> bool:
    """Some value of ``t`` is not a BF16 number (an FP32 master, not the BF16 weights widened)."""
    return bool((t.float() != t.float().bfloat16().float()).any())


# ---- the optimizer ---------------------------------------------------------------------------------
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_updates_go_to_the_fp32_master(zero):
    """lr 1e-4 on RMSNorm weights of 1.0 (a BF16 step there is 2^-8..2^-7): every single update is below
    half a BF16 step, so BF16 weights updated directly would stay 1.0 for ever. The master takes each one;
    after 60 steps it has moved past a rounding boundary and the weights follow it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16, bias=False), RMSNorm(16))
    opt = build_optimizer(model, _optim(lr=1e-4, weight_decay=0.0), ONE, zero=zero, weights="bf16")
    norm_w = model[1].weight
    assert norm_w.dtype == model[0].weight.dtype == torch.bfloat16
    x, c = torch.randn(4, 16), torch.randn(4, 16)
    start = opt.master_weights()["1.weight"].clone()
    assert start.dtype == torch.float32 and torch.equal(start, torch.ones(16))
    for step in range(1, 61):
        opt.backward((model(x.bfloat16()).float() * c).sum())
        opt.step(0.0)
        opt.zero_grad()
        master = opt.master_weights()["1.weight"]
        if step == 1:   # Adam's first step moves every element by lr (gradient signs are all nonzero here)
            torch.testing.assert_close((master - start).abs(), torch.full((16,), 1e-4), rtol=1e-3, atol=0)
            assert torch.equal(norm_w, torch.ones(16, dtype=torch.bfloat16))   # rounded away in the weights
        for name, p in model.named_parameters():   # the weights are always the master, cast
            assert torch.equal(p, opt.master_weights()[name].bfloat16()), (step, name)
    assert (norm_w != 1).all() and ((master - start).abs() > 2**-9).all()


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_micro_batches_accumulate_in_fp32(zero):
    """Micro-batch gradients 1, then 64 x 1e-3: summed in FP32 they give 1.064; in BF16 every 1e-3 is below
    half a step at 1 (2^-8), so a BF16 sum would stay 1. The step's global norm shows which one the
    optimizer used."""
    lin = nn.Linear(64, 1, bias=False)
    opt = build_optimizer(nn.Sequential(lin), _optim(), ONE, zero=zero, weights="bf16")
    small = torch.tensor(1e-3).bfloat16().double()
    for g in [1.0] + [1e-3] * 64:
        opt.backward((lin.weight.float() * g).sum())
        assert lin.weight.grad is None   # taken into the FP32 accumulator (ZeRO-2: reduced into its shard)
    assert bool(opt.grads_finite())
    norm = float(opt.step(0.0))
    assert norm == pytest.approx(64 ** 0.5 * (1 + 64 * float(small)), rel=1e-6)


def test_fp32_weights_are_left_alone():
    """weights=fp32 (train.precision=fp32): no master copy, no hooks, parameters updated in place."""
    lin = nn.Linear(8, 8)
    before = lin.weight
    opt = build_optimizer(nn.Sequential(lin), _optim(), ONE, zero=0)
    assert opt.master_weights() is None and lin.weight is before and lin.weight.dtype == torch.float32
    assert opt.optimizer.param_groups[0]["params"][0] is lin.weight


def test_memory_accounting_bf16_weights():
    """Measured bytes equal the formula: BF16 weights (2 B), FP32 gradients (4 B), a full FP32 master
    without ZeRO (4 B) or its shard under ZeRO (dp = 1 here: all of it), AdamW moments."""
    from models import build
    cfg = make_config()
    reports = {}
    for zero in (0, 1):
        model = build(cfg.model, seed=0)
        n = sum(p.numel() for p in model.parameters())
        reports[zero] = build_optimizer(model, _optim(), ONE, zero=zero, weights="bf16").memory()
    m0, m1 = reports[0], reports[1]
    assert m0.measured == m0.formula == {"params": 2 * n, "grads": 4 * n, "master": 4 * n, "optim": 8 * n}
    assert m1.formula == {"params": 2 * n, "grads": 4 * n, "master": 4 * n, "optim": 8 * n}
    assert m1.measured["params"] == 2 * n and m1.measured["master"] == 4 * n
    from trainer.memory_plan import plan_memory   # the pre-flight's estimate (recipe trainer) uses the same bytes
    est = plan_memory(make_config("train.precision=bf16", FP32_MOMENTS), recipe="trainer").worst
    assert (est.weights, est.grads, est.optim) == (2 * n, 4 * n, 12 * n)
    # optim.moment_dtype=auto beside BF16 weights: BF16 moments (DeepSeek-V3's recipe), ZeRO or not
    est = plan_memory(make_config("train.precision=bf16"), recipe="trainer").worst
    assert est.optim == 4 * n + 2 * 2 * n


def test_a_split_master_steps_as_the_fp32_master_bit_for_bit():
    """``optim.master=split``: the master is the BF16 weights and 16 low bits. Ten steps beside an FP32-master
    optimizer (BF16 moments: both take the same maths, ``kernels.adamw.reference_adamw_``, here): the joined
    master equals the FP32 master bit for bit at every step, and the weights are its high halves (round to
    nearest even but for exact ties, none here)."""
    from kernels.adamw import split_master
    runs = {}
    for master in ("fp32", "split"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16, bias=False), RMSNorm(16))
        opt = build_optimizer(model, _optim(lr=3e-2, moment_dtype="bf16", master=master), ONE, weights="bf16")
        runs[master] = (model, opt)
    x, c = torch.randn(4, 16), torch.randn(4, 16)
    (m_a, a), (m_b, b) = runs["fp32"], runs["split"]
    assert all(t.dtype == torch.int16 for _, t in b.named) and b.master_halves() is not None
    for step in range(10):
        for model, opt in (runs["fp32"], runs["split"]):
            opt.backward((model(x.bfloat16()).float() * c).sum())
            assert bool(opt.grads_finite())
            opt.step(1.0)
            opt.zero_grad()
        want, got = a.master_weights(), b.master_weights()
        for n in want:
            assert torch.equal(got[n].view(torch.int32), want[n].view(torch.int32)), (step, n)
            assert torch.equal(dict(m_b.named_parameters())[n], split_master(want[n])[0].view(want[n].shape))
            assert torch.equal(dict(m_b.named_parameters())[n], dict(m_a.named_parameters())[n]), (step, n)
    b.load_master_weights({n: t + 1 for n, t in want.items()})   # a checkpoint's master, split again
    assert all(torch.equal(t, want[n] + 1) for n, t in b.master_weights().items())


def test_a_split_master_takes_two_bytes_per_parameter_and_is_refused_where_it_cannot_run(monkeypatch):
    import parallel.zero as zero
    from models import build
    from errors import ConfigError
    cfg = make_config()
    model = build(cfg.model, seed=0)
    n = sum(p.numel() for p in model.parameters())
    asked = []   # what decides the Triton AdamW on CUDA: the BF16 weights, not the int16 low halves
    monkeypatch.setattr(zero, "triton_adamw", lambda tensors: asked.extend(tensors) or False)
    mem = build_optimizer(model, _optim(master="split"), ONE, weights="bf16").memory()
    assert len(asked) == len(list(model.parameters())) and all(t.dtype == torch.bfloat16 for t in asked)
    assert mem.measured == mem.formula == {"params": 2 * n, "grads": 4 * n, "master": 2 * n, "optim": 8 * n}
    from trainer.memory_plan import plan_memory
    est = plan_memory(make_config("train.precision=bf16", "optim.master=split"), recipe="trainer").worst
    assert est.optim == 2 * n + 2 * 2 * n
    with pytest.raises(ConfigError, match="optim.master: split keeps .* train.precision=fp32"):
        make_config("train.precision=fp32", "optim.master=split")
    with pytest.raises(ConfigError, match="optim.master: split runs without ZeRO .* parallel.zero=1"):
        make_config("train.precision=bf16", "optim.master=split", "parallel.zero=1")
    with pytest.raises(ValueError, match="FP32 weights are their own master"):
        build_optimizer(build(cfg.model, seed=0), _optim(master="split"), ONE, weights="fp32")
    with pytest.raises(ValueError, match="runs without ZeRO only"):
        build_optimizer(build(cfg.model, seed=0), _optim(master="split"), ONE, zero=1, weights="bf16")


# ---- the trainer -----------------------------------------------------------------------------------
def _trainer(tmp_path, cache, name, *overrides):   # noqa: F811 - cache is the fixture
    return Trainer(make_config(*fast_overrides(tmp_path, cache), *SMALL, *overrides), tmp_path / name)


def _losses(tmp_path, name):
    return [m["loss"] for m in read_jsonl(tmp_path / name / "metrics.jsonl")]


@pytest.mark.parametrize("zero", [0, 2])
def test_bf16_resume_is_bitwise_and_checkpoints_hold_the_master(tmp_path, cache, zero):  # noqa: F811
    bf16 = ["train.precision=bf16", f"parallel.zero={zero}", "train.ema_decay=0.5", "train.max_steps=6"]
    straight = _trainer(tmp_path, cache, "s", *bf16, f"checkpoint.dir={tmp_path}/ck_s")
    assert {p.dtype for p in straight.model.parameters()} == {torch.bfloat16}
    straight.train()
    first = _trainer(tmp_path, cache, "r", *bf16, "train.stop_at_step=3", f"checkpoint.dir={tmp_path}/ck_r")
    first.train()
    master = {n: t.clone() for n, t in first.opt.master_weights().items()}
    resumed = _trainer(tmp_path, cache, "r", *bf16, f"checkpoint.dir={tmp_path}/ck_r")
    assert resumed.step == 3
    for n, t in resumed.opt.master_weights().items():   # the master itself came back, not its BF16 rounding
        assert torch.equal(t, master[n]), n
    resumed.train()
    assert _losses(tmp_path, "r") == _losses(tmp_path, "s")   # bitwise
    for n, t in straight.ema.state_dict().items():
        assert torch.equal(resumed.ema.state_dict()[n], t), n
    stored = load_model_checkpoint(tmp_path / "ck_r/step_00000003").state_dict()
    assert all(torch.equal(stored[n], master[n]) for n in master)
    assert _not_bf16(stored["layers.0.attn.wo.weight"])


def test_a_split_master_resumes_bitwise_and_its_ema_and_checkpoints_are_the_fp32_master(tmp_path, cache):  # noqa: F811
    """``optim.master=split`` in the trainer: a resumed run repeats the straight one bit for bit (losses, EMA); the
    checkpoint stores the joined FP32 master, the EMA averages it (joined on the host at each update), and the
    master takes half the bytes of an FP32 master, whose run gives nearly the same losses."""
    split = ["train.precision=bf16", "optim.master=split", "train.ema_decay=0.5", "train.max_steps=4"]
    straight = _trainer(tmp_path, cache, "s", *split, f"checkpoint.dir={tmp_path}/ck_s")
    straight.train()
    first = _trainer(tmp_path, cache, "r", *split, "train.stop_at_step=2", f"checkpoint.dir={tmp_path}/ck_r")
    first.train()
    master = {n: t.clone() for n, t in first.opt.master_weights().items()}
    stored = load_model_checkpoint(tmp_path / "ck_r/step_00000002").state_dict()
    assert all(torch.equal(stored[n], master[n]) for n in master) and _not_bf16(stored["layers.0.attn.wo.weight"])
    resumed = _trainer(tmp_path, cache, "r", *split, f"checkpoint.dir={tmp_path}/ck_r")
    resumed.train()
    assert _losses(tmp_path, "r") == _losses(tmp_path, "s")
    for n, t in straight.ema.state_dict().items():
        assert torch.equal(resumed.ema.state_dict()[n], t), n
    plain = _trainer(tmp_path, cache, "p", *split[:1], *split[2:], f"checkpoint.dir={tmp_path}/ck_p")
    plain.train()
    assert plain.opt.memory().measured["master"] == 2 * straight.opt.memory().measured["master"]
    # the same run with an FP32 master: its BF16 weights start equal but at exact ties (14 of 1.59M here), which
    # top-k routing makes visible in the loss (8e-5 at step 1, measured)
    assert max(_rel(a, b) for a, b in zip(_losses(tmp_path, "s"), _losses(tmp_path, "p"))) < 5e-4
    ema = straight.ema.state_dict()
    assert _not_bf16(ema["layers.0.attn.wo.weight"]) and ema.keys() == straight.opt.master_weights().keys()


def test_ema_averages_the_master(tmp_path, cache):  # noqa: F811
    tr = _trainer(tmp_path, cache, "a", "train.precision=bf16", "train.ema_decay=0.5", "train.max_steps=3")
    want = {n: t.clone() for n, t in tr.opt.master_weights().items()}
    for _ in range(3):
        tr.train_step()
        for n, t in tr.opt.master_weights().items():
            want[n] = 0.5 * want[n] + 0.5 * t
    got = tr.ema.state_dict()
    assert max((got[n] - want[n]).abs().max().item() for n in want) < 1e-7
    assert _not_bf16(got["layers.0.attn.wo.weight"])


def test_fp32_and_bf16_checkpoints_interchange(tmp_path, cache):  # noqa: F811
    """fp32 (2 steps) -> bf16 resumes with its weights as the master, exactly -> bf16 saves step 4 -> fp32
    resumes with that master as its weights, exactly."""
    ck = f"checkpoint.dir={tmp_path}/ck"
    fp32 = _trainer(tmp_path, cache, "a", ck, "train.max_steps=2")
    fp32.train()
    bf16 = _trainer(tmp_path, cache, "b", ck, "train.precision=bf16", "train.max_steps=4")
    assert bf16.step == 2
    weights = dict(fp32.model.named_parameters())
    for n, t in bf16.opt.master_weights().items():
        assert torch.equal(t, weights[n]), n
        assert torch.equal(dict(bf16.model.named_parameters())[n], weights[n].bfloat16()), n
    bf16.train()
    again = _trainer(tmp_path, cache, "c", ck, "train.max_steps=5")
    assert again.step == 4
    weights = dict(again.model.named_parameters())
    for n, t in bf16.opt.master_weights().items():
        assert weights[n].dtype == torch.float32 and torch.equal(weights[n], t), n
    again.train()
    assert all(torch.isfinite(torch.tensor(_losses(tmp_path, "c"))))


@pytest.mark.parametrize("zero", [0, 1])
def test_nan_micro_batch_skips_the_step_and_leaves_the_master(tmp_path, cache, zero):  # noqa: F811
    """One NaN micro-batch among finite ones: the step is skipped, the master and weights are those of the
    step before, the FP32 accumulators are emptied, and the next step trains normally."""
    tr = _trainer(tmp_path, cache, "a", "train.precision=bf16", f"parallel.zero={zero}", "train.max_steps=3")
    tr.logger = types.SimpleNamespace(write=lambda *a, **k: None)
    tr.train_step()
    before = {n: t.clone() for n, t in tr.opt.master_weights().items()}
    compute_loss, calls = tr.model.compute_loss, []

    def poisoned(*args, **kwargs):
        out = compute_loss(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            out.loss = out.loss * float("nan")
        return out
    tr.model.compute_loss = poisoned
    assert tr.train_step()["skipped"] is True
    assert not tr.opt.fp32_grads.grads and all(p.grad is None for p in tr.model.parameters())
    for n, t in tr.opt.master_weights().items():
        assert torch.equal(t, before[n]), n
    m = tr.train_step()
    assert "skipped" not in m and torch.isfinite(torch.tensor(m["loss"]))
    assert any(not torch.equal(t, before[n]) for n, t in tr.opt.master_weights().items())


def test_deepspeed_with_bf16_weights_is_refused():
    """At config validation, before anything is built (and by the backend, called directly)."""
    from configs.schema import compose, validate
    from errors import ConfigError
    from parallel.zero.deepspeed_backend import DeepSpeedZero
    cfg = compose(["+exp=tiny", "train.precision=fp8", "parallel.zero=1", "parallel.zero_backend=deepspeed"])
    with pytest.raises(ConfigError, match="train.precision: bf16 weights .*parallel.zero_backend=deepspeed"):
        validate(cfg, world_size=2)
    with pytest.raises(ConfigError, match="train.precision.*parallel.zero_backend=deepspeed"):
        DeepSpeedZero(nn.Linear(2, 2), _optim(), ParallelDims(world_size=2, rank=0), weights="bf16")


# ---- layouts against their single-device bf16 run (torchrun, gloo) ----------------------------------
BF16 = ("train.precision=bf16", FP32_MOMENTS, "checkpoint.every=1", "checkpoint.keep=0")


@pytest.fixture(scope="module")
def single_bf16(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single_bf16")
    return tmp, run_torchrun(tmp, "single", 1, *BF16, f"checkpoint.dir={tmp}/ck", steps=6)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [("parallel.zero=0",), ("parallel.zero=1",),
                                       ("parallel.zero=2", "parallel.zero_bucket_mb=0.5")],
                         ids=["z0", "z1", "z2-buckets"])
def test_zero_bf16_matches_single_device_bf16(tmp_path, single_bf16, overrides):
    """dp=2. Step 1 starts from the same weights: its loss and global gradient norm agree to FP32 rounding
    (the FP32 gradients differ only in summation order), and so does the FP32 master after it (within 4
    FP32 ulps). Later steps drift further: an FP32-ulp difference in the master can put a weight on the
    other side of a BF16 rounding boundary (one weight in 1.6M after step 1, measured), and top-k routing
    turns that into a visible loss difference (4e-5 relative at most over 6 steps, 1.2e-4 over 10, measured)."""
    ref_dir, ref = single_bf16
    got = run_torchrun(tmp_path, "dp2", 2, *BF16, *overrides, f"checkpoint.dir={tmp_path}/ck", steps=6)
    _dp2_matches(got, ref, tmp_path / "ck", ref_dir / "ck")


def _dp2_matches(got: list, ref: list, got_ck, ref_ck) -> None:
    """Step 1's loss and gradient norm to FP32 rounding, every loss within 5e-4, the stored FP32 master after
    step 1 within 4 FP32 ulps (the sharded master was stored, not the BF16 weights)."""
    assert _rel(got[0]["loss"], ref[0]["loss"]) < 1e-6 and _rel(got[0]["grad_norm"], ref[0]["grad_norm"]) < 1e-6
    assert max(_rel(g["loss"], w["loss"]) for g, w in zip(got, ref)) < 5e-4
    a = load_model_checkpoint(got_ck / "step_00000001").state_dict()
    b = load_model_checkpoint(ref_ck / "step_00000001").state_dict()
    for n, t in b.items():
        if t.is_floating_point():
            torch.testing.assert_close(a[n], t, rtol=4 * 2**-24, atol=1e-9, msg=n)
    assert _not_bf16(a["layers.0.attn.wo.weight"])


@pytest.mark.slow
def test_a_split_master_over_dp2_matches_one_process(tmp_path):
    """``optim.master=split`` at dp=2 (its gradients all-reduced as a list, in FP32) against one process with a
    split master too (an FP32-master run starts from other BF16 weights where the FP32 values are exact ties):
    step 1's loss and gradient norm to FP32 rounding, the stored master after it within 4 FP32 ulps."""
    split = (*BF16, "optim.master=split")
    ref = run_torchrun(tmp_path, "single", 1, *split, f"checkpoint.dir={tmp_path}/ck1", steps=3)
    got = run_torchrun(tmp_path, "dp2", 2, *split, f"checkpoint.dir={tmp_path}/ck2", steps=3)
    _dp2_matches(got, ref, tmp_path / "ck2", tmp_path / "ck1")


@pytest.mark.slow
def test_pipeline_bf16_matches_single_device_bf16(tmp_path, single_bf16):
    """pp=2 DualPipe with ZeRO-1 over dp=1 per stage. Stages pass activations in BF16, the residual stream's
    dtype (``PipelineExecutor.wire_dtype``), so the second stage computes on what the single-device model
    does: step 1 (same weights) has the same loss up to FP32 summation order (measured 7e-8 relative; it was
    3e-5 with an FP32 wire, which promoted the second stage's stream to FP32) and its grad norm within 5e-4
    (measured 6e-5: BF16 gradients summed over micro-batches in another order); the 6 losses stay within
    5e-4 (measured 4.5e-5: BF16 rounding drift once the weights differ)."""
    _, ref = single_bf16
    got = run_torchrun(tmp_path, "pp2", 2, *BF16, "parallel.pp=2", "parallel.schedule=dualpipe", "parallel.zero=1",
                       f"checkpoint.dir={tmp_path}/ck", steps=6)
    assert _rel(got[0]["loss"], ref[0]["loss"]) < 1e-6 and _rel(got[0]["grad_norm"], ref[0]["grad_norm"]) < 5e-4
    assert max(_rel(g["loss"], w["loss"]) for g, w in zip(got, ref)) < 5e-4


@pytest.mark.slow
def test_bf16_zero_checkpoint_reshards_to_one_process(tmp_path, single_bf16):
    """ZeRO-1 over dp=2 (master and EMA in pieces) stops at step 3; one process with zero=0 resumes from
    it: the master it loads is the pieces' union (the checkpoint's FP32 weights), and the run continues
    within the layouts' tolerance of the single-device run."""
    _, ref = single_bf16
    ck = f"checkpoint.dir={tmp_path}/ck"
    ema = "train.ema_decay=0.5"
    first = run_torchrun(tmp_path, "a", 2, *BF16, "parallel.zero=1", ema, ck, "train.stop_at_step=3", steps=6)
    stored = load_model_checkpoint(tmp_path / "ck/step_00000003").state_dict()
    stored_ema = load_model_checkpoint(tmp_path / "ck/step_00000003", ema=True).state_dict()
    assert _not_bf16(stored["layers.0.attn.wo.weight"]) and _not_bf16(stored_ema["layers.0.attn.wo.weight"])
    rest = run_torchrun(tmp_path, "b", 1, *BF16, ema, ck, steps=6)
    assert [m["step"] for m in first + rest] == list(range(1, 7))
    assert max(_rel(g["loss"], w["loss"]) for g, w in zip(first + rest, ref)) < 5e-4


def test_fused_adamw_updates_the_master_as_the_default_path_does():
    """``Replicated`` runs torch's fused AdamW on CUDA (``parallel.zero.fused_adamw``); forced here on the CPU, three
    steps of the tiny model in bf16 give the master the default path gives, to FP32 rounding (measured 9e-8)."""
    from types import SimpleNamespace

    import models
    from configs import model_preset
    from parallel.zero import Replicated, fused_adamw
    assert not fused_adamw([torch.zeros(2)]) and not fused_adamw([])
    cfg = model_preset("tiny")
    o = SimpleNamespace(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    ids = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    masters = []
    for fused in (False, True):
        model = models.build(cfg, seed=0)
        opt = Replicated(model, o, ParallelDims(world_size=1), None, weights="bf16", fused=fused)
        assert bool(opt.optimizer.defaults.get("fused")) is fused
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model.compute_loss(ids[:, :-1], ids[:, 1:], mtp_weight=0.3, aux_alpha=1e-4)
            opt.backward(out.loss)
            opt.step(1.0)
            opt.zero_grad()
        masters.append({n: t.detach().clone() for n, t in opt.named})
        assert all(torch.equal(p.detach(), m.to(p.dtype)) for (_, p), m in zip(opt.params, masters[-1].values()))
    for n, ref in masters[0].items():
        assert ((masters[1][n] - ref).abs().max() / ref.abs().max().clamp_min(1e-12)) < 1e-6, n


def test_fused_adamw_state_lives_on_the_parameters_device():
    """torch's fused AdamW kernel takes every state tensor, the step count too, on the parameter's device (on
    CUDA a host step count raises at the first step: measured on an H100). ``Replicated`` creates the state
    before the first step, so it places it as torch would: checked on meta tensors, where nothing runs."""
    from types import SimpleNamespace

    import models
    from configs import model_preset
    from parallel.zero import Replicated
    o = SimpleNamespace(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for fused, want in ((True, "meta"), (False, "cpu")):
        model = models.build(model_preset("tiny"), seed=0).to("meta")
        opt = Replicated(model, o, ParallelDims(world_size=1), None, fused=fused)
        steps = {opt.optimizer.state[t]["step"].device.type for _, t in opt.named}
        moments = {opt.optimizer.state[t][k].device.type for _, t in opt.named for k in ("exp_avg", "exp_avg_sq")}
        assert steps == {want} and moments == {"meta"}, (fused, steps, moments)


def test_moment_dtype_auto_is_bf16_beside_an_fp32_master():
    """``optim.moment_dtype=auto``: BF16 moments (DeepSeek-V3's recipe) wherever the optimizer keeps an FP32
    master apart from the weights (BF16 weights, or the native ZeRO's pieces); FP32 where torch's or DeepSpeed's
    AdamW updates FP32 weights in place. ``bf16`` without ZeRO is a valid config (``Replicated`` keeps them)."""
    from parallel.zero import moment_dtype
    assert moment_dtype("auto", 0, "native", "fp32") == "fp32"
    assert moment_dtype("auto", 0, "native", "bf16") == "bf16"
    assert moment_dtype("auto", 1, "native", "fp32") == moment_dtype("auto", 2, "native", "bf16") == "bf16"
    assert moment_dtype("auto", 1, "deepspeed", "fp32") == "fp32"
    assert moment_dtype("fp32", 0, "native", "bf16") == "fp32" and moment_dtype("bf16", 0) == "bf16"
    assert make_config("optim.moment_dtype=bf16").optim.moment_dtype == "bf16"
