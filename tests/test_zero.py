"""Native ZeRO-1/2 (parallel/zero): parity with single-device AdamW under dp / EP / DualPipe layouts,
memory accounting, and DCP checkpoints that reshard between layouts."""
import math

import pytest
import torch
import torch.distributed as dist

from .dist_utils import spawn
from .trainer_utils import assert_losses_match, run_torchrun

FP32 = "optim.moment_dtype=fp32"
# Sequences of 32 tokens, +exp=tiny's 8 micro-batches of 2 (so 2 to 4 per rank in every layout here), one
# validation batch: the parity of the losses does not depend on the length, and each step costs a quarter.
SHAPE = ["data.seq_len=32", "train.eval_batches=1"]


def run(tmp_path, name: str, nproc: int, *overrides: str, steps: int) -> list[dict]:
    return run_torchrun(tmp_path, name, nproc, *SHAPE, *overrides, steps=steps)


@pytest.fixture(scope="module")
def single10(tmp_path_factory):
    """Single process, torch.optim.AdamW (fp32 moments), 10 steps: the reference."""
    return run(tmp_path_factory.mktemp("single10"), "single", 1, FP32, steps=10)


@pytest.fixture(scope="module")
def single6(tmp_path_factory):
    return run(tmp_path_factory.mktemp("single6"), "single", 1, FP32, steps=6)


def test_chunk_range_is_torch_chunk():
    from parallel.zero.native import chunk_range
    for n in (0, 1, 3, 7, 8, 64, 65):
        for k in (1, 2, 3, 4, 8):
            pieces = torch.arange(n).chunk(k) if n else []
            got = [chunk_range(n, k, i) for i in range(k)]
            want = [(int(p[0]), len(p)) for p in pieces] + [(n, 0)] * (k - len(pieces))
            assert [g for g in got if g[1]] == [w for w in want if w[1]], (n, k)
            assert sum(length for _, length in got) == n


@pytest.mark.slow
@pytest.mark.parametrize("nproc,overrides", [
    (2, ("parallel.zero=1",)),                                                        # dp=2
    (2, ("parallel.zero=2",)),                                                        # dp=2
    (4, ("parallel.zero=2", "parallel.zero_bucket_mb=0.5")),                          # dp=4, many buckets
    (4, ("parallel.zero=1", "parallel.ep=2")),                                        # dp=4, ep=2: experts / edp 2
    (4, ("parallel.zero=2", "parallel.ep=4", "parallel.ranks_per_node=2")),          # experts not replicated
    (4, ("parallel.zero=1", "parallel.pp=2", "parallel.schedule=dualpipe")),         # DualPipe pp=2 x dp=2
    (4, ("parallel.zero=2", "parallel.pp=2", "parallel.ep=2", "parallel.schedule=dualpipe")),
], ids=["z1-dp2", "z2-dp2", "z2-dp4-buckets", "z1-dp4-ep2", "z2-dp4-ep4", "z1-dualpipe-dp2", "z2-dualpipe-ep2"])
def test_zero_matches_single_device_adamw(tmp_path, single10, nproc, overrides):
    got = run(tmp_path, "zero", nproc, FP32, *overrides, steps=10)
    assert_losses_match(got, single10, rel=1e-6)
    for g, w in zip(got, single10):   # the global norm (over shards, pp ranks, replicas) is the same number
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5)


@pytest.mark.slow
def test_bf16_moments_stay_close(tmp_path, single10):
    """BF16 AdamW moments (the default under ZeRO): within 1e-3 relative of fp32 moments over 10 steps."""
    got = run(tmp_path, "bf16", 2, "parallel.zero=1", steps=10)
    assert_losses_match(got, single10, rel=1e-3)
    assert any(abs(g["loss"] - w["loss"]) > 0 for g, w in zip(got, single10)), "bf16 moments were not used"


# ---- memory accounting ----------------------------------------------------------------------------
def _memory_worker(rank, world):
    from parallel.dims import ParallelDims
    from parallel.ep import apply_ep
    from parallel.zero import build_optimizer, moment_dtype
    from tests.trainer_utils import make_config
    import models
    out = {}
    for zero, ep, weights, pp in ((0, 1, "fp32", 1), (1, 1, "fp32", 1), (2, 2, "fp32", 1), (1, 1, "bf16", 1),
                                  (2, 1, "fp32", 2)):
        cfg = make_config(f"parallel.zero={zero}")
        cfg.parallel.ep = ep   # make_config validates for one process; the layout is this world's
        dims = ParallelDims(world_size=world, rank=rank, ep=ep, pp=pp).build_groups()
        model = apply_ep(models.build(cfg.model, seed=0), dims)
        p = cfg.parallel
        rep = build_optimizer(model, cfg.optim, dims, p.zero, p.zero_backend, p.zero_bucket_mb, weights=weights).memory()
        key = (zero, ep) if pp == 1 else (zero, ep, pp)
        out[key if weights == "fp32" else weights] = (rep.measured, rep.formula, rep.dense_params, rep.expert_params,
                           moment_dtype(cfg.optim.moment_dtype, p.zero, p.zero_backend, weights),
                           rep.line())
    measured0, formula0, n_dense, n_expert, _, _ = out[(0, 1)]
    n = n_dense + n_expert
    assert measured0 == formula0 and measured0["optim"] == 2 * 4 * n   # replicated fp32 AdamW
    measured1, formula1, _, _, mdt, line = out[(1, 1)]
    assert mdt == "bf16"
    # ZeRO-1, dp=4: a quarter of the state of this rank's parameters (bf16 moments: 2 x 2 bytes each);
    # shards are padded to equal pieces, so allow a few elements per parameter tensor
    pad = 64 * 4 * 2 * 2
    assert formula1["optim"] == round(2 * 2 * n / 4)
    assert formula1["optim"] <= measured1["optim"] <= formula1["optim"] + pad
    assert measured1["optim"] / (2 * 2 * n) == pytest.approx(0.25, rel=0.02)
    assert formula1["master"] <= measured1["master"] <= formula1["master"] + pad
    assert measured1["params"] == formula1["params"] == 4 * n
    assert f"optim {measured1['optim'] / 2**20:.2f} MiB (formula {formula1['optim'] / 2**20:.2f} MiB)" in line
    # ZeRO-2 with ep=2: experts are split over ep, then over edp = 2; dense over dp = 4
    measured2, formula2, d2, e2, _, _ = out[(2, 2)]
    shard = d2 / 4 + e2 / 2
    assert formula2["grads"] == round(4 * shard) <= measured2["grads"] <= round(4 * shard) + pad
    assert math.isclose(measured2["optim"], 4 * shard, rel_tol=0.02)
    # ZeRO-1 with BF16 weights: 2-byte weights, FP32 gradients; the FP32 master is sharded as with FP32 weights
    measured_b, formula_b, *_ = out["bf16"]
    assert measured_b["params"] == formula_b["params"] == 2 * n and formula_b["master"] == formula1["master"]
    assert measured_b["grads"] == formula_b["grads"] == 4 * n and measured_b["master"] == measured1["master"]
    # ZeRO-2 under a pipeline (pp=2, dp=2): the executor accumulates full gradients over the step, reduced at
    # the step as ZeRO-1; only the optimizer state is sharded
    measured_p, formula_p, n_d, n_e, _, _ = out[(2, 1, 2)]
    assert measured_p["grads"] == formula_p["grads"] == 4 * (n_d + n_e)
    assert math.isclose(measured_p["optim"], 2 * 2 * (n_d + n_e) / 2, rel_tol=0.02)   # bf16 moments, dp=2


def test_memory_accounting_dp4(tmp_path):
    spawn(_memory_worker, 4, tmp_path)


# ---- resharding checkpoints ------------------------------------------------------------------------
@pytest.mark.slow
def test_reshard_pp2_dp2_ep2_to_dp4_ep4(tmp_path, single6):
    """(pp=2 DualPipe, dp=2, ep=2, ZeRO-1) -> (pp=1, dp=4, ep=4, ZeRO-2): experts move between ranks,
    optimizer pieces are re-cut; the 6 losses equal an uninterrupted single-device run."""
    ck = tmp_path / "ck"
    first = run(tmp_path, "a", 4, FP32, "parallel.pp=2", "parallel.ep=2", "parallel.schedule=dualpipe",
                "parallel.zero=1", f"checkpoint.dir={ck}", "train.stop_at_step=3", steps=6)
    rest = run(tmp_path, "b", 4, FP32, "parallel.ep=4", "parallel.ranks_per_node=2", "parallel.zero=2",
               f"checkpoint.dir={ck}", steps=6)
    assert [m["step"] for m in first] == [1, 2, 3]
    assert_losses_match(first + rest, single6, rel=1e-5)


@pytest.mark.slow
def test_reshard_dualpipe_pp4_to_single_process(tmp_path, single6):
    ck = tmp_path / "ck"
    first = run(tmp_path, "a", 4, FP32, "parallel.pp=4", "parallel.schedule=dualpipe", "parallel.zero=1",
                f"checkpoint.dir={ck}", "train.stop_at_step=3", steps=6)
    rest = run(tmp_path, "b", 1, FP32, f"checkpoint.dir={ck}", steps=6)   # no ZeRO: torch AdamW
    assert_losses_match(first + rest, single6, rel=1e-5)


@pytest.mark.slow
def test_torn_checkpoint_fails_clearly(tmp_path):
    """A ZeRO checkpoint written by 2 ranks loses one shard file: resuming (here in one process) exits 2
    with one line naming the file, before anything is read (it is the only checkpoint, so there is nothing
    older to fall back to)."""
    from .trainer_utils import run_cli
    ck = tmp_path / "ck"
    run_torchrun(tmp_path, "a", 2, "parallel.zero=1", f"checkpoint.dir={ck}", steps=2)
    step = ck / "step_00000002"
    shard = step / "__1_0.distcp"
    assert shard.is_file()
    shard.unlink()
    proc = run_cli("+exp=tiny", "train.max_steps=4", "logging.wandb.mode=disabled", "logging.progress=false",
                   f"hydra.run.dir={tmp_path / 'b'}", f"data.cache_dir={tmp_path}/cache", f"checkpoint.dir={ck}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith(f"error: checkpoint.resume=auto: the only checkpoint in {ck} does not verify"), lines
    assert f"{shard} is missing" in lines[0] and "checkpoint.resume=none" in lines[0], lines
