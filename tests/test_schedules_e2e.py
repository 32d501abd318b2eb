"""The trainer under a batch-size ramp and the multi-phase LR schedule: what each step used, and a resume
mid-ramp equal to the run straight through (one process, and DualPipe pp=2 under torchrun)."""
import pytest

from configs.schema import LRPhase, OptimConfig
from checkpoint import CheckpointManager
from trainer.lr_schedule import lr_multiplier

from .trainer_utils import assert_losses_match, fast_overrides, read_jsonl, run_inprocess, run_torchrun

SEQ = 64
# 4 -> 16 sequences in steps of 4 over the first 3,072 tokens (1,024 tokens per increment): steps of
# 4, 4, 4, 4 (1,024 tokens) -> 8, 8 (2,048) -> 12 (2,816) -> 12 (3,584) -> 16 ...
RAMP = ["train.global_batch_size=16", "train.micro_batch_size=1", f"data.seq_len={SEQ}", "train.eval_batches=1",
        "train.eval_every=0", "train.batch_ramp.start=4", "train.batch_ramp.increment=4",
        "train.batch_ramp.tokens=3072"]
PHASES = ["optim.decay=phases", "optim.warmup_steps=2", "optim.lr=3e-3",
          "+optim.phases=[{tokens: 2048, lr: 3e-3}, {tokens: 4096, lr: 3e-4, shape: cosine}]"]
SIZES = [4, 4, 4, 4, 8, 8, 12, 12, 16, 16]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


def test_ramp_and_phases_resume_mid_ramp(tmp_path, cache):
    common = [*fast_overrides(tmp_path, cache), *RAMP, *PHASES, "train.max_steps=10"]
    run_inprocess(tmp_path / "straight", *common, f"checkpoint.dir={tmp_path}/ck_a")
    straight = read_jsonl(tmp_path / "straight/metrics.jsonl")
    assert [m["global_batch_size"] for m in straight] == SIZES
    tokens = [0] + [m["tokens"] for m in straight[:-1]]   # consumed before each step
    assert tokens[1:] == [sum(SIZES[:i + 1]) * SEQ for i in range(9)]
    o = OptimConfig(lr=3e-3, warmup_steps=2, decay="phases",
                    phases=[LRPhase(tokens=2048, lr=3e-3), LRPhase(tokens=4096, lr=3e-4, shape="cosine")])
    for i, (m, tok) in enumerate(zip(straight, tokens)):
        assert m["lr"] == pytest.approx(3e-3 * lr_multiplier(o, 10, i, tok), rel=1e-9), (i, m["lr"])
    assert straight[0]["lr"] == pytest.approx(1.5e-3) and straight[-1]["lr"] < 0.4 * 3e-3   # warmup; into the cosine

    run_inprocess(tmp_path / "split", *common, f"checkpoint.dir={tmp_path}/ck_b", "train.stop_at_step=5")
    assert CheckpointManager(tmp_path / "ck_b").latest().name == "step_00000005"
    run_inprocess(tmp_path / "split", *common, f"checkpoint.dir={tmp_path}/ck_b")
    split = read_jsonl(tmp_path / "split/metrics.jsonl")
    assert [m["global_batch_size"] for m in split] == SIZES
    assert [m["loss"] for m in split] == [m["loss"] for m in straight]   # bitwise
    assert [m["lr"] for m in split] == [m["lr"] for m in straight]


@pytest.mark.slow
def test_ramp_under_dualpipe_resumes_mid_ramp(tmp_path, cache):
    """DualPipe pp=2: 4..16 micro-batches (even, >= 2*pp) per step, the schedule rebuilt as the batch grows;
    stopped mid-ramp and resumed, the losses equal the single-process run straight through."""
    common = [*RAMP, *PHASES, "train.max_steps=8"]
    single = run_torchrun(tmp_path, "single", 1, *common, f"checkpoint.dir={tmp_path}/ck_s", steps=8)
    pipe = ["parallel.pp=2", "parallel.schedule=dualpipe", f"checkpoint.dir={tmp_path}/ck_p"]
    run_torchrun(tmp_path, "pipe", 2, *common, *pipe, "train.stop_at_step=5", steps=8)
    resumed = run_torchrun(tmp_path, "pipe", 2, *common, *pipe, steps=8)
    assert [m["global_batch_size"] for m in resumed] == SIZES[:8]
    assert_losses_match(resumed, single, rel=1e-5)
    for m in resumed:   # 2 ranks: the nested world all-reduce counts in "gradient reduction" only, once
        phases = {k: v for k, v in m.items() if k.startswith("time_")}
        assert "time_non_finite_stop_check_world_all_reduce_s" not in phases and "time_gradient_reduction_s" in phases
        assert sum(phases.values()) < m["step_time_s"]
        # rank 0's compute actions by kind: DualPipe's F, F&B (overlap is off at ep = 1: halves in sequence),
        # B, W and full backwards, inside its span, inside the forward/backward phase
        kinds = {k: v for k, v in m.items() if k.startswith("pipeline_") and k.endswith("_s") and k != "pipeline_span_s"}
        assert set(kinds) >= {"pipeline_f_s", "pipeline_fb_s", "pipeline_b_s", "pipeline_w_s"}, sorted(m)
        assert all(v > 0 for v in kinds.values()), kinds
        assert sum(kinds.values()) <= m["pipeline_span_s"] <= m["time_forward_backward_s"], m
