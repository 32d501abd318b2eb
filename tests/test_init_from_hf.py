"""checkpoint.init_from with Hugging Face weights: a DeepseekV3 directory split across safetensors files (and
the checkpoint `tools.convert_hf import` makes of it) -> the trainer's step-0 loss equals the HF model's loss
on the same batch; the same weights under torchrun pp=2 x ep=2."""
import numpy as np
import pytest
import torch

import models
from models.hf_export import to_hf
from tools.convert_hf import main as convert_main
from data import PackedBatches
from trainer.train import Trainer

from .trainer_utils import assert_losses_match, fast_overrides, make_config, read_jsonl, run_torchrun

SMALL = ["train.global_batch_size=8", "train.micro_batch_size=2", "data.seq_len=64", "train.eval_batches=1",
         "train.eval_every=0", "checkpoint.save_final=false"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """Random weights of the tiny preset (another seed than the trainer's), as HF files: 3+ shards, and a tokenizer
    (the trainer's data tokenizer: checkpoint.init_from carries it)."""
    from .test_hf_sharded import tiny_tokenizer
    out = tmp_path_factory.mktemp("hf")
    model = models.build(make_config().model, device="cpu", seed=1234)
    to_hf(model, out, max_shard_bytes=2 * 2**20, tokenizer=tiny_tokenizer())
    assert len(list(out.glob("model-*.safetensors"))) >= 3
    return out


def _hf_loss(hf_dir, ids, labels) -> float:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=ids).logits
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))


def _fp8_copy(hf_dir, out):
    """The same weights in DeepSeek's FP8 release layout (float8 linears + weight_scale_inv), 3 files."""
    from safetensors.torch import load_file
    from transformers import DeepseekV3Config

    from bench.hf_import_rss import write_hf_checkpoint
    sd = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        sd.update(load_file(f))
    write_hf_checkpoint(sd, DeepseekV3Config.from_pretrained(str(hf_dir)), out, n_files=3, fp8=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((hf_dir / f).read_bytes())
    return out


def _our_loss(model_dir, ids, labels) -> float:
    """Loss of our model loaded from ``model_dir`` with ``models.hf.from_hf`` (FP8 dequantised)."""
    from models.hf import from_hf
    model = from_hf(model_dir).eval()
    with torch.no_grad():
        logits = model(ids)
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))


@pytest.mark.parametrize("via", ["hf_dir", "imported", "fp8"])
def test_step0_loss_equals_the_hf_models(tmp_path, hf_dir, via):
    src = hf_dir
    if via == "imported":   # tools.convert_hf import -> our checkpoint -> init_from (the model config it recorded)
        assert convert_main(["import", str(hf_dir), str(tmp_path / "imported")]) == 0
        src = tmp_path / "imported"
    if via == "fp8":        # transformers cannot run the FP8 layout on CPU: compare with from_hf's dequantised model
        src = _fp8_copy(hf_dir, tmp_path / "fp8")
    cfg = make_config(*fast_overrides(tmp_path, tmp_path / "cache"), *SMALL, "train.max_steps=5",
                      f"checkpoint.init_from={src}")
    trainer = Trainer(cfg, tmp_path / "run")
    first = PackedBatches(trainer.corpus.train_tokens, cfg.data.seq_len, cfg.train.global_batch_size,
                          cfg.train.seed).next_batch()
    want = _our_loss(src, *first) if via == "fp8" else _hf_loss(hf_dir, *first)
    trainer.train()
    lines = read_jsonl(tmp_path / "run/metrics.jsonl")
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5] and np.isfinite([m["loss"] for m in lines]).all()
    assert abs(lines[0]["loss"] - want) <= 1e-5 * want, (lines[0]["loss"], want)
    assert "initialised from" in (tmp_path / "run/train.log").read_text()


@pytest.mark.slow
def test_init_from_hf_under_pp2_ep2(tmp_path, hf_dir):
    common = [*SMALL, "train.micro_batch_size=1", f"checkpoint.init_from={hf_dir}", "train.max_steps=5"]
    single = run_torchrun(tmp_path, "single", 1, *common, steps=5)
    layout = run_torchrun(tmp_path, "pp2ep2", 4, *common, "parallel.pp=2", "parallel.ep=2",
                          "parallel.schedule=dualpipe", steps=5)
    assert_losses_match(layout, single, rel=1e-5)
