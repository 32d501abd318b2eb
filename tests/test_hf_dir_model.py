"""``checkpoint.init_from=<HF dir>`` alone: model, tokenizer and step-0 loss from the directory; a data tokenizer
with other ids is a one-line error; the step dir keeps the whole tokenizer and ``convert_hf export`` writes it back."""
import dataclasses
import json

import pytest
import torch
import yaml

pytest.importorskip("transformers")
from transformers import AutoTokenizer  # noqa: E402

from configs.schema import compose  # noqa: E402
from data import PackedBatches, load_corpus  # noqa: E402
from errors import ConfigError  # noqa: E402
from models.hf import config_from_hf_dir  # noqa: E402
from tools.convert_hf import main as convert_main  # noqa: E402
from trainer.startup import check_init_tokenizer  # noqa: E402

from .test_hf import one_thread, random_hf_model  # noqa: E402,F401
from .test_hf_sharded import tiny_tokenizer  # noqa: E402
from .trainer_utils import make_config, read_jsonl, run_cli  # noqa: E402

# No preset has this shape: 2 layers of dim 48, 2 expert groups of 4 experts, vocab 320
SHAPE = dict(vocab_size=320, n_group=2, topk_group=1)
SMALL = ["train.max_steps=2", "train.global_batch_size=4", "train.micro_batch_size=2", "data.seq_len=32",
         "train.eval_batches=1", "train.eval_every=0", "logging.wandb.mode=disabled", "logging.progress=false"]
CHAT = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{{ eos_token }}{% endfor %}"


def full_tokenizer():
    """A byte-level BPE with bos, eos, pad, an extra special token and a chat template."""
    tok = tiny_tokenizer()
    tok.add_special_tokens({"bos_token": "<|begin|>", "pad_token": "<|pad|>", "additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = CHAT
    return tok


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    random_hf_model(11, **SHAPE).save_pretrained(out)
    full_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def trained(hf_dir, tmp_path_factory):
    """``python -m trainer checkpoint.init_from=<HF dir>`` with no model, tokenizer or experiment keys: 2 steps."""
    tmp = tmp_path_factory.mktemp("run")
    args = [f"checkpoint.init_from={hf_dir}", *SMALL, f"data.cache_dir={tmp}/cache", f"hydra.run.dir={tmp}/run"]
    proc = run_cli(*args, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, [a for a in args if not a.startswith("hydra.")]


def test_hf_dir_alone_is_the_model_and_its_tokenizer(hf_dir, trained):
    tmp, args = trained
    saved = yaml.safe_load((tmp / "run/config.yaml").read_text())
    assert saved["model"] == dataclasses.asdict(config_from_hf_dir(hf_dir)) and saved["model"]["dim"] == 48
    assert saved["data"]["tokenizer"] == str(hf_dir)
    cfg = compose(args)   # as the trainer composed it: the corpus is in the cache, tokenized by the HF tokenizer
    corpus = load_corpus(cfg.data, cfg.model.vocab_size)
    assert corpus.cache_hit and corpus.eos_id == AutoTokenizer.from_pretrained(hf_dir).eos_token_id
    ids, labels = PackedBatches(corpus.train_tokens, cfg.data.seq_len, cfg.train.global_batch_size,
                                cfg.train.seed).next_batch()
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        want = float(torch.nn.functional.cross_entropy(hf(input_ids=ids).logits.flatten(0, 1), labels.flatten()))
    lines = read_jsonl(tmp / "run/metrics.jsonl")
    assert [m["step"] for m in lines] == [1, 2]
    assert abs(lines[0]["loss"] - want) <= 1e-5 * want, (lines[0]["loss"], want)


def test_export_round_trips_the_tokenizer(hf_dir, trained, tmp_path, capsys):
    """The step dir keeps the tokenizer's files; export writes them, and config.json's ids are its bos/eos/pad."""
    step = trained[0] / "run/checkpoints/step_00000002"
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= {p.name for p in step.iterdir()}
    assert (trained[0] / "run/tokenizer/tokenizer_config.json").is_file()
    assert convert_main(["export", str(step), str(tmp_path / "out")]) == 0
    assert f"tokenizer from {step}" in capsys.readouterr().out
    want, got = AutoTokenizer.from_pretrained(hf_dir), AutoTokenizer.from_pretrained(tmp_path / "out")
    for k in ("bos_token", "eos_token", "pad_token", "bos_token_id", "eos_token_id", "pad_token_id", "chat_template",
              "all_special_tokens", "all_special_ids"):
        assert getattr(got, k) == getattr(want, k), k
    assert "<|im_start|>" in got.all_special_tokens and got.get_vocab() == want.get_vocab()
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert [config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == \
        [want.bos_token_id, want.eos_token_id, want.pad_token_id] and want.pad_token_id is not None


def test_another_tokenizer_is_refused_in_one_line(hf_dir, tmp_path):
    other = tmp_path / "tokenizer.json"   # the same BPE without the added special tokens: 300 tokens, not 303
    tiny_tokenizer().backend_tokenizer.save(str(other))
    proc = run_cli(f"checkpoint.init_from={hf_dir}", f"data.tokenizer={other}", *SMALL, f"data.cache_dir={tmp_path}/c",
                   f"hydra.run.dir={tmp_path}/run", timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: data.tokenizer: {other} is not the tokenizer of checkpoint.init_from={hf_dir} ({hf_dir}): 300 vs 303 "
        "tokens; leave data.tokenizer unset to train with that one, or start from weights trained with yours"]
    assert not (tmp_path / "c").exists()   # refused before the corpus was read


def test_token_datasets_of_another_tokenizer_are_refused(hf_dir, tmp_path):
    from tools.prepare_data import prepare
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"document {i} of the blend"}) + "\n"
                                                 for i in range(20)))
    other = tmp_path / "other"
    tiny_tokenizer(290).save_pretrained(other)
    for name, tok in (("same", hf_dir), ("other", other)):
        prepare([str(tmp_path / "docs.jsonl")], str(tmp_path / name), str(tok), progress=False)
    same = make_config(f"checkpoint.init_from={hf_dir}", f"data.blend=[{{path: {tmp_path / 'same'}}}]")
    check_init_tokenizer(same)
    assert same.data.tokenizer is None and same.model.dim == 48
    cfg = make_config(f"checkpoint.init_from={hf_dir}", f"data.blend=[{{path: {tmp_path / 'same'}}}]",
                      f"data.val_blend=[{{path: {tmp_path / 'other'}}}]")
    with pytest.raises(ConfigError, match=rf"^data\.val_blend\[0\]: {tmp_path / 'other'} was tokenized with "
                                          rf"{tmp_path / 'other' / 'tokenizer'}, which is not the tokenizer of "
                                          r"checkpoint\.init_from=.*: 290 vs 303 tokens; prepare it again with"):
        check_init_tokenizer(cfg)


def test_model_keys_on_top_a_preset_kept_and_a_dir_without_tokenizer(hf_dir, tmp_path):
    hf_model = config_from_hf_dir(hf_dir)
    cfg = make_config(f"checkpoint.init_from={hf_dir}", "model.max_seq_len=200", "model.init_std=0.01")
    assert cfg.model == dataclasses.replace(hf_model, max_seq_len=200, init_std=0.01)
    assert make_config(f"checkpoint.init_from={hf_dir}", "model=tiny").model.dim == 128   # the preset, checked on load
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in hf_dir.iterdir():
        if f.suffix == ".safetensors" or f.name == "config.json":
            (bare / f.name).symlink_to(f)
    cfg = make_config(f"checkpoint.init_from={bare}")
    assert cfg.model == hf_model and cfg.data.tokenizer is None
    with pytest.raises(ConfigError, match=rf"^checkpoint\.init_from: {bare} holds no tokenizer .*set data\.tokenizer"):
        check_init_tokenizer(cfg)


def test_resume_after_the_init_from_directory_is_gone(hf_dir, tmp_path):
    """With the HF directory deleted, a run resumes from its own checkpoint (the tokenizer path's change listed,
    not refused); a new run still names the missing directory."""
    import shutil
    src = tmp_path / "hf"
    shutil.copytree(hf_dir, src)
    run = tmp_path / "run"
    args = [f"checkpoint.init_from={src}", *SMALL, f"data.cache_dir={tmp_path}/cache", f"hydra.run.dir={run}"]
    assert run_cli(*args, timeout=300).returncode == 0
    shutil.rmtree(src)
    proc = run_cli(*[a.replace("train.max_steps=2", "train.max_steps=4") for a in args], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    whole = tmp_path / "whole"   # the same 4 steps uninterrupted, from the HF directory itself
    uninterrupted = [a.replace(str(src), str(hf_dir)).replace(str(run), str(whole)) for a in args]
    assert run_cli(*[a.replace("max_steps=2", "max_steps=4") for a in uninterrupted], timeout=300).returncode == 0
    assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in read_jsonl(whole / "metrics.jsonl")],
                                                         rel=1e-6)
    step2 = run / "checkpoints" / "step_00000002"
    assert f"data.tokenizer: {src} -> {step2}" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    saved = yaml.safe_load((run / "checkpoints" / "step_00000004" / "config.yaml").read_text())
    assert saved["model"] == dataclasses.asdict(config_from_hf_dir(hf_dir))
    fresh = run_cli(*[a.replace(str(run), str(tmp_path / "new")) for a in args], timeout=300)
    assert fresh.returncode == 2 and str(src) in fresh.stderr.strip().splitlines()[-1], fresh.stderr[-3000:]
