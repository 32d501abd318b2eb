"""Model presets: the files of the Hydra ``model`` group (``configs/model/<name>.yaml``) as a ``ModelConfig``, for
code that builds a model without composing a whole config (tools, benchmarks, tests)."""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from errors import ConfigError
from models.config import ModelConfig

from .schema import check_key

MODEL_DIR = Path(__file__).parent / "model"


def model_preset(name: str) -> ModelConfig:
    """Preset ``name`` (``tiny``, ``v3_small``, ``v3_16b``, ``v3_671b``) over ``ModelConfig``'s defaults, read as
    Hydra reads it; an unknown name or key is a ``ConfigError``."""
    path = MODEL_DIR / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in MODEL_DIR.glob("*.yaml"))
        raise ConfigError(f"model preset {name!r} not found; known presets: {', '.join(names)}")
    values = OmegaConf.load(path)
    try:
        check_key("model", OmegaConf.to_container(values))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), values))
