"""HF ``transformers`` DeepseekV3 <-> ours (models/hf.py, tools/convert_hf.py): logit parity, MTP layout,
FP8 import, the CLI round trip and unsupported configs."""
import json
import logging
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

import models  # noqa: E402
from models import ModelConfig, ModelError  # noqa: E402
from models.hf import hf_state_dict  # noqa: E402
from models.hf_config import config_from_hf, config_to_hf  # noqa: E402
from models.layers import rope_cos_sin  # noqa: E402
from tools.convert_hf import load_model_checkpoint, main, save_model_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5

BASE = dict(vocab_size=96, hidden_size=48, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
            topk_group=1, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, routed_scaling_factor=2.5,
            max_position_embeddings=256, num_nextn_predict_layers=0)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
CASES = {
    "qlora-4groups-top2-2shared": dict(q_lora_rank=24, n_group=4, topk_group=2, n_shared_experts=2),
    "3layers-2dense-yarn": dict(num_hidden_layers=3, first_k_dense_replace=2, rope_parameters=YARN),
    "2groups-top1-k3-yarn-mscale": dict(n_group=2, topk_group=1, num_experts_per_tok=3, routed_scaling_factor=1.0,
                                        rope_parameters={**YARN, "mscale_all_dim": 0.8, "rope_theta": 5000.0}),
    "qlora-2groups-2shared-k4": dict(q_lora_rank=16, n_group=2, topk_group=1, n_shared_experts=2,
                                     num_experts_per_tok=4, num_hidden_layers=3),
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny ops: with 2 threads on this 2-core box, OpenMP spin-waiting makes them ~100x slower under load."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def random_hf_model(seed: int, **overrides) -> DeepseekV3ForCausalLM:
    """Tiny HF model with weights large enough (std 0.1) and a non-zero balancing bias, so routing matters."""
    torch.manual_seed(seed)
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(**{**BASE, **overrides}, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.1)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.05, 0.05)
    return hf


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@contextmanager
def transformers_warnings():
    """Collect the records ``transformers`` logs at WARNING or above (its logger does not propagate)."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize("case", list(CASES))
def test_logit_parity(case, tmp_path):
    hf = random_hf_model(sum(map(ord, case)), **CASES[case])
    ids = torch.randint(0, BASE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        ours = models.from_hf(hf).eval()
        assert max_diff(ours(ids), ref) <= TOL
        for moe in ours.moe_layers():   # the bias only steers selection: it must change some choices
            moe.gate.expert_bias.zero_()
        assert max_diff(ours(ids), ref) > 1e-3
        ours = models.from_hf(hf).eval()

        models.to_hf(ours, tmp_path)
        with transformers_warnings() as warned:
            back = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
        assert not warned, [r.getMessage() for r in warned]
        assert max_diff(back(ids).logits, ref) <= TOL
        assert max_diff(models.from_hf(tmp_path).eval()(ids), ref) <= TOL


def tiny_cfg(**overrides) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=64, dim=16, n_layers=2, inter_dim=32, moe_inter_dim=8, n_heads=2,
                                 kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                                 n_expert_groups=2, n_limited_groups=1, mtp_depth=1), **overrides})


def randomised(cfg: ModelConfig, seed: int = 1):
    model = models.build(cfg, seed=seed)
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.gate.expert_bias.uniform_(-0.05, 0.05)
    return model


@pytest.mark.parametrize("n_layers", [2, 61])
def test_mtp_round_trip(n_layers, tmp_path):
    """MTP module k is written as DeepSeek's ``model.layers.{n_layers + k}``; HF must load the dir silently."""
    cfg = tiny_cfg(n_layers=n_layers)
    ours = randomised(cfg).eval()
    models.to_hf(ours, tmp_path)
    # transformers skips unexpected layer-61 keys silently (the 671B layout) and warns on others -> side file
    expected = ["model.safetensors"] + ([] if n_layers == 61 else ["mtp.safetensors"])
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == expected
    stored = {}
    for name in expected:
        stored.update(load_file(tmp_path / name))
    mtp_keys = {k for k in stored if k.startswith(f"model.layers.{n_layers}.")}
    assert {f"model.layers.{n_layers}.{k}" for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                                     "shared_head.norm.weight", "shared_head.head.weight")} <= mtp_keys
    assert torch.equal(stored[f"model.layers.{n_layers}.shared_head.head.weight"], ours.head.weight)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1

    back = models.from_hf(tmp_path)
    assert back.cfg.mtp_depth == 1
    a, b = ours.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]

    with transformers_warnings() as warned:
        hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert not warned, [r.getMessage() for r in warned]
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert max_diff(hf(ids).logits, ours(ids)) <= TOL


def test_transformers_mtp_drafter_reads_our_layout(tmp_path):
    """With the 671B layer numbering, transformers' own MTP drafter (``generate(use_mtp=True)``) loads our
    MTP module from the main file and computes what ours does (concat order, block, ``shared_head.norm``)."""
    modeling_layers = pytest.importorskip("transformers.modeling_layers")
    if not hasattr(modeling_layers, "MtpModel"):
        pytest.skip("this transformers has no MtpModel")
    cfg = tiny_cfg(n_layers=61)
    ours = randomised(cfg).eval()
    models.to_hf(ours, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    layer = modeling_layers.MtpModel.from_pretrained(hf).layers[0]
    T = 12
    h, emb = torch.randn(2, T, cfg.dim), torch.randn(2, T, cfg.dim)
    pos = torch.arange(T)[None]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        theirs = layer(emb, h, hf.model.rotary_emb(h, pos), mask, pos, None)
        mine = ours.mtp[0].norm(ours.mtp[0](h, emb, rope_cos_sin(cfg, T, h.device)))
    assert max_diff(theirs, mine) <= TOL


def test_no_mtp_writes_no_extra_keys(tmp_path):
    models.to_hf(randomised(tiny_cfg(mtp_depth=0)), tmp_path)
    assert [p.name for p in tmp_path.glob("*.safetensors")] == ["model.safetensors"]
    assert not any(k.startswith("model.layers.2.") for k in load_file(tmp_path / "model.safetensors"))
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 0


def test_sharded_export_and_bf16(tmp_path):
    ours = randomised(tiny_cfg()).to(torch.bfloat16)
    models.to_hf(ours, tmp_path, max_shard_bytes=4_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((tmp_path / f).is_file() for f in files)
    assert "mtp.safetensors" not in files and not (tmp_path / "model.safetensors").exists()
    back = models.from_hf(tmp_path, dtype=torch.bfloat16)
    a, b = ours.state_dict(), back.state_dict()
    assert all(torch.equal(a[k], b[k].to(a[k].dtype)) for k in a)
    with transformers_warnings() as warned:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not warned, [r.getMessage() for r in warned]


def test_fp8_block_quantised_import(tmp_path):
    """DeepSeek's release stores linear weights as float8 + ``weight_scale_inv`` per block; import dequantises."""
    ours = randomised(tiny_cfg(mtp_depth=0))
    models.to_hf(ours, tmp_path)
    sd, block, expected = load_file(tmp_path / "model.safetensors"), 8, {}
    for key in [k for k in sd if k.endswith("proj.weight")]:
        w = sd[key]
        rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
        tiles = torch.nn.functional.pad(w, (0, cols * block - w.shape[1], 0, rows * block - w.shape[0]))
        scale = tiles.view(rows, block, cols, block).abs().amax((1, 3)) / 448
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:w.shape[0], :w.shape[1]]
        sd[key] = (w / full).to(torch.float8_e4m3fn)
        sd[key + "_scale_inv"] = scale
        expected[key] = sd[key].float() * full
    save_file(sd, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    back = models.from_hf(tmp_path)
    got = hf_state_dict(back)
    assert len(expected) > 20 and all(torch.equal(got[key], want) for key, want in expected.items())
    w13 = back.layers[1].ffn.experts.w13
    assert max_diff(w13, ours.layers[1].ffn.experts.w13) < 0.1 * ours.layers[1].ffn.experts.w13.abs().max()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.convert_hf", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow   # two interpreter start-ups (~4 s each: torch, transformers' config, DCP imports)
def test_cli_import_export_round_trip(tmp_path):
    hf = random_hf_model(7, **CASES["qlora-4groups-top2-2shared"])
    hf.save_pretrained(tmp_path / "hf")   # transformers' own on-disk layout (one tensor per expert)
    for args in (("import", tmp_path / "hf", tmp_path / "ckpt"), ("export", tmp_path / "ckpt", tmp_path / "out")):
        done = run_cli(*map(str, args))
        assert done.returncode == 0, done.stderr
    ids = torch.randint(0, BASE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        assert max_diff(load_model_checkpoint(tmp_path / "ckpt").eval()(ids), ref) <= TOL
        back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
        assert max_diff(back(ids).logits, ref) <= TOL


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_model_checkpoint_beside_optimizer_state(tmp_path):
    import torch.distributed.checkpoint as dcp

    ours = randomised(tiny_cfg())
    save_model_checkpoint(ours, tmp_path / "model_only")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "model_config.yaml").write_text((tmp_path / "model_only" / "model_config.yaml").read_text())
    dcp.save({"model": ours.state_dict(), "optim": {"step": torch.tensor(3), "exp_avg": torch.randn(7)}},
             checkpoint_id=tmp_path / "full")   # as the trainer writes it: other top-level entries beside "model"
    for ckpt in ("model_only", "full"):
        a, b = ours.state_dict(), load_model_checkpoint(tmp_path / ckpt).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cli_missing_dir_exits_2(tmp_path):
    done = run_cli("import", str(tmp_path / "nope"), str(tmp_path / "out"))
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "nope" in done.stderr


def test_cli_errors_in_process(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["import", str(tmp_path / "empty"), str(tmp_path / "o")]) == 2
    assert "config.json" in capsys.readouterr().err
    config_to_hf(tiny_cfg()).save_pretrained(tmp_path / "empty")
    assert main(["import", str(tmp_path / "empty"), str(tmp_path / "o")]) == 2
    assert "safetensors" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "empty"), str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "model_config.yaml" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("key,value", [("norm_topk_prob", False), ("rope_interleave", False),
                                       ("attention_bias", True), ("tie_word_embeddings", True),
                                       ("num_key_value_heads", 2), ("hidden_act", "gelu"), ("rms_norm_eps", 1e-5)])
def test_unsupported_hf_config(key, value):
    with pytest.raises(ModelError, match=key):
        config_from_hf(DeepseekV3Config(**{**BASE, key: value}))


def test_release_style_config():
    """DeepSeek-V3's released config.json: legacy ``rope_scaling``, remote-code keys, FP8 quantization_config."""
    release = dict(BASE, num_nextn_predict_layers=1, n_group=4, topk_group=2, rope_theta=10000,
                   rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=64, beta_fast=32,
                                     beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
                   max_position_embeddings=2560, scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1,
                   quantization_config=dict(quant_method="fp8", weight_block_size=[128, 128]))
    cfg = config_from_hf(release)
    assert (cfg.rope_factor, cfg.original_max_seq_len, cfg.mscale, cfg.mscale_all_dim) == (40, 64, 1.0, 1.0)
    assert (cfg.n_expert_groups, cfg.n_limited_groups, cfg.group_topk, cfg.mtp_depth) == (4, 2, 2, 1)
    with pytest.raises(ModelError, match="scoring_func"):
        config_from_hf({**release, "scoring_func": "softmax"})


def test_config_round_trip_and_unexportable():
    for cfg in (tiny_cfg(), tiny_cfg(q_lora_rank=12, rope_factor=4.0, original_max_seq_len=64, mscale_all_dim=0.7,
                                     n_expert_groups=1, n_limited_groups=1, first_k_dense=2, route_scale=2.5)):
        back = config_from_hf(config_to_hf(cfg))
        assert back.effective_group_topk == cfg.effective_group_topk
        back.group_topk = cfg.group_topk
        assert back == cfg
    with pytest.raises(ModelError, match="group_topk"):
        config_to_hf(tiny_cfg(n_routed_experts=8, n_expert_groups=2, n_limited_groups=1, group_topk=3))
    with pytest.raises(ModelError, match="norm_eps"):
        config_to_hf(tiny_cfg(norm_eps=1e-5))
