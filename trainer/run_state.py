"""A run's checkpoint state: what a save holds, resuming from it, checkpoint.init_from, the model-config check, and
the config keys changed since the checkpoint (``config_changes``)."""
from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import torch
import yaml
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from checkpoint import HEALTH, has_state, state_keys
from errors import ConfigError
from parallel.state_dict import like, stacked_from_older, to_global, to_local

from .metrics import RUN_ID_FILE


def state_dict(trainer) -> dict:
    """Weights and EMA (single-device names, global shapes), optimizer moments, step, tokens, LR position,
    data position and RNG states. BF16 weights are stored as their FP32 master (under ZeRO each rank's
    pieces), so a checkpoint holds FP32 weights whatever the precision: runs of either precision resume it."""
    model_sd, _ = to_global(get_model_state_dict(trainer.model), {}, trainer.model, trainer.dims)
    master = trainer.opt.master_weights()
    if master is not None:
        model_sd.update(master)
    optim_sd = trainer.opt.state_dict()   # moments per parameter name, global shapes (DTensor pieces)
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if trainer.device.type == "cuda":   # this rank's GPU only: touching the others would create contexts there
        rng["cuda"] = torch.cuda.get_rng_state(trainer.device)
    extra = {"step": trainer.step, "tokens": trainer.tokens, "scheduler": {"last_epoch": trainer.scheduler.last_epoch},
             "data": trainer.batches.state_dict(), "rng": rng}
    if trainer.health is not None:
        extra["health"] = trainer.health.state_dict()
    state = {"model": model_sd, "optim": optim_sd, "extra": extra}
    if trainer.ema is not None:   # single-device names and global shapes, like the weights: it reshards
        ema = dict(trainer.ema.state_dict())
        state["ema"] = to_global(ema, {}, trainer.model, trainer.dims)[0] if master is None else \
            {n: like(master[n], t) for n, t in ema.items()}   # the EMA of master pieces is cut like them
    return state


def resume(trainer, path: Path) -> None:
    """Load the checkpoint ``path`` (verified at start-up) into ``trainer``, whatever its layout."""
    check_model_config(trainer.cfg.model, path)
    state = state_dict(trainer)
    ema = trainer.ema
    ema_saved = ema is not None and has_state(path, "ema")
    if ema is not None and not ema_saved:
        del state["ema"]   # train.ema_decay newly set: the EMA starts from the resumed weights
    health_saved = trainer.health is not None and has_state(path, "extra.health")
    if trainer.health is not None and not health_saved:
        del state["extra"]["health"]   # train.health newly on: the guard starts afresh
    load_into(trainer, path, state)
    load_weights(trainer, state["model"])
    if ema_saved:
        ema.load_state_dict(to_local(state["ema"]))
    elif ema is not None:
        ema.reset()
    trainer.opt.load_state_dict(state["optim"])   # after the weights: ZeRO rebuilds its master pieces from them
    extra = state["extra"]
    trainer.step, trainer.tokens = extra["step"], extra["tokens"]
    restore_lr(trainer, int(extra["scheduler"]["last_epoch"]))
    trainer.batches.load_state_dict(extra["data"])
    if health_saved:
        trainer.health.load_state_dict(extra["health"])
    torch.set_rng_state(extra["rng"]["torch"])
    random.setstate(extra["rng"]["python"])
    np.random.set_state(extra["rng"]["numpy"])
    if "cuda" in extra["rng"] and trainer.device.type == "cuda":
        torch.cuda.set_rng_state(extra["rng"]["cuda"], trainer.device)


def load_into(trainer, path: Path, state: dict) -> None:
    """``trainer.ckpt.load`` of ``path`` (verified before) into ``state``, a checkpoint written before the gate and up
    projections were one parameter included (``parallel.state_dict.stacked_from_older``)."""
    with stacked_from_older(state, state_keys(path)):
        trainer.ckpt.load(path, state, verify=False)


def load_weights(trainer, model_sd: dict) -> None:
    """Loaded ``state["model"]`` into the model; with BF16 weights its parameters are the FP32 master, which
    goes to the optimizer (that casts the weights from it) and the buffers to the model."""
    master = trainer.opt.master_weights()
    if master is None:
        set_model_state_dict(trainer.model, to_local(model_sd))
        return
    rest = {k: v for k, v in model_sd.items() if k not in master}
    set_model_state_dict(trainer.model, to_local(rest), options=StateDictOptions(strict=False))
    trainer.opt.load_master_weights({k: model_sd[k] for k in master})


def restore_lr(trainer, last_epoch: int) -> None:
    """The LR schedule is a function of the step: only its position is checkpointed (the number of
    param groups depends on the optimizer layout, e.g. ZeRO buckets, so per-group state would not
    carry over to another layout)."""
    scheduler = trainer.scheduler
    sd = scheduler.state_dict()
    last_lr = [base * trainer._lr_multiplier(last_epoch) for base in scheduler.base_lrs]
    sd.update(last_epoch=last_epoch, _step_count=last_epoch + 1, _last_lr=last_lr)
    scheduler.load_state_dict(sd)
    for group, lr in zip(trainer.opt.optimizer.param_groups, last_lr):
        group["lr"] = lr


def check_model_config(model_cfg, path: Path, key: str = "checkpoint.resume") -> None:
    """``path``'s model_config.yaml equals ``model_cfg``, else one line naming ``key`` and the fix."""
    saved_file = path / "model_config.yaml"
    if not saved_file.is_file():
        raise ConfigError(f"{key}: {path} has no model_config.yaml; not a checkpoint of this trainer")
    same_model(model_cfg, yaml.safe_load(saved_file.read_text()), f"{key}: {path} was written with",
               "use checkpoint.resume=none or another checkpoint.dir" if key == "checkpoint.resume" else None)


def same_model(model_cfg, saved: dict, what: str, fix: str | None) -> None:
    """Every model key equal to ``saved``'s, else one line naming the key, both values and the fix."""
    for k, value in dataclasses.asdict(model_cfg).items():
        if saved.get(k) != value:
            raise ConfigError(f"{what} model.{k}={saved.get(k)!r}, this run has {value!r} ("
                              + (fix or f"set model.{k}={saved.get(k)!r}, or a model preset that matches") + ")")


def apply_init_from(trainer) -> str:
    """checkpoint.init_from, unless the run resumes (then it has its own checkpoint); returns the log line."""
    src = trainer.cfg.checkpoint.init_from
    if trainer._resume_path is not None:
        return (f"checkpoint.init_from={src} not applied: resuming from {trainer._resume_path} "
                "(the run it started has a checkpoint)")
    return init_weights_from(trainer, src)


def init_weights_from(trainer, src: str) -> str:
    """checkpoint.init_from: the model's weights and balancing biases from our checkpoint (any layout) or a
    Hugging Face DeepseekV3 directory (each rank reads only its own tensors); returns the log line."""
    path, model = Path(src).expanduser(), trainer.model
    if (path / "config.json").is_file():
        from models.config import ModelError
        from models.hf import check_config, load_hf_into
        try:
            check_config(trainer.cfg.model, path)   # by meaning: init_std / max_seq_len touch no weight
        except ModelError as e:   # a model=<preset> on the command line, or a model key set there
            raise ConfigError(f"checkpoint.init_from: {e}; without model=<preset> and that key on the command line "
                              "the model is its config.json") from None
        model.to_empty(device="cpu")    # built on meta (see Trainer.__init__): allocate what this rank keeps
        model.init_weights()            # every tensor is then overwritten; buffers get defined values
        stats = load_hf_into(model, path)   # this rank's tensors only (its stages, its experts' slice)
        model.to(trainer.device)
        return (f"initialised from Hugging Face weights {path} ({stats['tensors']} tensors, "
                f"{stats['bytes'] / 2**20:.1f} MiB read on rank {trainer.dims.rank}; step 0, fresh optimizer)")
    v = trainer.ckpt.verify(path)
    if not v.ok:
        raise ConfigError(f"checkpoint.init_from: {v.path} is not a loadable checkpoint: {v.first()} (point it at "
                          "a step dir of ours, e.g. <dir>/step_00000100, or a Hugging Face model directory)")
    check_model_config(trainer.cfg.model, path, "checkpoint.init_from")
    state = {"model": to_global(get_model_state_dict(model), {}, model, trainer.dims)[0]}
    load_into(trainer, path, state)   # model only: the optimizer, step and data start fresh
    set_model_state_dict(model, to_local(state["model"]))
    return f"initialised from {path} (model weights and balancing biases; step 0, fresh optimizer)"


# Keys that cannot change within a run: the model (the tensors' shapes and meaning), the seed (model init and the
# data order) and the keys that define the text corpus's token stream (the saved data position indexes it). A
# data.blend is checked by its content where the data opens (BlendedBatches.load_state_dict): a source moved to
# another path resumes, other windows or weights are refused there. Switching between a text corpus and data.blend
# is refused before either (same_data_kind).
FIXED = ("model.", "train.seed", "data.path", "data.tokenizer", "data.text_field", "data.val_fraction", "data.seq_len")
# Keys meant to change between attempts, not listed: where and how the run logs and saves, the layout (a
# checkpoint reshards to any layout; the log's layout line says the new one), the device, the stop step.
UNLISTED = ("logging.", "checkpoint.", "parallel.", "data.cache_dir", "train.stop_at_step", "train.device",
            "train.memory_check")


def _flat(node, prefix: str = "") -> dict:
    """Dotted keys of a config dict; a list of dicts of the same length elsewhere is compared item by item."""
    if isinstance(node, dict):
        return {k: v for key, sub in node.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): node}


def _diff(saved: dict, now: dict) -> list[tuple[str, object, object]]:
    out = []
    for k, new in now.items():
        if k not in saved:   # a key this trainer has and the checkpoint's predates: nothing to compare
            continue
        old = saved[k]
        if isinstance(old, list) and isinstance(new, list) and len(old) == len(new) and old != new \
                and all(isinstance(x, dict) for x in old + new):
            for i, (a, b) in enumerate(zip(old, new)):
                out += _diff(_flat(a, f"{k}[{i}]."), _flat(b, f"{k}[{i}]."))
        elif old != new:
            out.append((k, old, new))
    return out


def _show(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def same_data_kind(cfg, path: Path, saved: dict | None) -> None:
    """One ``ConfigError`` line when the checkpoint ``path`` was trained on the other kind of data than ``cfg`` reads
    (token datasets, ``data.blend``, vs a text corpus, ``data.path`` or the embedded one): its data position means
    nothing in the other kind's stream. ``saved``: the checkpoint's config.yaml; without one, the checkpoint's own
    data state says (a blend's has a ``kind``)."""
    saved_data = (saved or {}).get("data") or {}
    try:
        saved_blend = bool(saved_data.get("blend")) if saved else has_state(path, "extra.data.kind")
    except OSError:   # no tensor metadata to read: the load names what is missing
        return
    blend = bool(cfg.data.blend)
    if saved_blend == blend:
        return
    text = saved_data.get("path")
    if blend:
        was = f"a text corpus ({f'data.path={text}' if text else 'data.path, or the embedded corpus'})"
        now = "token datasets (data.blend)"
    else:
        was = "token datasets (data.blend)"
        now = f"a text corpus ({f'data.path={cfg.data.path}' if cfg.data.path else 'the embedded corpus'})"
    raise ConfigError(f"data.blend: the checkpoint {path} was trained on {was}, this run reads {now}; a run cannot "
                      "switch between the two (its data position indexes one stream). Resume with the checkpoint's "
                      f"data settings, or start a new run directory with checkpoint.init_from={path} to train on "
                      "from its weights (fresh optimizer and data order, step 0)")


def config_changes(cfg, path: Path) -> str | None:
    """Compare ``cfg`` with the config the checkpoint ``path`` was written with (its ``config.yaml``); first, the
    kind of data (``same_data_kind``). A change of a
    key that cannot change within a run (``FIXED``) raises one ``ConfigError`` line naming every such key and the
    way on; the other changes (``UNLISTED`` aside) come back as one log line ``config changed since <path>: key:
    old -> new, ...`` (None: no change, or a checkpoint without ``config.yaml``)."""
    try:
        raw = yaml.safe_load((path / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):   # converted or older checkpoints: model_config.yaml only
        raw = None
    raw = raw if isinstance(raw, dict) else None
    same_data_kind(cfg, path, raw)
    if raw is None:
        return None
    saved = _flat(raw)
    changes = _diff(saved, _flat(yaml.safe_load(OmegaConf.to_yaml(OmegaConf.structured(cfg)))))
    fixed = [c for c in changes if c[0].startswith(FIXED)
             and not (c[0] == "data.tokenizer" and same_tokenizer(c[2], path))]
    if fixed:
        (k, old, new), rest = fixed[0], fixed[1:]
        also = f" (also {', '.join(f'{k2}: {_show(o)} -> {_show(n)}' for k2, o, n in rest)})" if rest else ""
        model = any(c[0].startswith("model.") for c in fixed)
        way = ("start a new run (checkpoint.resume=none or another checkpoint.dir)" if model else
               f"start a new run directory with checkpoint.init_from={path} to train on from its weights (fresh "
               "optimizer and data order, step 0)")
        raise ConfigError(f"{k}: cannot change when resuming: the checkpoint {path} was written with {k}={_show(old)}, "
                          f"this run has {k}={_show(new)}{also}. The model, train.seed and the data keys that define "
                          f"the token stream stay fixed within a run (the weights' shapes, the data position); resume "
                          f"with the checkpoint's values, or {way}")
    listed = [c for c in changes if not c[0].startswith(UNLISTED)]
    if not listed:
        return None
    return f"config changed since {path}: " + ", ".join(f"{k}: {_show(o)} -> {_show(n)}" for k, o, n in listed)


TOKENIZER_DEFINING = ("tokenizer.json", "tokenizer_config.json")   # vocabulary and merges; bos / eos / pad, specials


def same_tokenizer(tokenizer: str | None, path: Path) -> bool:
    """Whether ``data.tokenizer=tokenizer`` has the files that define the tokenizer the checkpoint ``path`` carries
    (``checkpoint_files``), byte for byte: the same tokenizer under another path, such as that copy itself when
    the directory the run first read it from is gone (``configs.init_from.from_own_checkpoint``)."""
    from data import carried_tokenizer
    mine, theirs = (carried_tokenizer(p) if p is not None else None for p in (tokenizer, path))
    if mine is None or theirs is None or not (mine.is_dir() and theirs.is_dir()):
        return False
    files = [(mine / name, theirs / name) for name in TOKENIZER_DEFINING]
    return all(a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes() for a, b in files)


def checkpoint_files(trainer) -> dict[str, str | bytes]:
    """The files a checkpoint carries beside its tensors: model config, run config, W&B run id, tokenizer, and
    (health guard on) whether it was written while healthy (never pruned in favour of unhealthy ones)."""
    cfg = trainer.cfg
    files = {"model_config.yaml": yaml.safe_dump(dataclasses.asdict(cfg.model), sort_keys=False),
             "config.yaml": OmegaConf.to_yaml(OmegaConf.structured(cfg))}
    if trainer.health is not None:
        files[HEALTH] = json.dumps({"healthy": trainer.health.streak == 0, "step": trainer.step}) + "\n"
    run_id = getattr(getattr(trainer, "logger", None), "run_id", None)   # rank 0's W&B run id: a resume continues it
    if run_id:
        files[RUN_ID_FILE] = run_id + "\n"
    # The checkpoint carries its tokenizer's files beside the others, so the step dir loads as a tokenizer too
    # (AutoTokenizer.from_pretrained, data.carried_tokenizer): tools.convert_hf export and checkpoint.init_from use it.
    files.update(trainer.tokenizer_files)
    return files
