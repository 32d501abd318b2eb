"""The trainer on a weighted blend of memory-mapped token datasets (Megatron-format shards): per-source
metrics, per-source validation, bitwise resume, and a resume under another data-parallel size."""
from pathlib import Path

import numpy as np
import pytest

from data.shards import write_shard

from .trainer_utils import assert_losses_match, fast_overrides, read_jsonl, run_inprocess, run_torchrun

SEQ = 32
COMMON = ["train.global_batch_size=8", "train.micro_batch_size=2", f"data.seq_len={SEQ}", "train.eval_batches=2",
          "train.eval_every=3"]


def _dataset(prefix, seed: int, n_docs: int, vocab: int = 1024, eos: int = 0):
    """Documents of 20-200 tokens of a per-source token range (so a source's share is visible), EOS-terminated."""
    rng = np.random.default_rng(seed)
    lo = 1 + 300 * seed
    docs = [np.append(rng.integers(lo, min(lo + 300, vocab), rng.integers(20, 200)), eos) for _ in range(n_docs)]
    write_shard(prefix, docs, np.uint16)
    return str(prefix)


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokens")
    train = [_dataset(d / name, i, n) for i, (name, n) in enumerate([("web", 300), ("code", 200), ("math", 100)])]
    val = [_dataset(d / "val_web", 0, 30), _dataset(d / "val_math", 2, 30)]
    spec = ", ".join(f"{{path: {p}, weight: {w}}}" for p, w in zip(train, (0.5, 0.3, 0.2)))
    vspec = ", ".join(f"{{path: {p}}}" for p in val)
    return [f"data.blend=[{spec}]", f"data.val_blend=[{vspec}]"]


def test_blend_trains_logs_sources_and_resumes_bitwise(tmp_path, blend):
    common = [*fast_overrides(tmp_path, tmp_path / "cache"), *COMMON, *blend, "train.max_steps=6"]
    run_inprocess(tmp_path / "straight", *common, f"checkpoint.dir={tmp_path}/ck_a")
    straight = read_jsonl(tmp_path / "straight/metrics.jsonl")
    last = straight[-1]
    shares = np.array([last[f"tokens/{n}"] for n in ("web", "code", "math")]) / last["tokens"]
    assert abs(sum(shares) - 1) < 1e-12 and np.all(np.abs(shares - [0.5, 0.3, 0.2]) <= 1 / 48 + 1e-9), shares
    evals = read_jsonl(tmp_path / "straight/eval.jsonl")
    assert [e["step"] for e in evals] == [0, 3, 6]
    assert all({"val_loss", "val_loss/val_web", "val_loss/val_math"} <= e.keys() for e in evals)
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert not (tmp_path / "cache").exists()   # no text corpus was tokenized

    run_inprocess(tmp_path / "split", *common, f"checkpoint.dir={tmp_path}/ck_b", "train.stop_at_step=3")
    run_inprocess(tmp_path / "split", *common, f"checkpoint.dir={tmp_path}/ck_b")
    split = read_jsonl(tmp_path / "split/metrics.jsonl")
    assert [m["loss"] for m in split] == [m["loss"] for m in straight]   # bitwise


def test_resume_with_another_blend_names_the_key(tmp_path, blend):
    common = [*fast_overrides(tmp_path, tmp_path / "cache"), *COMMON, "train.max_steps=2",
              f"checkpoint.dir={tmp_path}/ck"]
    run_inprocess(tmp_path / "a", *common, *blend, "train.stop_at_step=1")
    changed = [blend[0].replace("weight: 0.2", "weight: 0.4"), blend[1]]
    from errors import ConfigError
    with pytest.raises(ConfigError, match=r"^data\.blend: the checkpoint's blend was \[web .*weight 0\.2\)\], this run's is .*weight 0\.4\)\]"):
        run_inprocess(tmp_path / "a", *common, *changed)


@pytest.mark.slow
def test_blend_resumes_under_another_dp_size(tmp_path, blend):
    """dp=2 for 3 steps, then one process (dp=1): the losses equal a straight one-process run (the samples
    continue exactly; the sums differ only in reduction order)."""
    common = [*COMMON, *blend, "train.max_steps=5"]
    straight = run_torchrun(tmp_path, "straight", 1, *common, f"checkpoint.dir={tmp_path}/ck_s", steps=5)
    run_torchrun(tmp_path, "split", 2, *common, f"checkpoint.dir={tmp_path}/ck_x", "train.stop_at_step=3", steps=5)
    resumed = run_torchrun(tmp_path, "split", 1, *common, f"checkpoint.dir={tmp_path}/ck_x", steps=5)
    assert_losses_match(resumed, straight, rel=1e-5)


def test_data_path_at_a_token_dataset_points_at_data_blend(tmp_path, blend):
    """A prepared dataset (manifest.json), a Megatron prefix, its .bin file, a directory of pairs: one line, exit 2."""
    import json

    from .trainer_utils import run_cli
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    _dataset(prepared / "shard_00000", 0, 5)
    (prepared / "manifest.json").write_text(json.dumps({"format": "dsv3-tokens", "version": 1}))
    megatron = blend[0].split("path: ")[1].split(",")[0]   # the fixture's first source, a Megatron prefix
    for path in (prepared, megatron, f"{megatron}.bin"):
        proc = run_cli("+exp=tiny", f"data.path={path}", f"hydra.run.dir={tmp_path}/run", "train.max_steps=1",
                       f"data.cache_dir={tmp_path}/cache", "logging.wandb.mode=disabled", timeout=120)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines() == [
            f"error: data.path: {path} is a token dataset (tools.prepare_data output or Megatron .bin/.idx), already "
            f"tokenized, and data.path reads text: train on it with data.blend='[{{path: {path}}}]' instead of "
            "data.path"], proc.stderr
    from data.shards import is_token_dataset
    assert is_token_dataset(Path(megatron).parent)   # a directory of Megatron pairs
    (tmp_path / "text.txt").write_text("hello\n")
    assert not is_token_dataset(tmp_path / "text.txt") and not is_token_dataset(tmp_path / "nothing")


def test_resume_across_data_kinds_says_so_in_one_line(tmp_path, blend):
    """A checkpoint of a text-corpus run resumed with data.blend, and one of a blend run resumed on the text corpus:
    one line naming both kinds and the way on, exit 2, before anything is built (not "could not be loaded")."""
    from .trainer_utils import run_cli
    common = [*fast_overrides(tmp_path, tmp_path / "cache"), *COMMON, "train.max_steps=2", "train.stop_at_step=1"]
    run_inprocess(tmp_path / "text", *common, f"checkpoint.dir={tmp_path}/ck_text")
    run_inprocess(tmp_path / "tokens", *common, *blend, f"checkpoint.dir={tmp_path}/ck_tokens")
    cli = [a for a in common if "stop_at_step" not in a] + ["+exp=tiny"]
    proc = run_cli(*cli, *blend, f"checkpoint.dir={tmp_path}/ck_text", f"hydra.run.dir={tmp_path}/text", timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    ck = tmp_path / "ck_text" / "step_00000001"
    assert proc.stderr.strip().splitlines() == [
        f"error: data.blend: the checkpoint {ck} was trained on a text corpus (data.path, or the embedded corpus), "
        "this run reads token datasets (data.blend); a run cannot switch between the two (its data position indexes "
        "one stream). Resume with the checkpoint's data settings, or start a new run directory with "
        f"checkpoint.init_from={ck} to train on from its weights (fresh optimizer and data order, step 0)"], proc.stderr
    proc = run_cli(*cli, f"checkpoint.dir={tmp_path}/ck_tokens", f"hydra.run.dir={tmp_path}/tokens", timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().startswith(
        f"error: data.blend: the checkpoint {tmp_path / 'ck_tokens' / 'step_00000001'} was trained on token datasets "
        "(data.blend), this run reads a text corpus (the embedded corpus); a run cannot switch"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    # a checkpoint without config.yaml (converted, or older): its own data state says which kind it was
    from errors import ConfigError
    from trainer.run_state import config_changes

    from .trainer_utils import make_config
    for ck, now in [(tmp_path / "ck_text" / "step_00000001", blend), (tmp_path / "ck_tokens" / "step_00000001", [])]:
        (ck / "config.yaml").unlink()
        with pytest.raises(ConfigError, match=r"^data\.blend: the checkpoint .* was trained on "):
            config_changes(make_config(*COMMON, *now), ck)
        assert config_changes(make_config(*COMMON, *(blend if not now else [])), ck) is None
