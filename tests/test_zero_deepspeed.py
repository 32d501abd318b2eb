"""``parallel.zero_backend=deepspeed`` (DeepSpeed's ZeRO-1/2 optimizer, CPU/gloo): the tiny model under
torchrun with 2 processes gives the native backend's losses (fp32 moments), and DCP checkpoints move
between the two backends. Skipped when deepspeed is not installed (``pip install -e '.[deepspeed]'``)."""
import os
import subprocess
import sys

import pytest
import torch

from .dist_utils import spawn
from .trainer_utils import ROOT, assert_losses_match, make_config, run_torchrun

DS = "parallel.zero_backend=deepspeed"
FP32 = "optim.moment_dtype=fp32"
# Sequences of 32 tokens in +exp=tiny's 8 micro-batches of 2 (4 per rank), one validation batch: the parity of
# the losses does not depend on the length, and each step costs a quarter.
SHAPE = ("data.seq_len=32", "train.eval_batches=1")


def _deepspeed():
    if os.environ.get("DSV3_REQUIRE_EXTRAS"):   # .ci/run installs the extra: missing there is a failure, not a skip
        import deepspeed  # noqa: F401
    pytest.importorskip("deepspeed", reason="parallel.zero_backend=deepspeed needs the [deepspeed] extra")


@pytest.fixture(autouse=True)
def _extensions_dir(tmp_path, monkeypatch):
    # Anything DeepSpeed JIT-builds lands in the test's tmp dir, not ~/.cache (the backend skips the
    # shm op; nothing else is built on this path).
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """Native ZeRO-1, dp=2, fp32 moments, 5 steps (4 micro-batches per rank and step): the reference."""
    return run_torchrun(tmp_path_factory.mktemp("native"), "native", 2, *SHAPE, "parallel.zero=1", FP32,
                        "checkpoint.save_final=false")


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2])
def test_deepspeed_matches_native(tmp_path, native, zero):
    """Trainer end to end. ZeRO-2 with ep=2 (experts in DeepSpeed MoE groups, reduced over expert-dp) is
    checked at the optimizer level below, against the native optimizer."""
    _deepspeed()
    got = run_torchrun(tmp_path, f"ds{zero}", 2, *SHAPE, f"parallel.zero={zero}", DS, FP32,
                       "checkpoint.save_final=false")
    assert_losses_match(got, native, rel=1e-5)
    for g, w in zip(got, native):   # DeepSpeed's global norm (fp32) is the native one (fp64)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5)
    assert len({m["loss"] for m in got}) == len(got)


@pytest.mark.slow
def test_checkpoints_move_between_backends(tmp_path, native):
    """deepspeed ZeRO-2 (steps 1-2) -> native ZeRO-1 (step 3) -> deepspeed ZeRO-1 (steps 4-5), one
    checkpoint dir: the losses are those of the uninterrupted native run."""
    _deepspeed()
    ck = f"checkpoint.dir={tmp_path / 'ck'}"
    a = run_torchrun(tmp_path, "a", 2, *SHAPE, "parallel.zero=2", DS, FP32, ck, "train.stop_at_step=2")
    b = run_torchrun(tmp_path, "b", 2, *SHAPE, "parallel.zero=1", FP32, ck, "train.stop_at_step=3")
    c = run_torchrun(tmp_path, "c", 2, *SHAPE, "parallel.zero=1", DS, FP32, ck, "checkpoint.save_final=false")
    assert [m["step"] for m in a + b + c] == [1, 2, 3, 4, 5]
    assert_losses_match(a + b + c, native, rel=1e-5)


def test_deepspeed_backend_needs_two_processes():
    from parallel.dims import ParallelDims
    from parallel.zero.deepspeed_backend import DeepSpeedZero
    import models
    from errors import ConfigError
    with pytest.raises(ConfigError, match="zero_backend=deepspeed needs >= 2 data-parallel processes"):
        make_config("parallel.zero=1", DS)   # validation, before anything is built
    cfg = make_config("parallel.zero=1")
    cfg.parallel.zero_backend = "deepspeed"
    with pytest.raises(ValueError, match="torchrun --nproc_per_node >= 2"):
        DeepSpeedZero(models.build(cfg.model, seed=0), cfg.optim, ParallelDims(world_size=1), stage=1)


def test_deepspeed_is_imported_only_when_chosen():
    code = ("import sys, parallel.zero, parallel.zero.deepspeed_backend, trainer.train; "
            "assert 'deepspeed' not in sys.modules, 'deepspeed imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]


# ---- the optimizer object against the native one (2 gloo processes, no trainer) ---------------------
def _against_native_worker(rank, world):
    from torch.distributed.tensor import DTensor

    import models
    from parallel.dims import ParallelDims
    from parallel.ep import apply_ep
    from parallel.zero.deepspeed_backend import DeepSpeedZero
    from parallel.zero.native import ZeroOptimizer
    cfg = make_config()
    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    for stage, ep in ((1, 1), (2, 2)):
        dims = ParallelDims(world_size=world, rank=rank, ep=ep).build_groups()
        build = lambda: apply_ep(models.build(cfg.model, seed=0), dims)  # noqa: E731
        m_ds, m_nat, m_re = build(), build(), build()
        ds = DeepSpeedZero(m_ds, cfg.optim, dims, stage=stage, bucket_mb=0.25)   # several reduce buckets
        nat = ZeroOptimizer(m_nat, cfg.optim, dims, stage=stage, moment_dtype="fp32", bucket_mb=0.25)

        def train_step(pairs, seed, max_norm):
            """Two micro-batches of rank-dependent data into every (model, optimizer) pair; the norms."""
            for micro in range(2):
                g = torch.Generator().manual_seed(1000 * seed + 10 * rank + micro)
                ids = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=g)
                lab = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=g)
                for model, opt in pairs:
                    opt.backward(model.compute_loss(ids, lab, mtp_weight=0.3, aux_alpha=1e-3).loss / 2)
            norms = [float(opt.step(max_norm)) for _, opt in pairs]
            for _, opt in pairs:
                opt.zero_grad()
            return norms

        sd0 = ds.state_dict()["state"]   # before the first step (a resume's template): zeros
        assert {float(v["step"]) for v in sd0.values()} == {0.0}
        assert all(float(full(v[k]).abs().sum()) == 0 for v in sd0.values() for k in ("exp_avg", "exp_avg_sq"))

        # Step 1, no clipping: the same sums of the same gradients, so the same update up to rounding.
        n_ds, n_nat = train_step([(m_ds, ds), (m_nat, nat)], 0, max_norm=0.0)
        assert n_ds == pytest.approx(n_nat, rel=1e-6)
        for (name, p), q in zip(m_ds.named_parameters(), m_nat.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}")
        sd_ds, sd_nat = ds.state_dict()["state"], nat.state_dict()["state"]
        assert sd_ds.keys() == sd_nat.keys() == dict(m_ds.named_parameters()).keys()
        for name in sd_ds:
            assert float(sd_ds[name]["step"]) == 1
            for key in ("exp_avg", "exp_avg_sq"):
                a, b = full(sd_ds[name][key]), full(sd_nat[name][key])
                assert a.shape == b.shape   # global shapes (experts: all E of them)
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12, msg=lambda m, n=name, k=key: f"{n}.{k}: {m}")

        # Step 2, clipped to 0.5: the same global norm. Weights only to 1% of one step (lr): DeepSpeed
        # scales by 1 / (norm / max_norm) in fp32, native by max_norm / norm, and Adam's normalisation
        # turns that ulp of difference in nearly cancelling gradient elements into visible updates.
        n_ds, n_nat = train_step([(m_ds, ds), (m_nat, nat)], 1, max_norm=0.5)
        assert n_ds == pytest.approx(n_nat, rel=1e-5) and n_nat > 0.5
        for (name, p), q in zip(m_ds.named_parameters(), m_nat.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-2 * cfg.optim.lr, msg=lambda m, name=name: f"{name}: {m}")

        # resume: weights copied in, then the state; one more step on both gives the same weights
        m_re.load_state_dict(m_ds.state_dict())
        re = DeepSpeedZero(m_re, cfg.optim, dims, stage=stage, bucket_mb=0.25)
        re.load_state_dict(ds.state_dict())
        train_step([(m_ds, ds), (m_re, re)], 7, max_norm=0.5)
        for (name, p), q in zip(m_ds.named_parameters(), m_re.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)

        rep = ds.memory()   # fp32 moments of 1/dp (experts 1/edp) of this rank's parameters
        pad = 4 * (2 * world) * 4   # bytes: each of <= 4 flat groups is padded to a multiple of 2 x dp elements
        for key in ("params", "master", "optim", "grads"):
            assert 0 <= rep.measured[key] - rep.formula[key] <= 2 * pad, (key, rep.measured, rep.formula)
        assert rep.measured["optim"] == pytest.approx(2 * rep.measured["master"])


def test_optimizer_matches_native_zero_and_round_trips_state(tmp_path):
    """ZeRO-1 (ep=1) and ZeRO-2 (ep=2), steps of two micro-batches: gradient norm, weights and
    per-parameter moments (state_dict, global shapes) equal the native optimizer's; state_dict ->
    load_state_dict resumes exactly; memory() is the formula plus DeepSpeed's alignment padding."""
    _deepspeed()
    spawn(_against_native_worker, 2, tmp_path)
