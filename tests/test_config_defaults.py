"""One home for every default and allowed value: the schema's dataclasses hold the defaults (a YAML group that
restates or overrides one fails here), the schedule registry holds the schedule names, ``configs/`` holds the
model presets."""
import ast
import dataclasses
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from configs import model_preset
from configs.schema import Config, register
from errors import ConfigError
from parallel.pipeline.schedules import NO_PIPELINE, SCHEDULES
from tools.size import main as size_main

from .trainer_utils import ROOT, make_config


def leaves(node, prefix=""):
    """(dotted key, value) for every leaf field of a dataclass instance."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def composed(*overrides):
    register()
    with initialize_config_module("configs", version_base=None):
        return compose("config", overrides=list(overrides))


def yaml_keys(path: Path) -> set[str]:
    """Dotted leaf keys a YAML file sets (its Hydra ``defaults`` list aside)."""
    def walk(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict) and value:
                yield from walk(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}"
    data = OmegaConf.to_container(OmegaConf.load(path))
    data.pop("defaults", None)
    return set(walk(data, ""))


@pytest.mark.parametrize("overrides", [[], ["+exp=tiny"]], ids=["bare", "exp=tiny"])
def test_composed_config_keeps_every_schema_default(overrides):
    """Walks the schema's fields: the composed config holds each default unless the experiment sets that key.
    The model group selects a preset: its keys come from ``configs/model/tiny.yaml`` (``model_preset``)."""
    cfg = composed(*overrides)
    set_by_exp = yaml_keys(ROOT / "configs" / "exp" / "tiny.yaml") if overrides else set()
    want = dataclasses.replace(Config(), model=model_preset("tiny"))
    checked = 0
    for key, default in leaves(want):
        if key in set_by_exp:
            continue
        got = OmegaConf.select(cfg, key)
        got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
        assert got == default, f"{key}: composed {got!r}, schema default {default!r} (a YAML group overrides it)"
        checked += 1
    assert checked >= 80 and "parallel.overlap" not in set_by_exp


def test_overlap_is_on_by_default_where_it_applies():
    """On by default; it applies where an expert all-to-all exists to hide (ep > 1)."""
    from parallel.parallelize import fb_overlap
    assert Config().parallel.overlap is True and make_config().parallel.overlap is True
    assert fb_overlap(True, 2) is True
    assert fb_overlap(True, 1) is False   # ep = 1: nothing travels
    assert fb_overlap(False, 2) is False


def test_the_startup_log_says_whether_the_f_and_b_overlap_runs():
    from types import SimpleNamespace

    from trainer.startup import _overlap_note
    on, off = SimpleNamespace(overlap=True), SimpleNamespace(overlap=False)
    assert _overlap_note(on, SimpleNamespace(overlap=True)) == " (F&B overlap on)"
    assert "ep = 1" in _overlap_note(on, SimpleNamespace(overlap=False))
    assert _overlap_note(off, SimpleNamespace(overlap=False)) == " (F&B overlap off)"


@pytest.mark.parametrize("schedule", [NO_PIPELINE, *SCHEDULES])
def test_every_schedule_is_accepted_by_trainer_and_size(schedule, capsys):
    pp = 1 if schedule == NO_PIPELINE else 2
    layout = [f"parallel.pp={pp}", f"parallel.schedule={schedule}"]
    assert make_config(*layout, world_size=pp).parallel.schedule == schedule
    assert size_main(["+exp=tiny", *layout]) == 0, capsys.readouterr().err
    assert f"schedule {schedule}" in capsys.readouterr().out


def test_model_preset_errors_are_config_errors():
    with pytest.raises(ConfigError, match=r"^model preset 'tiny2' not found; known presets: tiny, v3_16b"):
        model_preset("tiny2")


def test_models_do_not_read_configs():
    """``models/`` neither imports ``configs`` nor reaches its files through ``importlib.resources``."""
    for path in (ROOT / "models").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            assert not any(n.startswith(("configs", "importlib.resources")) for n in names), (path.name, names)
