"""Hydra configuration: the typed schema (``configs.schema``), its checks (``configs.checks``), the YAML groups
beside this file, and ``model_preset(name)`` for the model presets among them."""
from .presets import model_preset

__all__ = ["model_preset"]
