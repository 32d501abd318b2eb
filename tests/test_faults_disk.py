"""A full disk anywhere the trainer writes (run dir files via a link to /dev/full, lock, W&B run, data.cache_dir,
a real full tmpfs where allowed) is one line naming the file and what to do, exit 2, no checkpoint lost."""
import errno
import os
import subprocess
import types

import numpy as np
import pytest

from checkpoint import CheckpointManager
from errors import WriteError

from .trainer_utils import read_jsonl, run_cli, run_inprocess

SMALL = ["train.global_batch_size=8", "train.micro_batch_size=4", "data.seq_len=64", "train.eval_batches=1",
         "train.eval_every=0", "logging.wandb.mode=disabled", "logging.progress=false"]
PARAS = [f"Paragraph {i}: the {['quick', 'lazy', 'brown'][i % 3]} fox number {i} jumps over {i * 7} dogs."
         for i in range(40)]


def enospc(path=None):
    return OSError(errno.ENOSPC, "No space left on device", *([str(path)] if path is not None else []))


def sd(step: int) -> str:
    return f"step_{step:08d}"


def one_error_line(proc) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


# ---- the run dir ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,what", [("metrics.jsonl", "the metrics of step 3"),
                                       ("eval.jsonl", "the validation loss of step 4"),
                                       ("train.log", "the run log"),
                                       ("config.yaml", "the resolved config")])
def test_full_run_dir_is_one_line_and_the_checkpoints_stay(tmp_path, cache, name, what):
    """Run 2 resumes run 1 with ``name`` on /dev/full: one line, exit 2, checkpoints intact and `latest` the newest;
    run 3 (link gone) resumes from step 2 and finishes."""
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    args = ["+exp=tiny", *SMALL, f"data.cache_dir={cache}", f"hydra.run.dir={run}"]
    run_inprocess(run, *args[1:-1], "train.max_steps=2")
    (run / name).unlink()
    (run / name).symlink_to("/dev/full")
    proc = run_cli(*args, "train.max_steps=4", "checkpoint.every=1", timeout=300)
    line = one_error_line(proc)
    assert line.startswith(f"error: hydra.run.dir: writing {what} to {run / name} failed: errno 28 (ENOSPC"), line
    assert "Free space" in line and "checkpoint.resume=auto" in line, line
    saved = [2, 3] if name == "eval.jsonl" else [2]   # step 4's validation, and step 3's metrics, come before its save
    assert sorted(p.name for p in CheckpointManager(ck).step_dirs()) == [sd(s) for s in saved]
    assert all(CheckpointManager(ck).verify(ck / sd(s)).ok for s in saved)
    assert (ck / "latest").read_text().strip() == sd(saved[-1])
    assert not list(ck.glob(".tmp-*")) and not (run / ".owner.json").exists()
    if name == "metrics.jsonl":
        (run / name).unlink()
        proc = run_cli(*args, "train.max_steps=4", timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"resumed from {ck / sd(2)} at step 2" in proc.stdout
        assert [m["step"] for m in read_jsonl(run / name)] == [3, 4]


def test_wandb_run_on_a_full_disk_names_its_dir(tmp_path, monkeypatch):
    import trainer.metrics as metrics_mod
    from omegaconf import OmegaConf

    from .trainer_utils import make_config

    def start_run(*a, **k):
        raise enospc(tmp_path / "wandb" / "offline-run-x" / "files" / "config.yaml")
    monkeypatch.setattr(metrics_mod, "start_run", start_run)
    cfg = OmegaConf.to_container(OmegaConf.structured(make_config()))
    with pytest.raises(WriteError) as e:
        metrics_mod.MetricsLogger(tmp_path, types.SimpleNamespace(mode="offline"), cfg, total_steps=2, start_step=0,
                                  progress=False)
    msg = str(e.value)
    assert msg.startswith(f"hydra.run.dir: writing the W&B run to {tmp_path / 'wandb'} failed: {tmp_path}/wandb/"
                          "offline-run-x/files/config.yaml: errno 28 (ENOSPC"), msg
    assert "logging.wandb.mode=disabled" in msg and "\n" not in msg


def test_lock_on_a_full_disk_leaves_no_half_written_lock(tmp_path, monkeypatch):
    """A lock file left empty would read as another run's for 15 minutes: it goes with the error."""
    import trainer.owner as owner_mod

    def dump(obj, f):
        raise enospc()
    monkeypatch.setattr(owner_mod.json, "dump", dump)
    with pytest.raises(WriteError, match=rf"^checkpoint.dir: writing this run's lock on the directory to "
                                         rf"{tmp_path}/.owner.json failed: errno 28 \(ENOSPC"):
        owner_mod.Owner(tmp_path, "checkpoint.dir").take()
    assert not (tmp_path / owner_mod.OWNER_FILE).exists()


# ---- data.cache_dir -------------------------------------------------------------------------------------------
def test_full_cache_dir_names_the_token_arrays_and_leaves_no_temp_file(tmp_path, monkeypatch):
    import data.corpus as corpus_mod
    f = tmp_path / "docs.txt"
    f.write_text("\n\n".join(PARAS))
    cache = tmp_path / "cache"
    real = np.save

    def save(file, arr, *a, **k):
        if len(arr) > 200:   # the training split; the tokenizer was written first
            raise enospc()
        return real(file, arr, *a, **k)
    monkeypatch.setattr(corpus_mod.np, "save", save)
    cfg = types.SimpleNamespace(path=str(f), tokenizer=None, seq_len=8, text_field="text", val_fraction=0.05,
                                cache_dir=str(cache))
    with pytest.raises(WriteError) as e:
        corpus_mod.load_corpus(cfg, 300)
    msg = str(e.value)
    assert msg.startswith("data.cache_dir: writing the tokenized corpus (train split, ") and "\n" not in msg, msg
    assert f"to {cache}/tokens-" in msg and ".train.npy failed: errno 28 (ENOSPC" in msg, msg
    assert "set data.cache_dir to a disk with room" in msg and "nothing was trained" in msg
    left = sorted(p.name for p in cache.iterdir() if p.is_file())
    assert len(left) == 1 and left[0].startswith("tokenizer-"), left   # no temp file, no index of a half cache

    def load_dataset(*a, **k):   # datasets wraps the OSError of its Arrow writer in its own error
        try:
            raise enospc(cache / "hf_datasets" / "text" / "x.arrow")
        except OSError as err:
            raise RuntimeError("An error occurred while generating the dataset") from err
    import datasets
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    cfg.cache_dir = str(tmp_path / "cache2")
    with pytest.raises(WriteError, match=rf"^data.cache_dir: writing the datasets cache of data.path to "
                                         rf"{tmp_path}/cache2/hf_datasets failed: .*x.arrow: errno 28 \(ENOSPC"):
        corpus_mod.load_corpus(cfg, 300)


@pytest.fixture
def full_tmpfs(tmp_path):
    """A 16 KiB tmpfs: too small for the tokenizer the tiny run trains. Needs mount rights (root); else skipped."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_full_cache_dir_at_startup_cli(tmp_path, full_tmpfs):
    proc = run_cli("+exp=tiny", *SMALL, f"data.cache_dir={full_tmpfs}/cache", f"hydra.run.dir={tmp_path}/run",
                   "train.max_steps=1", timeout=300)
    line = one_error_line(proc)
    assert line.startswith(f"error: data.cache_dir: writing the byte-level BPE trained on the corpus to "
                           f"{full_tmpfs}/cache/tokenizer-"), line
    assert "errno 28 (ENOSPC" in line and "nothing was trained" in line, line
    assert not list((tmp_path / "run").glob("checkpoints/step_*")) and not list((full_tmpfs / "cache").iterdir())
