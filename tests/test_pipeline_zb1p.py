"""End to end: torchrun with the zero-bubble schedule (ZB1P: split backward, B then deferred W) reproduces
the single-process losses, like the schedules in ``test_pipeline_e2e.py``."""
import pytest

from .trainer_utils import assert_losses_match, run_torchrun as run


@pytest.mark.slow
def test_torchrun_zb1p_matches_single_process(tmp_path):
    shape = ("data.seq_len=32", "train.eval_batches=1")   # the parity does not depend on the length
    single = run(tmp_path, "single", 1, *shape)
    zb1p = run(tmp_path, "zb1p", 2, *shape, "parallel.pp=2", "parallel.schedule=zb1p")
    assert_losses_match(zb1p, single)   # rel 1e-5 per step
    assert len({m["loss"] for m in single}) > 1
