"""End to end: torchrun with expert + data parallelism reproduces the single-process losses."""
import pytest

from .trainer_utils import assert_losses_match, run_torchrun

# Sequences of 32 tokens in +exp=tiny's 8 micro-batches of 2, one validation batch: the parity of the losses does
# not depend on the length, and each step costs a quarter.
SHAPE = ("data.seq_len=32", "train.eval_batches=1")


def run(tmp_path, name: str, nproc: int, *overrides: str) -> list[dict]:
    return run_torchrun(tmp_path, name, nproc, *SHAPE, *overrides)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    return run(tmp, "single", 1)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ("parallel.ep=4", "parallel.ranks_per_node=2"),     # 2 EP nodes x 2 ranks: hierarchical all-to-all
    ("parallel.ep=2",),                                 # dp=4, ep=2: expert-dp replicas
])
def test_torchrun_ep_matches_single_process(tmp_path, single, overrides):
    got = run(tmp_path, "ep", 4, *overrides)
    assert_losses_match(got, single)
    assert all(m["ep_max_nodes_per_token"] <= 1 for m in got)        # tiny: M = 1
    assert all(m["ep_cross_node_tokens"] > 0 for m in got)


@pytest.mark.slow
def test_ep_checkpoint_resume_and_reshard_to_single_process(tmp_path, single):
    ck = tmp_path / "ck"
    first = run(tmp_path, "a", 2, "parallel.ep=2", f"checkpoint.dir={ck}", "train.stop_at_step=3")
    # resume the EP=2 checkpoint in one process: experts saved as shards of the global tensor
    rest = run(tmp_path, "b", 1, f"checkpoint.dir={ck}")
    assert_losses_match(first + rest, single)
