"""The project's user-facing error: a configuration value, file or layout that cannot work.

It lives outside ``models/`` so that ``configs/``, ``parallel/``, ``trainer/`` and ``tools/`` need not import
the model package for it. ``models/`` imports nothing of the project and raises its own
``models.ModelError``; the entry points catch both and print one line naming the key or file.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the key (e.g. ``parallel.ep``) and the fix."""


__all__ = ["ConfigError"]
