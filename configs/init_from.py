"""What ``checkpoint.init_from`` decides in the config: a Hugging Face directory is the model (its config.json), and
the tokenizer a starting point carries is the run's. Applied to the composed config before ``validate``, by
``python -m trainer`` and ``configs.schema.compose``; the trainer then checks the data against that tokenizer
(``trainer.startup.check_init_tokenizer``)."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

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


def apply_init_from(cfg, overrides=(), own_checkpoint: Callable[[], Path | None] | None = None):
    """``cfg`` with what ``checkpoint.init_from`` decides:

    - a Hugging Face directory without ``model=<preset>`` on the command line: ``cfg.model`` is its config.json
      (``models.hf.config_from_hf_dir``), with the ``model.<key>=...`` of ``overrides`` on top (``init_std``,
      ``max_seq_len``, a smaller ``mtp_depth``; a key that changes the weights is refused where they load);
    - a text corpus without ``data.tokenizer``: the tokenizer the directory carries (``data.carried_tokenizer``:
      an HF directory's, our step dir's, an imported checkpoint's ``tokenizer/``) instead of a BPE trained on the
      corpus, whose ids would mean other tokens than the weights learned.

    A directory that is gone (deleted or moved since the run started from it) decides nothing: a run resuming
    from its own checkpoint takes both from there (``from_own_checkpoint``).

    ``overrides``: the command line's Hydra overrides (``key=value`` strings); ``own_checkpoint()``: the step dir
    the run would resume from, or None (``trainer/__main__.py`` asks its checkpoint directory; without it, none)."""
    src = cfg.checkpoint.init_from
    if src is None:
        return cfg
    path = Path(src).expanduser()
    preset, keys = command_line_model(overrides)
    if not path.exists():
        step = own_checkpoint() if own_checkpoint is not None else None
        return from_own_checkpoint(cfg, preset, keys, step) if step is not None else cfg
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


def from_own_checkpoint(cfg, preset: bool, keys: list[str], step: Path):
    """``checkpoint.init_from`` is gone and the run resumes from the step dir ``step``: the model and tokenizer it
    once decided are those its checkpoint was written with. The model from the step dir's ``model_config.yaml`` (unless
    ``model=<preset>`` is on the command line; ``model.<key>=...`` on top); ``data.tokenizer``, unless set on the
    command line, the tokenizer files the step dir carries when the run read one (``trainer.run_state`` counts
    them as the same tokenizer as the saved path: ``same_tokenizer``). A step dir without ``model_config.yaml``
    changes nothing (the trainer refuses it)."""
    import yaml
    if not (step / "model_config.yaml").is_file():
        return cfg
    if not preset:
        from models.config import ModelConfig
        saved = yaml.safe_load((step / "model_config.yaml").read_text()) or {}
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        model = ModelConfig(**{k: v for k, v in saved.items() if k in known})
        cfg.model = dataclasses.replace(model, **{k: getattr(cfg.model, k) for k in keys if k in known})
    try:
        run_cfg = yaml.safe_load((step / "config.yaml").read_text()) or {}
    except OSError:
        run_cfg = {}
    read_one = ((run_cfg.get("data") or {}).get("tokenizer")) is not None
    if read_one and cfg.data.tokenizer is None and not cfg.data.blend:
        from data import carried_tokenizer
        tok = carried_tokenizer(step)
        if tok is not None:
            cfg.data.tokenizer = str(tok)
    return cfg
