"""``python -m trainer +exp=tiny [key=value ...]``: parse the config, build, train, close."""
from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from configs.schema import register, to_object, validate
from models.config import ConfigError

register()


@hydra.main(version_base=None, config_path="pkg://configs", config_name="config")
def main(dcfg: DictConfig) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = validate(to_object(dcfg), world_size)
        from .train import Trainer   # heavy imports after the config is known to be valid
        trainer = Trainer(cfg, HydraConfig.get().runtime.output_dir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    trainer.train()


if __name__ == "__main__":
    main()
