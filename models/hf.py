"""Conversion between our ``DeepSeekV3`` and the Hugging Face ``transformers`` DeepseekV3 format.

Weights: one table (``_TOP``/``_BLOCK``/``_MTP``) names every tensor; ``hf_state_dict`` applies it to a model,
export writes what it returns and import copies into it. Block ``i`` is ``model.layers.{i}``:

    attn_norm / ffn_norm           input_layernorm / post_attention_layernorm
    attn.wq | wq_a, q_norm, wq_b   self_attn.q_proj | q_a_proj, q_a_layernorm, q_b_proj
    attn.wkv_a, kv_norm, wkv_b, wo self_attn.kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj
    ffn.w1 / w3 / w2 (dense)       mlp.gate_proj / up_proj / down_proj (same in shared_experts)
    ffn.gate.weight, expert_bias   mlp.gate.weight, mlp.gate.e_score_correction_bias
    ffn.experts.w1/w3/w2 [E,..]    mlp.experts.{e}.gate_proj / up_proj / down_proj.weight

HF checkpoints (``save_pretrained``, the Hub) store routed experts one tensor per expert, as above; a
``transformers`` model in memory fuses them (``mlp.experts.gate_up_proj [E,2F,D]``, gate rows first, and
``down_proj [E,D,F]``). Import accepts both, export writes the per-expert form.

MTP: DeepSeek's release stores MTP module k as ``model.layers.{n_layers + k}``: ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm`` (our ``mtp.k.norm``), ``shared_head.head`` (a copy of ``lm_head``; ours shares the main head,
so it is written on export and skipped on import) and ordinary block weights (our ``mtp.k.block.*``).
``transformers`` builds no MTP module: ``from_pretrained`` silently skips checkpoint keys matching
``DeepseekV3PreTrainedModel._keys_to_ignore_on_load_unexpected`` (``model\\.layers\\.61.*``, the 671B layout;
its ``generate(use_mtp=True)`` drafter reads them from there) and logs a LOAD REPORT warning for any other
unexpected key. So ``to_hf`` writes MTP tensors into the main files only when that pattern covers them, else
into ``mtp.safetensors``, which ``from_pretrained`` never opens (it reads ``model.safetensors`` or the files its
index names). ``from_hf`` reads every ``*.safetensors`` in the directory.

Config: see ``config_from_hf``/``config_to_hf``; what our model cannot express raises ``ConfigError`` naming the
key. FP8 block-quantised weights (DeepSeek's release: float8 ``weight`` + ``weight_scale_inv``) are dequantised.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ConfigError, ModelConfig
from .transformer import DeepSeekV3, build

# ---- the weight-name table ---------------------------------------------------------------------------
_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "head.weight": "lm_head.weight"}
_MLP = {"w1.weight": "gate_proj.weight", "w2.weight": "down_proj.weight", "w3.weight": "up_proj.weight"}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"ffn.{k}": f"mlp.{v}" for k, v in _MLP.items()},
    **{f"ffn.shared_experts.{k}": f"mlp.shared_experts.{v}" for k, v in _MLP.items()},
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.expert_bias": "mlp.gate.e_score_correction_bias",
    # stacked [E, ...] on our side, one tensor per expert on theirs
    **{f"ffn.experts.{k[:2]}": f"mlp.experts.{{e}}.{v}" for k, v in _MLP.items()},
}
_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "norm.weight": "shared_head.norm.weight", **{f"block.{k}": v for k, v in _BLOCK.items()}}
_MTP_HEAD = "shared_head.head.weight"
_SKIPPED_ON_IMPORT = re.compile(rf"{re.escape(_MTP_HEAD)}$|rotary_emb\.inv_freq$")


def hf_key(name: str, n_layers: int) -> str:
    """HF checkpoint key of our state-dict key ``name`` (routed-expert stacks: a template with ``{e}``)."""
    if name in _TOP:
        return _TOP[name]
    top, idx, rest = name.split(".", 2)
    if top == "layers":
        return f"model.layers.{idx}.{_BLOCK[rest]}"
    if top == "mtp":
        return f"model.layers.{n_layers + int(idx)}.{_MTP[rest]}"
    raise KeyError(name)


def hf_state_dict(model: DeepSeekV3) -> dict[str, torch.Tensor]:
    """Our tensors under their HF checkpoint names (views; routed-expert stacks sliced one per expert)."""
    out = {}
    for name, t in model.state_dict().items():
        key = hf_key(name, model.cfg.n_layers)
        out.update({key.format(e=e): t[e] for e in range(len(t))} if "{e}" in key else {key: t})
    return out


# ---- config ------------------------------------------------------------------------------------------
_CONFIG = {  # ours -> HF, plain renames; the rest is handled in config_from_hf / config_to_hf
    "vocab_size": "vocab_size", "dim": "hidden_size", "inter_dim": "intermediate_size",
    "moe_inter_dim": "moe_intermediate_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
    "n_shared_experts": "n_shared_experts", "n_routed_experts": "n_routed_experts",
    "n_activated_experts": "num_experts_per_tok", "route_scale": "routed_scaling_factor",
    "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim", "max_seq_len": "max_position_embeddings", "init_std": "initializer_range",
    "norm_eps": "rms_norm_eps",
}
_REQUIRED = {  # HF key: (the only value our model implements, why); an absent key counts as that value
    "hidden_act": ("silu", "our MLPs and experts are SwiGLU"),
    "norm_topk_prob": (True, "our gate always normalises the top-k gate values"),
    "rope_interleave": (True, "our rope rotates interleaved pairs (DeepSeek's layout)"),
    "attention_bias": (False, "our attention projections have no bias"),
    "tie_word_embeddings": (False, "our embedding and output head are separate tensors"),
    "rms_norm_eps": (1e-6, "HF (like DeepSeek's code) fixes the q/kv latent norms' eps at 1e-6 while ours "
                           "use one eps for every norm"),
    "scoring_func": ("sigmoid", "our gate is a sigmoid router"),          # DeepSeek remote-code keys
    "topk_method": ("noaux_tc", "our gate routes with the bias-corrected group-limited top-k"),
    "moe_layer_freq": (1, "every layer after the dense ones is MoE in our model"),
}


def config_from_hf(hf_config, mtp_depth: int | None = None) -> ModelConfig:
    """Our ModelConfig for a ``DeepseekV3Config`` (or its dict). ``mtp_depth`` defaults to
    ``num_nextn_predict_layers``; ``from_hf`` passes how many MTP modules the weights actually hold."""
    hf = hf_config
    if isinstance(hf, dict):
        from transformers import DeepseekV3Config
        hf = DeepseekV3Config.from_dict(hf)
    for key, (value, why) in _REQUIRED.items():
        if getattr(hf, key, value) != value:
            raise ConfigError(f"HF config {key}={getattr(hf, key)!r} is not supported ({why}); need {value!r}")
    if hf.num_key_value_heads not in (None, hf.num_attention_heads):
        raise ConfigError(f"HF config num_key_value_heads={hf.num_key_value_heads} is not supported: "
                          f"MLA needs it equal to num_attention_heads ({hf.num_attention_heads})")
    if not hf.n_shared_experts:
        raise ConfigError("HF config n_shared_experts=0 is not supported (HF still builds shared-expert weights)")
    n_group = hf.n_group or 1
    topk_group = hf.topk_group or n_group
    return ModelConfig(
        **{ours: getattr(hf, theirs) for ours, theirs in _CONFIG.items()},
        q_lora_rank=hf.q_lora_rank or 0,
        first_k_dense=min(hf.first_k_dense_replace or 0, hf.num_hidden_layers),
        n_expert_groups=n_group, n_limited_groups=topk_group,
        group_topk=2 if topk_group < n_group else 0,
        mtp_depth=(getattr(hf, "num_nextn_predict_layers", 0) or 0) if mtp_depth is None else mtp_depth,
        **_rope_from_hf(hf),
    )


def config_to_hf(cfg: ModelConfig):
    """The ``transformers.DeepseekV3Config`` that describes a model built from ``cfg``."""
    from transformers import DeepseekV3Config

    cfg.validate()
    if cfg.norm_eps != 1e-6:
        raise ConfigError(f"model.norm_eps={cfg.norm_eps}: HF fixes the q/kv latent norms' eps at 1e-6; "
                          "export needs norm_eps=1e-6")
    if cfg.n_shared_experts == 0:
        raise ConfigError("model.n_shared_experts=0: HF DeepseekV3 always has shared experts")
    if cfg.n_limited_groups < cfg.n_expert_groups and cfg.effective_group_topk != 2:
        raise ConfigError(f"model.group_topk: HF scores a group by its top-2 experts, this model uses "
                          f"top-{cfg.effective_group_topk}")
    if cfg.rope_factor > 1:
        rope = dict(rope_type="yarn", rope_theta=cfg.rope_theta, factor=cfg.rope_factor,
                    original_max_position_embeddings=cfg.original_max_seq_len, beta_fast=cfg.beta_fast,
                    beta_slow=cfg.beta_slow, mscale=cfg.mscale, mscale_all_dim=cfg.mscale_all_dim)
    else:
        rope = dict(rope_type="default", rope_theta=cfg.rope_theta)
    return DeepseekV3Config(
        **{theirs: getattr(cfg, ours) for ours, theirs in _CONFIG.items()},
        num_key_value_heads=cfg.n_heads, q_lora_rank=cfg.q_lora_rank or None,
        first_k_dense_replace=cfg.first_k_dense, n_group=cfg.n_expert_groups, topk_group=cfg.n_limited_groups,
        num_nextn_predict_layers=cfg.mtp_depth, rope_parameters=rope, norm_topk_prob=True, hidden_act="silu",
        rope_interleave=True, attention_bias=False, tie_word_embeddings=False,
        architectures=["DeepseekV3ForCausalLM"],
    )


def _rope_from_hf(hf) -> dict:
    rp = dict(hf.rope_parameters or {})
    kind = rp.get("rope_type", rp.get("type", "default"))
    theta = rp.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    if kind == "default":
        return dict(rope_theta=theta)
    if kind != "yarn":
        raise ConfigError(f"HF config rope_parameters.rope_type={kind!r} is not supported (only 'default', 'yarn')")
    if rp.get("attention_factor") is not None or rp.get("truncate", True) is not True:
        raise ConfigError("HF config rope_parameters.attention_factor / truncate=False are not supported")
    original = rp["original_max_position_embeddings"]
    return dict(rope_theta=theta, rope_factor=rp.get("factor") or hf.max_position_embeddings / original,
                original_max_seq_len=original, beta_fast=rp.get("beta_fast") or 32.0,
                beta_slow=rp.get("beta_slow") or 1.0, mscale=rp.get("mscale") or 0.0,
                mscale_all_dim=rp.get("mscale_all_dim") or 0.0)


# ---- import ------------------------------------------------------------------------------------------
def from_hf(path_or_hf_model, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> DeepSeekV3:
    """Our model with the weights of an HF checkpoint directory or a ``transformers`` DeepseekV3ForCausalLM.

    A directory is read tensor by tensor, one ``*.safetensors`` file open at a time, into a model built on
    meta and materialised once on ``device``. Parameters get ``dtype``; the balancing bias stays fp32.
    """
    if not isinstance(path_or_hf_model, (str, os.PathLike)):
        model = _empty_model(config_from_hf(path_or_hf_model.config, mtp_depth=0), dtype, device)
        _copy_in(model, path_or_hf_model.state_dict().items())
        return model
    root = Path(path_or_hf_model)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such directory")
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root}: no config.json (not a Hugging Face checkpoint directory)")
    from transformers import DeepseekV3Config
    hf_cfg = DeepseekV3Config.from_pretrained(str(root))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{root}: no *.safetensors files")
    where = {}
    for file in files:
        with safe_open(file, "pt") as f:
            where.update(dict.fromkeys(f.keys(), file))
    model = _empty_model(config_from_hf(hf_cfg, mtp_depth=_mtp_depth(hf_cfg, where)), dtype, device)
    block = tuple((getattr(hf_cfg, "quantization_config", None) or {}).get("weight_block_size", (128, 128)))

    def tensors():
        for file in files:
            with safe_open(file, "pt") as f:
                for key in f.keys():
                    if key.endswith("_scale_inv"):
                        continue
                    t = f.get_tensor(key)
                    if key + "_scale_inv" in where:
                        with safe_open(where[key + "_scale_inv"], "pt") as g:
                            t = _dequant(t, g.get_tensor(key + "_scale_inv"), block)
                    yield key, t

    _copy_in(model, tensors())
    return model


def _empty_model(cfg: ModelConfig, dtype: torch.dtype, device) -> DeepSeekV3:
    model = build(cfg, "meta")
    for p in model.parameters():   # buffers (balancing bias, load counters) stay fp32
        p.data = p.data.to(dtype)
    return model.to_empty(device=device)


def _mtp_depth(hf_cfg, keys) -> int:
    """MTP modules the checkpoint holds: ``num_nextn_predict_layers`` if their layers are present, else 0."""
    n, want = hf_cfg.num_hidden_layers, getattr(hf_cfg, "num_nextn_predict_layers", 0) or 0
    found = {int(m[1]) for k in keys if (m := re.match(r"model\.layers\.(\d+)\.", k)) and int(m[1]) >= n}
    if found and found != set(range(n, n + want)):
        raise ConfigError(f"HF config num_nextn_predict_layers={want} but the checkpoint holds layers "
                          f"{sorted(found)} beyond num_hidden_layers={n}")
    return want if found else 0


def _dequant(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Block-quantised weight -> fp32: each ``block`` tile of ``w`` is multiplied by its ``scale_inv`` entry."""
    rows, cols = w.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return w.float() * s


def _unfuse(key: str, t: torch.Tensor):
    """Split a ``transformers`` in-memory fused expert tensor into the per-expert checkpoint keys."""
    base, _, leaf = key.rpartition(".")
    if base.endswith("mlp.experts") and leaf in ("gate_up_proj", "down_proj"):
        parts = t.chunk(2, dim=1) if leaf == "gate_up_proj" else (t,)
        names = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
        for e in range(t.shape[0]):
            for name, part in zip(names, parts):
                yield f"{base}.{e}.{name}.weight", part[e]
    else:
        yield key, t


@torch.no_grad()
def _copy_in(model: DeepSeekV3, items) -> None:
    targets, unexpected, done = hf_state_dict(model), [], set()
    for key, t in items:
        for key, t in _unfuse(key, t):
            if key in targets:
                if targets[key].shape != t.shape:
                    raise ValueError(f"{key}: shape {tuple(t.shape)}, expected {tuple(targets[key].shape)}")
                targets[key].copy_(t)
                done.add(key)
            elif not _SKIPPED_ON_IMPORT.search(key):
                unexpected.append(key)
    missing = sorted(set(targets) - done)
    if unexpected or missing:
        raise ValueError(f"HF weights do not match the config: missing {missing[:5]} ({len(missing)}), "
                         f"unexpected {unexpected[:5]} ({len(unexpected)})")
    for moe in model.moe_layers():
        moe.tokens_per_expert.zero_()


# ---- export ------------------------------------------------------------------------------------------
def to_hf(model: DeepSeekV3, out_dir: str | os.PathLike, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write ``config.json`` + safetensors (in the model's dtype) that ``from_pretrained`` loads cleanly.

    Above ``max_shard_bytes`` the weights are split into ``model-0000i-of-0000n.safetensors`` + index.
    MTP modules go where the module docstring says. Returns the output directory.
    """
    cfg = model.cfg
    hf_cfg = config_to_hf(cfg)
    hf_cfg.dtype = model.embed.weight.dtype
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.safetensors")):
        raise FileExistsError(f"{out}: already holds *.safetensors; export into an empty directory")
    tensors = hf_state_dict(model)
    tensors.update({f"model.layers.{cfg.n_layers + k}.{_MTP_HEAD}": model.head.weight for k in range(cfg.mtp_depth)})
    main, side = [], []
    if cfg.mtp_depth:   # the checkpoint keys from_pretrained skips without a warning
        from transformers import DeepseekV3ForCausalLM
        patterns = DeepseekV3ForCausalLM._keys_to_ignore_on_load_unexpected or ["(?!)"]
        ignored = re.compile("|".join(f"({p})" for p in patterns))
    for key, t in tensors.items():
        layer = re.match(r"model\.layers\.(\d+)\.", key)
        is_mtp = layer is not None and int(layer[1]) >= cfg.n_layers
        (side if is_mtp and not ignored.search(key) else main).append((key, t))
    _write_shards(out, main, max_shard_bytes)
    if side:
        save_file(_cpu_copies(side), str(out / "mtp.safetensors"), metadata={"format": "pt"})
    hf_cfg.save_pretrained(str(out))
    return out


def _cpu_copies(items) -> dict[str, torch.Tensor]:
    # own storage per tensor: safetensors refuses tensors that share memory (expert slices, the head copy)
    return {k: t.detach().to("cpu", copy=True).contiguous() for k, t in items}


def _write_shards(out: Path, items: list, max_shard_bytes: int) -> None:
    shards, size = [[]], 0
    for key, t in items:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, t))
        size += nbytes
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    for name, shard in zip(names, shards):
        save_file(_cpu_copies(shard), str(out / name), metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {key: name for name, shard in zip(names, shards) for key, _ in shard}
        total = sum(t.numel() * t.element_size() for _, t in items)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
