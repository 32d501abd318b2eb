"""Model config conversion between our ``ModelConfig`` and ``transformers``' ``DeepseekV3Config``: the plain
renames in one table, the keys our model implements only one value of, and the routing and rope keys that
need translating. What our model cannot express raises ``ModelError`` naming the key (see models/hf.py for
the weights)."""
from __future__ import annotations

import re

from .config import ModelConfig, ModelError

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
_HF_GROUP_TOPK = 2   # HF (like DeepSeek's code) scores an expert group by the sum of its top-2 biased scores


def config_from_hf(hf_config, mtp_depth: int | None = None) -> ModelConfig:
    """Our ModelConfig for a ``DeepseekV3Config`` (or its dict). ``mtp_depth`` defaults to
    ``num_nextn_predict_layers``; ``config_from_hf_dir`` passes how many MTP modules the weights hold.

    ``group_topk`` (experts summed per group score; 0 = K // M) is written as 0, what the presets say,
    whenever 0 routes as HF does (K // M == 2, or no group limit), else as HF's 2."""
    hf = hf_config
    if isinstance(hf, dict):
        from transformers import DeepseekV3Config
        hf = DeepseekV3Config.from_dict(hf)
    for key, (value, why) in _REQUIRED.items():
        if getattr(hf, key, value) != value:
            raise ModelError(f"HF config {key}={getattr(hf, key)!r} is not supported ({why}); need {value!r}")
    if hf.num_key_value_heads not in (None, hf.num_attention_heads):
        raise ModelError(f"HF config num_key_value_heads={hf.num_key_value_heads} is not supported: "
                          f"MLA needs it equal to num_attention_heads ({hf.num_attention_heads})")
    if not hf.n_shared_experts:
        raise ModelError("HF config n_shared_experts=0 is not supported (HF still builds shared-expert weights)")
    n_group = hf.n_group or 1
    topk_group = hf.topk_group or n_group
    k = hf.num_experts_per_tok
    default_topk = k // topk_group if k % topk_group == 0 else None
    same = default_topk == _HF_GROUP_TOPK or (topk_group == n_group and default_topk is not None
                                              and default_topk <= hf.n_routed_experts // n_group)
    return ModelConfig(
        **{ours: getattr(hf, theirs) for ours, theirs in _CONFIG.items()},
        q_lora_rank=hf.q_lora_rank or 0,
        first_k_dense=min(hf.first_k_dense_replace or 0, hf.num_hidden_layers),
        n_expert_groups=n_group, n_limited_groups=topk_group,
        group_topk=0 if same else _HF_GROUP_TOPK,
        mtp_depth=(getattr(hf, "num_nextn_predict_layers", 0) or 0) if mtp_depth is None else mtp_depth,
        **_rope_from_hf(hf),
    )


def config_to_hf(cfg: ModelConfig):
    """The ``transformers.DeepseekV3Config`` that describes a model built from ``cfg``. Token ids (bos, eos,
    pad) are left unset: they come from the tokenizer (``write_hf_metadata``)."""
    from transformers import DeepseekV3Config

    cfg.validate()
    if cfg.norm_eps != 1e-6:
        raise ModelError(f"model.norm_eps={cfg.norm_eps}: HF fixes the q/kv latent norms' eps at 1e-6; "
                          "export needs norm_eps=1e-6")
    if cfg.n_shared_experts == 0:
        raise ModelError("model.n_shared_experts=0: HF DeepseekV3 always has shared experts")
    if cfg.n_limited_groups < cfg.n_expert_groups and cfg.effective_group_topk != _HF_GROUP_TOPK:
        raise ModelError(f"model.group_topk: HF scores a group by its top-2 experts, this model uses "
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
        architectures=["DeepseekV3ForCausalLM"], bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def _rope_from_hf(hf) -> dict:
    rp = dict(hf.rope_parameters or {})
    kind = rp.get("rope_type", rp.get("type", "default"))
    theta = rp.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    if kind == "default":
        return dict(rope_theta=theta)
    if kind != "yarn":
        raise ModelError(f"HF config rope_parameters.rope_type={kind!r} is not supported (only 'default', 'yarn')")
    if rp.get("attention_factor") is not None or rp.get("truncate", True) is not True:
        raise ModelError("HF config rope_parameters.attention_factor / truncate=False are not supported")
    original = rp["original_max_position_embeddings"]
    return dict(rope_theta=theta, rope_factor=rp.get("factor") or hf.max_position_embeddings / original,
                original_max_seq_len=original, beta_fast=rp.get("beta_fast") or 32.0,
                beta_slow=rp.get("beta_slow") or 1.0, mscale=rp.get("mscale") or 0.0,
                mscale_all_dim=rp.get("mscale_all_dim") or 0.0)


def mtp_depth_of(hf_cfg, keys) -> int:
    """MTP modules a checkpoint whose tensor names are ``keys`` holds: ``num_nextn_predict_layers`` if their
    layers are present, else 0."""
    n, want = hf_cfg.num_hidden_layers, getattr(hf_cfg, "num_nextn_predict_layers", 0) or 0
    found = {int(m[1]) for k in keys if (m := re.match(r"model\.layers\.(\d+)\.", k)) and int(m[1]) >= n}
    if found and found != set(range(n, n + want)):
        raise ModelError(f"HF config num_nextn_predict_layers={want} but the checkpoint holds layers "
                          f"{sorted(found)} beyond num_hidden_layers={n}")
    return want if found else 0
