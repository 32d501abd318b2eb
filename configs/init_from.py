"""What ``checkpoint.init_from`` decides in the config: a Hugging Face directory is the model (its config.json), and
the tokenizer a starting point carries is the run's. Applied to the composed config before ``validate``, by
``python -m trainer`` and ``configs.schema.compose``; the trainer then checks the data against that tokenizer
(``trainer.startup.check_init_tokenizer``)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from errors import ConfigError


def is_hf_dir(path) -> bool:
    """A Hugging Face model directory (config.json), as opposed to our step dir (model_config.yaml)."""
    return (Path(str(path)).expanduser() / "config.json").is_file()


def command_line_model(overrides) -> tuple[bool, list[str]]:
    """(a model preset is chosen on the command line: ``model=v3_small``, the ``model.*`` keys set there)."""
    preset, keys = False, []
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key == "model":
            preset = True
        elif key.startswith("model."):
            keys.append(key.removeprefix("model."))
    return preset, keys


def apply_init_from(cfg, overrides=()):
    """``cfg`` with what ``checkpoint.init_from`` decides:

    - a Hugging Face directory without ``model=<preset>`` on the command line: ``cfg.model`` is its config.json
      (``models.hf.config_from_hf_dir``), with the ``model.<key>=...`` of ``overrides`` on top (``init_std``,
      ``max_seq_len``, a smaller ``mtp_depth``; a key that changes the weights is refused where they load);
    - a text corpus without ``data.tokenizer``: the tokenizer the directory carries (``data.carried_tokenizer``:
      an HF directory's, our step dir's, an imported checkpoint's ``tokenizer/``) instead of a BPE trained on the
      corpus, whose ids would mean other tokens than the weights learned.

    ``overrides``: the command line's Hydra overrides (``key=value`` strings)."""
    src = cfg.checkpoint.init_from
    if src is None:
        return cfg
    path = Path(src).expanduser()
    preset, keys = command_line_model(overrides)
    if is_hf_dir(path) and not preset:
        from models.config import ModelError
        from models.hf import config_from_hf_dir
        try:
            model = config_from_hf_dir(path)
        except (OSError, ModelError) as e:
            raise ConfigError(f"checkpoint.init_from: {e}") from None
        unknown = [k for k in keys if not hasattr(model, k)]
        if unknown:   # check_key names it before this on the command line; a caller of compose may not have
            raise ConfigError(f"model.{unknown[0]}: not a config key")
        cfg.model = dataclasses.replace(model, **{k: getattr(cfg.model, k) for k in keys})
    if not cfg.data.blend and cfg.data.tokenizer is None:
        from data import carried_tokenizer
        tok = carried_tokenizer(path)
        if tok is not None:
            cfg.data.tokenizer = str(tok)
    return cfg
