"""Hydra configuration: the typed schema (``configs.schema``) and the YAML groups beside this file."""
