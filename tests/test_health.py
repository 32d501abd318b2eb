"""The health guard (trainer/health.py) and the rollback it triggers (Trainer.roll_back): quiet divergence with
finite values is caught, the run goes back to the newest checkpoint written while healthy, skips the data read
since, and a resume skips it too; checkpoints written while unhealthy never push out a healthy one."""
import hashlib
import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest

from checkpoint import HEALTH, CheckpointManager, written_healthy
from configs.schema import HealthConfig
from trainer.health import HealthGuard
from trainer.lifecycle import EXIT_FAILED

from .test_faults_runtime import _cmd, _env
from .trainer_utils import ROOT, make_config, read_jsonl

LN_V = math.log(1024)


def _guard(**kw) -> HealthGuard:
    return HealthGuard(HealthConfig(**kw), vocab_size=1024, full_imbalance=4.0)


def _steps(guard, rows):
    return [guard.check({"loss": loss, "grad_norm": gn, "max_expert_load_over_mean": imb}) for loss, gn, imb in rows]


def _healthy_run(n=40, imbalance=1.8):
    """A noisy, decreasing loss and a wandering gradient norm: what a healthy run looks like."""
    return [(LN_V - 2.5 * (1 - math.exp(-i / 15)) + 0.08 * math.sin(7 * i), 0.8 + 0.2 * math.sin(3 * i), imbalance)
            for i in range(n)]


def test_a_healthy_run_never_trips_the_guard():
    g = _guard(warmup_steps=10)
    assert _steps(g, _healthy_run(200)) == [None] * 200
    assert g.streak == 0 and g.loss.n == 200


@pytest.mark.parametrize("row, words", [
    ((2e6, 1.0, 1.8), "worse than guessing"),                          # a blow-up, from any step
    ((6.5, 0.0, 1.8), "no gradient"),                                  # collapsed
    ((6.9315, 0.5, 1.8), "back at ln(vocab)"),                         # collapsed to uniform after learning
    ((6.2, 1.0, 1.8), "typical step changes above the last healthy loss"),   # a loss spike
    ((4.6, 300.0, 1.8), "gradient norm 300 is"),                       # a gradient spike
    ((4.6, 1.0, 3.99), "routing collapse"),                            # every token to the same experts
])
def test_each_rule_marks_a_step_unhealthy_and_keeps_it_out_of_the_statistics(row, words):
    g = _guard(warmup_steps=10)
    _steps(g, _healthy_run(40))
    last, n = g.loss.last, g.loss.n
    why = g.check({"loss": row[0], "grad_norm": row[1], "max_expert_load_over_mean": row[2]})
    assert why is not None and words in why, why
    assert g.streak == 1 and (g.loss.last, g.loss.n) == (last, n)
    assert _steps(g, _healthy_run(41)[-1:]) == [None] and g.streak == 0


def test_routing_collapse_counts_only_after_balanced_routing():
    """Small models route near the limit (experts / top-k = 4 here) from the start: that is not a collapse."""
    g = _guard(warmup_steps=10)
    assert _steps(g, _healthy_run(40, imbalance=3.9)) == [None] * 40
    assert g.check({"loss": 4.6, "grad_norm": 1.0, "max_expert_load_over_mean": 4.0}) is None


def test_before_warm_up_only_blow_ups_and_collapse_count():
    g = _guard(warmup_steps=20)
    assert _steps(g, [(LN_V, 1.0, 1.0), (LN_V + 1, 50.0, 3.99), (LN_V, 1.0, 1.0)]) == [None] * 3
    assert "over 1000 x" in g.check({"loss": LN_V, "grad_norm": 4e4})   # the first update of optim.lr=1e3
    assert "no gradient" in g.check({"loss": LN_V, "grad_norm": 0.0})


def test_guard_state_round_trips():
    g = _guard()
    _steps(g, _healthy_run(30))
    g.check({"loss": 1e9, "grad_norm": 1.0})
    g.rollbacks, g.skipped = 1, [[5, 8]]
    h = _guard()
    h.load_state_dict(g.state_dict())
    assert h.state_dict() == g.state_dict() and h.streak == 1 and h.skipped == [[5, 8]]
    assert _steps(h, _healthy_run(35)[30:]) == _steps(g, _healthy_run(35)[30:])


def test_pruning_never_counts_unhealthy_checkpoints(tmp_path):
    """keep=2: the two newest healthy checkpoints stay, with every unhealthy one newer than them; an unhealthy
    one older than them goes."""
    mgr = CheckpointManager(tmp_path, keep=2)
    health = {1: True, 2: False, 3: True, 4: True, 5: False, 6: False, 7: False}
    for step, ok in health.items():
        d = tmp_path / f"step_{step:08d}"
        d.mkdir()
        (d / ".metadata").write_bytes(b"")
        (d / HEALTH).write_text(json.dumps({"healthy": ok}))
    mgr._prune(tmp_path / "step_00000007")
    assert [p.name for p in mgr.complete()] == [f"step_{s:08d}" for s in (3, 4, 5, 6, 7)]
    assert not written_healthy(tmp_path / "step_00000007") and written_healthy(tmp_path / "step_00000004")
    (tmp_path / "step_00000004" / HEALTH).write_text("{")   # unreadable: never the one kept
    assert not written_healthy(tmp_path / "step_00000004")


# ---- rollback in a real run ----------------------------------------------------------------------------------
def _fingerprint(ids) -> str:
    return hashlib.sha1(ids.numpy().tobytes()).hexdigest()


def _poison_data(trainer, first_steps: set[int], seen: dict):
    """Data that blows the model up: the batches read at ``first_steps`` before any rollback (and the same batches
    whenever they come again) multiply the step's LR by 1e4: a spike, then a broken model. ``seen["after"]``:
    the fingerprints of the batches read after a rollback."""
    next_batch, opt_step, roll_back = trainer.batches.next_batch, trainer.opt.step, trainer.roll_back
    state = SimpleNamespace(poisoned=False)

    def reading(*a, **k):
        ids, labels = next_batch(*a, **k)
        fp = _fingerprint(ids)
        if "rolled_back" in seen:
            seen["after"].append(fp)
        elif trainer.step + 1 in first_steps:
            seen.setdefault("bad", set()).add(fp)
        state.poisoned = fp in seen.get("bad", set())
        return ids, labels

    def stepping(*a, **k):
        groups = trainer.opt.optimizer.param_groups
        lrs = [g["lr"] for g in groups]
        if state.poisoned:
            for g in groups:
                g["lr"] *= 1e4
        try:
            return opt_step(*a, **k)
        finally:
            for g, lr in zip(groups, lrs):
                g["lr"] = lr

    def rolling_back():
        seen.setdefault("rolled_back", True)
        seen.setdefault("after", [])
        roll_back()

    trainer.batches.next_batch, trainer.opt.step, trainer.roll_back = reading, stepping, rolling_back


# A quarter of +exp=tiny's tokens per step: the rollback tests assert about steps, batches and losses, not size.
SMALL = ["train.global_batch_size=8", "train.micro_batch_size=4", "data.seq_len=64", "train.eval_batches=1"]


def _trainer(tmp_path, *overrides):
    from trainer.train import Trainer
    cfg = make_config(*SMALL, "logging.wandb.mode=disabled", "logging.progress=false", "train.eval_every=0",
                      f"data.cache_dir={tmp_path}/cache", "checkpoint.every=4", "checkpoint.keep=2",
                      "train.health.warmup_steps=5", *overrides)
    return Trainer(cfg, tmp_path / "run")


def test_a_data_caused_blow_up_is_rolled_back_skipped_and_resumed_without_it(tmp_path):
    seen: dict = {}
    trainer = _trainer(tmp_path, "train.max_steps=24")
    _poison_data(trainer, {10, 11}, seen)
    trainer.train()
    log = (tmp_path / "run" / "train.log").read_text()
    assert "step 11: unhealthy:" in log and "step 13: rolled back to step 8" in log, log[-3000:]
    g = trainer.health
    assert g.rollbacks == 1 and g.skipped == [[9, 13]], g.skipped
    assert len(seen["bad"]) == 2 and len(seen["after"]) == 24 - 8 and not seen["bad"] & set(seen["after"]), \
        "a skipped batch was read again"
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 25)), "metrics.jsonl holds one timeline"
    assert all(math.isfinite(r["loss"]) and r["loss"] < 7.5 for r in rows) and rows[-1]["rollbacks"] == 1
    assert rows[-1]["loss"] < rows[8]["loss"] < rows[0]["loss"] - 0.4   # decreasing, past the rollback
    mgr = CheckpointManager(tmp_path / "run" / "checkpoints", keep=2)
    assert [p.name for p in mgr.complete()] == ["step_00000020", "step_00000024"]
    assert all(written_healthy(p) for p in mgr.complete())


def test_resume_after_a_rollback_skips_the_same_data(tmp_path):
    """Stop right after the rollback (stop_at_step), resume: the second half equals an uninterrupted run's."""
    seen: dict = {}
    whole = _trainer(tmp_path / "whole", "train.max_steps=16")
    _poison_data(whole, {10, 11}, seen)
    whole.train()
    want = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "whole" / "run" / "metrics.jsonl")}

    seen2: dict = {}
    first = _trainer(tmp_path / "split", "train.max_steps=16", "train.stop_at_step=14")
    _poison_data(first, {10, 11}, seen2)
    first.train()
    assert first.health.rollbacks == 1 and first.step == 14
    second = _trainer(tmp_path / "split", "train.max_steps=16")
    assert second.health.rollbacks == 1 and second.health.skipped == first.health.skipped
    resumed = {"bad": seen2["bad"], "rolled_back": True, "after": []}
    _poison_data(second, set(), resumed)
    second.train()
    assert len(resumed["after"]) == 2 and not resumed["bad"] & set(resumed["after"])
    got = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "split" / "run" / "metrics.jsonl")}
    assert got == want


def test_persistent_divergence_stops_after_max_rollbacks_with_one_line(tmp_path):
    """``optim.lr=1e3``: the first update blows the model up and collapses it; every rollback to step 1 does it
    again; after train.health.max_rollbacks the run exits 3 with one line, and step 1 (healthy) is kept."""
    proc = subprocess.run([sys.executable, *_cmd(tmp_path / "run", tmp_path / "cache", 30, "optim.lr=1e3",
                                                 "optim.warmup_steps=0", "checkpoint.every=1", "checkpoint.keep=1",
                                                 "train.health.max_rollbacks=2")],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == EXIT_FAILED, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: step 4: training is unhealthy again after 2 rollback(s)"), last
    assert "train.health.max_rollbacks=2" in last and "Traceback" not in proc.stderr
    assert proc.stdout.count("rolled back to step 1") == 2, proc.stdout[-3000:]
    step1 = tmp_path / "run" / "checkpoints" / "step_00000001"
    assert last.endswith(f"(checkpoint.resume={step1})"), last
    kept = CheckpointManager(tmp_path / "run" / "checkpoints", keep=1).complete()
    assert kept[0] == step1 and written_healthy(step1) and all(not written_healthy(p) for p in kept[1:])


def test_rollback_on_two_ranks_keeps_the_collectives_paired(tmp_path):
    """ep=2 under NCCL's pairing rules: both ranks roll back together (the verdict comes from all-reduced values,
    the checkpoint choice from rank 0) and stop together, exit 3."""
    from .test_faults_runtime import launch_ranks
    procs = launch_ranks(tmp_path / "run", tmp_path / "cache", 2, 30, "parallel.ep=2", "optim.lr=1e3",
                         "optim.warmup_steps=0", "checkpoint.every=1", "train.health.max_rollbacks=1")
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [EXIT_FAILED, EXIT_FAILED], [e[-2000:] for _, e in outs]
    assert outs[0][0].count("rolled back to step 1") == 1, outs[0][0][-3000:]
    last = outs[0][1].strip().splitlines()[-1]
    assert "training is unhealthy again after 1 rollback(s)" in last and "Traceback" not in outs[0][1] + outs[1][1]
