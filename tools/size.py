"""Model sizes for a config: ``python -m tools.size +exp=v3_small`` (or ``model=v3_671b``).

Builds the model on the meta device (no memory) and prints total / activated / MTP parameter counts.
Counting rule: see ``models/params.py``.
"""
from __future__ import annotations

import sys

from hydra import compose, initialize_config_module

import models
from configs.schema import register, to_object
from models.config import ConfigError
from models.params import count_params


def main(argv: list[str]) -> int:
    register()
    with initialize_config_module("configs", version_base=None):
        cfg = to_object(compose("config", overrides=argv))
    try:
        model = models.build(cfg.model, "meta")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    c = count_params(model)
    rows = [
        ("total (no MTP)", c.total),
        ("activated per token (no MTP)", c.activated),
        ("activated, without embedding", c.activated - c.embedding),
        ("MTP modules (unique)", c.mtp),
        ("total with MTP", c.total_with_mtp),
        ("embedding", c.embedding),
        ("output head", c.head),
        ("routed experts", c.routed_experts),
    ]
    m = cfg.model
    print(f"model: dim={m.dim} layers={m.n_layers} (dense {m.first_k_dense}) experts={m.n_routed_experts} "
          f"top-{m.n_activated_experts} groups={m.n_expert_groups} M={m.n_limited_groups} mtp_depth={m.mtp_depth}")
    for name, n in rows:
        print(f"  {name:<32} {n:>16,d}  ({n / 1e9:.3f} B)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
