"""Checkpoint integrity: manifest + sha256 verified on load, damaged checkpoints skipped
(auto) or refused (explicit path) naming the file, `latest` honoured (unless a save completed after it), an unwritable checkpoint.dir caught at
start-up, a full disk leaving earlier checkpoints intact, no checkpoint with inf/nan, safe pruning."""
import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import checkpoint.manager as ckpt_mod
from checkpoint import (CheckpointDirError, CheckpointManager, CheckpointWriteError, DamagedCheckpointError,
                                NoGoodCheckpointError, NonFiniteStateError)
from checkpoint.__main__ import main as verify_main
from errors import ConfigError
from trainer.owner import OWNER_FILE   # the live trainer's lock on checkpoint.dir

from .trainer_utils import assert_losses_match, fast_overrides, make_config, read_jsonl, run_cli, \
    run_inprocess, run_torchrun

SMALL = ["train.global_batch_size=8", "train.micro_batch_size=4", "data.seq_len=64", "train.eval_batches=1",
         "train.eval_every=0"]
SHARD = "__0_0.distcp"


def sd(step: int) -> str:
    return f"step_{step:08d}"


class Base:
    """One uninterrupted 6-step run with checkpoints at steps 2, 4, 6; tests damage copies of them."""

    def __init__(self, tmp: Path):
        self.tmp, self.cache = tmp, tmp / "cache"
        self.common = [*fast_overrides(tmp, self.cache), *SMALL, "train.max_steps=6"]
        self.ck = tmp / "ck"
        run_inprocess(tmp / "run", *self.common, f"checkpoint.dir={self.ck}", "checkpoint.every=2", "checkpoint.keep=0")
        self.losses = {m["step"]: m["loss"] for m in read_jsonl(tmp / "run/metrics.jsonl")}

    def copy(self, dst: Path, steps=(2, 4)) -> Path:
        dst.mkdir(parents=True)
        for s in steps:
            shutil.copytree(self.ck / sd(s), dst / sd(s))
        (dst / "latest").write_text(sd(max(steps)) + "\n")
        return dst

    def trainer(self, run: Path, ck: Path, *extra: str):
        from trainer.train import Trainer
        run.mkdir(parents=True, exist_ok=True)
        return Trainer(make_config(*self.common, f"checkpoint.dir={ck}", *extra), run)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # 2 shared cores: oversubscribed intra-op threads stall badly
    yield Base(tmp_path_factory.mktemp("base"))
    torch.set_num_threads(threads)


def flip(path: Path, n: int = 64) -> None:
    """Invert ``n`` bytes in the middle of a file (tensor data of a shard), size unchanged."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + n] = bytes(b ^ 0xFF for b in data[mid:mid + n])
    path.write_bytes(bytes(data))


def verifies(path: Path) -> bool:
    return CheckpointManager(path.parent).verify(path).ok


# ---- damaged checkpoints -------------------------------------------------------------------------------
def test_flipped_shard_bytes_auto_falls_back_with_warning_and_same_losses(tmp_path, base, capsys):
    ck = base.copy(tmp_path / "ck")
    flip(ck / sd(4) / SHARD)
    run_inprocess(tmp_path / "run", *base.common, "train.max_steps=4", f"checkpoint.dir={ck}", "checkpoint.every=2")
    err = capsys.readouterr().err
    assert f"skipping damaged checkpoint {ck / sd(4)}: {ck / sd(4) / SHARD} fails its sha256 check" in err, err
    lines = read_jsonl(tmp_path / "run/metrics.jsonl")
    assert [m["step"] for m in lines] == [3, 4]   # resumed from step 2
    assert [m["loss"] for m in lines] == [base.losses[3], base.losses[4]]   # bitwise, as uninterrupted
    # the good step-2 checkpoint survived; the damaged step 4 was replaced by a fresh, verified save
    assert verifies(ck / sd(2)) and verifies(ck / sd(4))
    assert (ck / "latest").read_text().strip() == sd(4)


def test_flipped_shard_bytes_explicit_path_is_a_one_line_error(tmp_path, base):
    ck = base.copy(tmp_path / "ck", steps=(4,))
    flip(ck / sd(4) / SHARD)
    proc = run_cli("+exp=tiny", *base.common, f"checkpoint.resume={ck / sd(4)}", f"hydra.run.dir={tmp_path}/run",
                   f"data.cache_dir={tmp_path}/fresh-cache", timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: checkpoint.resume: checkpoint"), proc.stderr
    assert str(ck / sd(4) / SHARD) in err[0] and "sha256" in err[0] and "checkpoint.resume=" in err[0]
    assert not (tmp_path / "run/metrics.jsonl").exists()
    assert not (tmp_path / "fresh-cache").exists()   # checked before the corpus and the model


def _truncate(p: Path):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


DAMAGE = {   # what is done to step 4 -> (file named in the warning, words in the warning)
    "truncated shard": (lambda d: _truncate(d / SHARD), SHARD, "bytes, manifest.json says"),
    "missing shard": (lambda d: (d / SHARD).unlink(), SHARD, "is missing"),
    "corrupt .metadata": (lambda d: flip(d / ".metadata", 16), ".metadata", "sha256"),
    "corrupt manifest": (lambda d: (d / "manifest.json").write_text('{"files": '), "manifest.json", "corrupt"),
    "edited model_config.yaml": (lambda d: (d / "model_config.yaml").write_text(   # same size, same values
        (d / "model_config.yaml").read_text()[:-1] + " "), "model_config.yaml", "sha256"),
    "no manifest": (lambda d: (d / "manifest.json").unlink(), "manifest.json", "is missing"),
    "no .metadata, no manifest": (lambda d: [(d / f).unlink() for f in (".metadata", "manifest.json")],
                                  "manifest.json", "is missing"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_newest_checkpoint_is_skipped_naming_the_file(tmp_path, base, capsys, kind):
    ck = base.copy(tmp_path / "ck")
    damage, name, words = DAMAGE[kind]
    damage(ck / sd(4))
    assert CheckpointManager(ck).resolve("auto") == ck / sd(2)   # what the trainer resumes from
    err = capsys.readouterr().err
    warn = [line for line in err.splitlines() if "skipping damaged checkpoint" in line]
    assert len(warn) == 1 and str(ck / sd(4) / name) in warn[0] and words in warn[0], err


def test_corrupt_metadata_error_names_the_path(tmp_path, base):
    """The checksum catches it, and the error names the file (one line), not a bare pickle traceback; without
    its manifest the checkpoint cannot be verified at all, and the error says that."""
    ck = base.copy(tmp_path / "ck", steps=(4,))
    (ck / sd(4) / ".metadata").write_bytes(b"\x80\x04not a pickle at all")
    with pytest.raises(DamagedCheckpointError, match="checkpoint.resume: .*" + str(ck / sd(4) / ".metadata")):
        base.trainer(tmp_path / "run", ck, f"checkpoint.resume={ck / sd(4)}")
    (ck / sd(4) / "manifest.json").unlink()
    with pytest.raises(DamagedCheckpointError) as e:
        base.trainer(tmp_path / "run", ck, f"checkpoint.resume={ck / sd(4)}")
    msg = str(e.value)
    assert str(ck / sd(4) / "manifest.json") + " is missing" in msg and "\n" not in msg, msg
    assert isinstance(e.value, ConfigError)


def test_latest_is_honoured_validated_and_repaired(tmp_path, base, capsys):
    ck = base.copy(tmp_path / "ck")
    mgr = CheckpointManager(ck)
    latest, done_4 = ck / "latest", (ck / sd(4) / "manifest.json").stat().st_mtime_ns
    latest.write_text(sd(2) + "\n")                     # a roll-back written after step 4's save: honoured,
    os.utime(latest, ns=(done_4 + 10**9, done_4 + 10**9))        # the newer dir of the abandoned timeline named
    assert mgr.resolve("auto") == ck / sd(2)
    assert f"the newer {sd(4)} is older than that choice and not used" in capsys.readouterr().err
    latest.write_text(sd(2) + "\n")                     # a save killed between its rename and the `latest` update:
    os.utime(latest, ns=(done_4 - 10**9, done_4 - 10**9))        # step 4 completed after `latest` was written
    assert mgr.resolve("auto") == ck / sd(4)
    assert f"resuming from {ck / sd(4)} instead of {sd(2)}" in capsys.readouterr().err
    assert latest.read_text().strip() == sd(4)
    latest.write_bytes(b"step_0000\xff\n")              # not UTF-8: ignored with a warning, then repaired
    assert mgr.resolve("auto") == ck / sd(4)
    assert "latest cannot be read (not UTF-8 text); ignoring it" in capsys.readouterr().err
    (ck / "latest").write_text("garbage\n")             # not a step dir: ignored, then repaired
    assert mgr.resolve("auto") == ck / sd(4)
    assert "names 'garbage'" in capsys.readouterr().err
    assert (ck / "latest").read_text().strip() == sd(4)
    (ck / "latest").unlink()                            # missing: newest first, and written again
    assert mgr.resolve("auto") == ck / sd(4) and (ck / "latest").read_text().strip() == sd(4)
    flip(ck / sd(4) / SHARD)                            # names a damaged one: fall back, point it at the good one
    assert mgr.resolve("auto") == ck / sd(2)
    assert (ck / "latest").read_text().strip() == sd(2)


def test_no_checkpoint_verifies_is_a_one_line_error_listing_them(tmp_path, base, capsys):
    ck = base.copy(tmp_path / "ck")
    flip(ck / sd(4) / SHARD)
    _truncate(ck / sd(2) / SHARD)
    with pytest.raises(NoGoodCheckpointError) as e:
        CheckpointManager(ck).resolve("auto")
    msg = str(e.value)
    assert "\n" not in msg and "none of the 2 checkpoints" in msg, msg
    assert capsys.readouterr().err == ""   # no warnings besides the error: it lists everything
    assert str(ck / sd(4) / SHARD) in msg and str(ck / sd(2) / SHARD) in msg and "checkpoint.resume=none" in msg
    assert CheckpointManager(tmp_path / "empty").resolve("auto") is None   # nothing there: a fresh start


def test_verify_command(tmp_path, base, capsys):
    ck = base.copy(tmp_path / "ck")
    assert verify_main([str(ck)]) == 0
    flip(ck / sd(2) / SHARD)
    assert verify_main([str(ck)]) == 1 and verify_main([str(ck / sd(4))]) == 0
    out = capsys.readouterr().out
    assert f"DAMAGED  {ck / sd(2)}: {ck / sd(2) / SHARD} fails its sha256 check" in out, out


# ---- the checkpoint dir and write errors -----------------------------------------------------------------
def test_unwritable_checkpoint_dir_fails_at_startup(tmp_path, base):
    """A path under a regular file cannot be created, even by root (chmod would not stop root)."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    cache = tmp_path / "fresh-cache"
    proc = run_cli("+exp=tiny", *SMALL, f"data.cache_dir={cache}", "logging.wandb.mode=disabled",
                   f"checkpoint.dir={blocker}/ck", f"hydra.run.dir={tmp_path}/run", timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: checkpoint.dir: {blocker}/ck cannot be created"), proc.stderr
    assert "errno 20 (ENOTDIR" in err[0]
    assert not cache.exists()   # failed before the corpus was tokenized (and before the model was built)


def test_readonly_checkpoint_dir_fails_at_startup(tmp_path, base, monkeypatch):
    """Read-only storage, simulated: creating the probe file fails with EROFS."""
    real_open = ckpt_mod.os.open

    def ro_open(path, flags, *a, **kw):   # os.open's signature: shutil.rmtree passes dir_fd=
        if ".probe-" in str(path):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(ckpt_mod.os, "open", ro_open)
    with pytest.raises(CheckpointDirError, match=rf"checkpoint.dir: {tmp_path}/ro cannot be created or written "
                                                 rf"\(rank 0: {tmp_path}/ro/.probe-.*errno 30 \(EROFS"):
        base.trainer(tmp_path / "run", tmp_path / "ro")
    # a run that never saves does not need a writable dir (and does not create one)
    base.trainer(tmp_path / "run", tmp_path / "ro2", "checkpoint.save_final=false")
    assert not (tmp_path / "ro2").exists()


def _enospc(path):
    return OSError(errno.ENOSPC, "No space left on device", str(path))


@pytest.mark.parametrize("where", ["shard", "manifest"])
def test_disk_full_during_save_keeps_earlier_checkpoints(tmp_path, base, monkeypatch, where):
    ck = base.copy(tmp_path / "ck")
    t = base.trainer(tmp_path / "run", ck, "checkpoint.every=2", "checkpoint.keep=1")
    assert t.step == 4
    if where == "shard":   # inside DCP's write of the tensor data
        import torch.distributed.checkpoint.filesystem as fs
        real = fs.FileSystem.create_stream

        def create_stream(self, path, mode):
            if str(path).endswith(".distcp") and "w" in mode:
                raise _enospc(path)
            return real(self, path, mode)
        monkeypatch.setattr(fs.FileSystem, "create_stream", create_stream)
        bad_file = f"{ck}/.tmp-{sd(6)}/{SHARD}"
    else:                  # our own write, after DCP finished
        real = ckpt_mod._write_synced

        def write_synced(path, data):
            if path.name == "manifest.json":
                raise _enospc(path)
            return real(path, data)
        monkeypatch.setattr(ckpt_mod, "_write_synced", write_synced)
        bad_file = f"{ck}/.tmp-{sd(6)}/manifest.json"
    t.step = 6
    with pytest.raises(CheckpointWriteError) as e:
        t.save()   # what train() calls every checkpoint.every steps
    msg = str(e.value)
    assert e.value.errno == errno.ENOSPC and isinstance(e.value, ConfigError)
    assert f"saving step 6 to {ck / sd(6)} failed" in msg and f"{bad_file}: errno 28 (ENOSPC" in msg, msg
    assert "\n" not in msg
    assert not list(ck.glob(".tmp-*")) and not (ck / sd(6)).exists()
    assert sorted(p.name for p in ck.iterdir()) == [OWNER_FILE, "latest", sd(2), sd(4)]   # nothing pruned (keep=1)
    assert verifies(ck / sd(2)) and verifies(ck / sd(4))
    assert (ck / "latest").read_text().strip() == sd(4)


@pytest.mark.parametrize("tensor", ["model", "optim"])
def test_state_with_nan_is_never_written(tmp_path, base, tensor):
    ck = base.copy(tmp_path / "ck")
    t = base.trainer(tmp_path / "run", ck)
    name = next(n for n, p in t.model.named_parameters() if p.dim() > 1)
    with torch.no_grad():
        if tensor == "model":
            dict(t.model.named_parameters())[name].view(-1)[3] = float("nan")
            want = f"model.{name}"
        else:
            t.opt.state_dict()["state"][name]["exp_avg"].view(-1)[3] = float("inf")
            want = f"optim.state.{name}.exp_avg"
    t.step = 5
    with pytest.raises(NonFiniteStateError) as e:
        t.save()
    assert f"refusing to save step 5: {want} holds inf or nan, so nothing was written" in str(e.value), str(e.value)
    assert sorted(p.name for p in ck.iterdir()) == [OWNER_FILE, "latest", sd(2), sd(4)]


def test_pruning_never_removes_the_newest_good_checkpoint(tmp_path, base, capsys):
    """step 6 is damaged: resume from 4, save 5 with keep=1. Step 5 (verified) stays; the damaged 6 is not
    counted as the one to keep (it is left for the user), and the older 2 and 4 go."""
    ck = base.copy(tmp_path / "ck", steps=(2, 4, 6))
    flip(ck / sd(6) / SHARD)
    t = base.trainer(tmp_path / "run", ck, "checkpoint.keep=1")
    assert t.step == 4 and f"skipping damaged checkpoint {ck / sd(6)}" in capsys.readouterr().err
    t.step = 5   # as after one more training step
    assert t.save() == ck / sd(5)
    assert sorted(p.name for p in ck.iterdir()) == [OWNER_FILE, "latest", sd(5), sd(6)]
    assert verifies(ck / sd(5)) and not verifies(ck / sd(6))
    assert (ck / "latest").read_text().strip() == sd(5)


# ---- two ranks -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_ranks_agree_on_the_fallback_when_only_one_rank_sees_the_damage(tmp_path):
    """EP=2 under torchrun. Verification hashes files rank::world of the sorted list, so rank 1 alone
    hashes __0_0.distcp; both ranks must still skip step 4 (else they would load different steps)."""
    ck = tmp_path / "ck"
    common = ["parallel.ep=2", f"checkpoint.dir={ck}", "checkpoint.every=2", "parallel.timeout_s=60", *SMALL]
    first = run_torchrun(tmp_path, "a", 2, *common, "train.stop_at_step=4", steps=6)
    files = sorted(json.loads((ck / sd(4) / "manifest.json").read_text())["files"])
    assert files[1::2][0] == SHARD and "__1_0.distcp" in files
    flip(ck / sd(4) / SHARD)
    rest = run_torchrun(tmp_path, "b", 2, *common, steps=6)   # a disagreement would hang: parallel.timeout_s
    assert [m["step"] for m in rest] == [3, 4, 5, 6]
    assert_losses_match(rest[:2], first[2:4], rel=0)
    assert verifies(ck / sd(4)) and verifies(ck / sd(6))


# ---- a real SIGKILL between a step dir's rename and the `latest` update --------------------------------------
KILL_BEFORE_LATEST = """
import os, runpy, signal, sys
import checkpoint.manager as m
write_latest = m.CheckpointManager._write_latest

def killed(self, name, quiet=False):   # step_00000004 is complete and renamed: die before `latest` names it
    if name == "step_00000004":
        os.kill(os.getpid(), signal.SIGKILL)
    return write_latest(self, name, quiet)

m.CheckpointManager._write_latest = killed
sys.argv = ["trainer", *sys.argv[1:]]
runpy.run_module("trainer", run_name="__main__")
"""


def test_sigkill_between_rename_and_latest_resumes_from_the_complete_dir(tmp_path, base):
    """The process dies (SIGKILL, no handler runs) right after step 4's dir is renamed into place, before
    `latest` is re-pointed from step 2: checkpoint.resume=auto takes step 4, and the losses match."""
    import subprocess
    import sys
    run, ck = tmp_path / "run", tmp_path / "ck"
    args = ["+exp=tiny", *base.common, f"hydra.run.dir={run}", f"checkpoint.dir={ck}", "checkpoint.every=2",
            "checkpoint.keep=0"]
    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", KILL_BEFORE_LATEST, *args], cwd=Path(__file__).parents[1],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert (ck / "latest").read_text().strip() == sd(2) and verifies(ck / sd(4))
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resumed from {ck / sd(4)} at step 4" in done.stdout, done.stdout[-2000:]
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert {r["step"]: r["loss"] for r in rows} == base.losses   # the uninterrupted run's
