"""Hydra configuration: the typed schema (``configs.schema``), its checks (``configs.checks``), the YAML groups
beside this file, and ``model_preset(name)`` for the model presets among them. Importing ``configs.schema`` imports
no torch (the registries it validates against are read at validation)."""


def model_preset(name: str):
    """Preset ``name`` as a ``ModelConfig`` (``configs/presets.py``)."""
    from .presets import model_preset as preset
    return preset(name)


__all__ = ["model_preset"]
