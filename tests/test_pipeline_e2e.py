"""End to end: torchrun with pipeline parallelism (DualPipe, DualPipeV, 1F1B; EP inside) reproduces the
single-process losses, and a pipeline checkpoint resumes in one process."""
import pytest

from .trainer_utils import assert_losses_match, run_torchrun as run


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run(tmp_path_factory.mktemp("single"), "single", 1)


@pytest.mark.slow
@pytest.mark.parametrize("nproc,overrides", [
    (4, ("parallel.pp=4", "parallel.schedule=dualpipe")),
    (4, ("parallel.pp=2", "parallel.ep=2", "parallel.schedule=dualpipe")),
    (4, ("parallel.pp=2", "parallel.ep=2", "parallel.schedule=dualpipe", "parallel.overlap=false")),  # plain F then B
    (2, ("parallel.pp=2", "parallel.schedule=dualpipev")),
    (2, ("parallel.pp=2", "parallel.schedule=1f1b")),
])
def test_torchrun_pipeline_matches_single_process(tmp_path, single, nproc, overrides):
    assert_losses_match(run(tmp_path, "pp", nproc, *overrides), single)


@pytest.mark.slow
def test_dualpipe_checkpoint_resumes_in_one_process(tmp_path, single):
    ck = tmp_path / "ck"
    first = run(tmp_path, "a", 2, "parallel.pp=2", "parallel.schedule=dualpipe", f"checkpoint.dir={ck}",
                "train.stop_at_step=3")
    rest = run(tmp_path, "b", 1, f"checkpoint.dir={ck}")
    assert_losses_match(first + rest, single)
