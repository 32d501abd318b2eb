"""Model configuration: one dataclass whose field names follow the DeepSeek-V3 report.

Named presets are configuration, not model code: ``configs/model/<name>.yaml`` (the Hydra ``model`` group),
read into a ``ModelConfig`` by ``configs.model_preset(name)``.
"""
from __future__ import annotations

from dataclasses import dataclass


class ModelError(ValueError):
    """A model configuration or model file the model cannot accept. The message names the key (e.g.
    ``model.n_limited_groups``) or the file and tensor. The entry points catch it beside ``errors.ConfigError``."""


@dataclass
class ModelConfig:
    vocab_size: int = 1024
    dim: int = 128                      # hidden size
    n_layers: int = 4                   # main-model transformer blocks (MTP blocks not included)
    first_k_dense: int = 1              # the first k blocks use a dense SwiGLU FFN, the rest MoE
    inter_dim: int = 256                # dense FFN intermediate size
    norm_eps: float = 1e-6
    init_std: float = 0.02              # V3: 0.006
    # --- MLA ---
    n_heads: int = 4
    q_lora_rank: int = 0                # 0 = no query compression (q_proj straight from the hidden state)
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    # YaRN context extension; off while rope_factor == 1.
    rope_factor: float = 1.0
    original_max_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    # --- DeepSeekMoE ---
    moe_inter_dim: int = 64             # per-expert intermediate size
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    n_activated_experts: int = 2        # K_r: routed experts per token
    n_expert_groups: int = 1            # routing groups G (under EP: G / nodes per node, or one over nodes / G nodes)
    n_limited_groups: int = 1           # M: a token's experts live in at most this many groups
    group_topk: int = 0                 # experts summed per group score; 0 = n_activated_experts // n_limited_groups
    route_scale: float = 1.0            # gate values are normalised then multiplied by this
    # --- multi-token prediction ---
    mtp_depth: int = 0                  # D: number of sequential MTP modules (V3: 1)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def q_rows(self) -> int:
        """The query rows of the attention's input projection (``MLA.wqkv_a``): the query latent, or without
        ``q_lora_rank`` the queries themselves."""
        return self.q_lora_rank or self.n_heads * self.qk_head_dim

    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_expert_groups

    @property
    def effective_group_topk(self) -> int:
        return self.group_topk or self.n_activated_experts // self.n_limited_groups

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense

    def validate(self, prefix: str = "model") -> "ModelConfig":
        """Raise ModelError naming the first offending key; return self when valid."""
        def bad(key: str, msg: str):
            raise ModelError(f"{prefix}.{key}: {msg}")

        for key in ("vocab_size", "dim", "n_layers", "n_heads", "kv_lora_rank", "v_head_dim", "inter_dim",
                    "max_seq_len"):
            if getattr(self, key) <= 0:
                bad(key, f"must be > 0, got {getattr(self, key)}")
        for key in ("first_k_dense", "q_lora_rank", "mtp_depth", "n_shared_experts", "group_topk",
                    "qk_nope_head_dim"):
            if getattr(self, key) < 0:
                bad(key, f"must be >= 0, got {getattr(self, key)}")
        if self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
            bad("qk_rope_head_dim", f"must be a positive even number, got {self.qk_rope_head_dim}")
        if self.first_k_dense > self.n_layers:
            bad("first_k_dense", f"({self.first_k_dense}) must be <= model.n_layers ({self.n_layers})")
        if self.rope_factor < 1.0:
            bad("rope_factor", f"must be >= 1 (1 disables YaRN), got {self.rope_factor}")
        if self.first_k_dense == self.n_layers and self.mtp_depth == 0:
            return self  # a dense model: routing keys are unused
        if self.moe_inter_dim <= 0 or self.n_routed_experts <= 0:
            bad("n_routed_experts", "MoE layers need n_routed_experts > 0 and moe_inter_dim > 0")
        if not 0 < self.n_activated_experts <= self.n_routed_experts:
            bad("n_activated_experts",
                f"({self.n_activated_experts}) must be in 1..model.n_routed_experts ({self.n_routed_experts})")
        if self.n_expert_groups <= 0 or self.n_routed_experts % self.n_expert_groups:
            bad("n_expert_groups",
                f"({self.n_expert_groups}) must divide model.n_routed_experts ({self.n_routed_experts})")
        if not 0 < self.n_limited_groups <= self.n_expert_groups:
            bad("n_limited_groups",
                f"({self.n_limited_groups}) must be in 1..model.n_expert_groups ({self.n_expert_groups})")
        if self.group_topk == 0 and self.n_activated_experts % self.n_limited_groups:
            bad("n_activated_experts",
                f"({self.n_activated_experts}) must be divisible by model.n_limited_groups "
                f"({self.n_limited_groups}) (each kept group is scored by its top K/M experts; "
                f"or set model.group_topk explicitly)")
        if self.effective_group_topk > self.experts_per_group:
            bad("group_topk", f"group score uses top-{self.effective_group_topk} experts but a group has "
                              f"only {self.experts_per_group}")
        if self.n_limited_groups * self.experts_per_group < self.n_activated_experts:
            bad("n_limited_groups",
                f"{self.n_limited_groups} groups x {self.experts_per_group} experts cannot hold "
                f"model.n_activated_experts ({self.n_activated_experts}) experts")
        return self

