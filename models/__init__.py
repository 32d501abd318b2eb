"""Single-device DeepSeek-V3 model (MLA, DeepSeekMoE with node-limited routing, MTP). No distributed code."""
from .config import ModelConfig, ModelError

_LAZY = {"MoE": "moe", "Block": "transformer", "DeepSeekV3": "transformer", "LossOutput": "transformer",
         "MTPModule": "transformer", "build": "transformer"}


def __getattr__(name: str):
    """The torch modules load on first use, so that ``models.config`` (read by ``configs.schema``) needs no torch."""
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def from_hf(path_or_model, **kwargs):
    """Our model with the weights of a ``transformers`` DeepseekV3 checkpoint dir or model (see models/hf.py)."""
    from .hf import from_hf as _from_hf
    return _from_hf(path_or_model, **kwargs)


def to_hf(model, out_dir, **kwargs):
    """Write ``model`` as a dir that ``AutoModelForCausalLM.from_pretrained`` loads (see models/hf.py)."""
    from .hf_export import to_hf as _to_hf
    return _to_hf(model, out_dir, **kwargs)


__all__ = ["ModelError", "ModelConfig", "MoE", "Block", "DeepSeekV3", "LossOutput", "MTPModule",
           "build", "from_hf", "to_hf"]
