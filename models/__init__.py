"""Single-device DeepSeek-V3 model (MLA, DeepSeekMoE with node-limited routing, MTP). No distributed code."""
from .config import ModelError, ModelConfig
from .moe import MoE
from .transformer import Block, DeepSeekV3, LossOutput, MTPModule, build


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
