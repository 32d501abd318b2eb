"""Allowed values and per-section checks behind ``configs.schema.validate``.

Each check raises a one-line ``ConfigError`` naming the key. Rules are written positively (``ok`` must hold),
so that NaN, for which every comparison is False, fails.
"""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

from errors import ConfigError

if TYPE_CHECKING:
    from models.config import ModelConfig

    from .schema import (CheckpointConfig, Config, DataConfig, LoggingConfig, OptimConfig, ParallelConfig,
                         Piecewise, TrainConfig)

DEVICES = ("auto", "cpu", "cuda")                # train.device
ZERO_BACKENDS = ("native", "deepspeed")          # parallel.zero_backend
DECAYS = ("cosine", "constant", "phases")        # optim.decay
LR_SHAPES = ("constant", "linear", "cosine")     # optim.phases[i].shape
WANDB_MODES = ("offline", "online", "disabled")  # logging.wandb.mode
BAD_DOCUMENT = ("error", "skip")                 # data.on_bad_document


# Allowed values that live with their code in parallel/ (registries of torch modules): read when a config is
# validated, not when this module is imported, so that ``import configs.schema`` needs no torch.
def precisions() -> tuple[str, ...]:                 # train.precision
    from parallel.precision import PRECISIONS
    return PRECISIONS


def recompute_modes() -> tuple[str, ...]:            # train.recompute
    from parallel.recompute import MODES
    return tuple(MODES)


def head_losses() -> tuple[str, ...]:                # train.head_loss
    from parallel.head_loss import HEAD_LOSSES
    return HEAD_LOSSES


def compile_modes() -> tuple[str, ...]:             # train.compile
    from parallel.compile import MODES
    return MODES


def cuda_graph_modes() -> tuple[str, ...]:          # train.cuda_graph
    from parallel.cuda_graph import MODES
    return MODES


def dispatchers() -> tuple[str, ...]:                # parallel.ep_dispatcher
    from parallel.ep.apply import DISPATCHERS
    return tuple(DISPATCHERS)


def moment_dtypes() -> tuple[str, ...]:              # optim.moment_dtype: auto or a dtype parallel/zero keeps
    from parallel.zero import MOMENT_DTYPES
    return ("auto", *MOMENT_DTYPES)


def masters() -> tuple[str, ...]:                    # optim.master
    from parallel.zero import MASTERS
    return MASTERS


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}")


def _num(v: Any) -> str:
    """A value as one would type it on the command line: ``0`` for 0.0, ``nan``, ``1e-08``."""
    if isinstance(v, float) and math.isfinite(v) and v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return str(v)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _need(key: str, value: Any, ok: bool, rule: str) -> None:
    """``ok`` is the rule evaluated on ``value``."""
    if not ok:
        raise ConfigError(f"{key}: must be {rule}, got {_num(value)}")


def _positive(key: str, value: Any) -> None:
    _need(key, value, _finite(value) and value > 0, "finite and > 0")


def _non_negative(key: str, value: Any, note: str = "") -> None:
    _need(key, value, _finite(value) and value >= 0, "finite and >= 0" + note)


def check_sections(cfg: Config) -> None:
    """Per-key ranges and allowed values, section by section: everything that would otherwise fail (or
    silently train on NaN) after the build."""
    _check_model(cfg.model)
    _check_optim(cfg.optim)
    _check_train(cfg.train)
    _check_parallel(cfg.parallel)
    _check_data(cfg.data, cfg.model)
    _check_logging(cfg.logging)
    _check_checkpoint(cfg.checkpoint)


def _check_model(m: ModelConfig) -> None:
    """The model keys that ``ModelConfig.validate`` leaves open and that turn the loss into NaN or fail in init."""
    for key in ("norm_eps", "init_std", "rope_theta", "route_scale"):
        _positive(f"model.{key}", getattr(m, key))
    _need("model.rope_factor", m.rope_factor, _finite(m.rope_factor) and m.rope_factor >= 1,
          "finite and >= 1 (1 disables YaRN)")


def _check_optim(o: OptimConfig) -> None:
    _positive("optim.lr", o.lr)
    _non_negative("optim.min_lr", o.min_lr)
    if o.min_lr > o.lr and o.decay == "cosine":   # the end of the cosine; constant and phases do not use it
        raise ConfigError(f"optim.min_lr: must be <= optim.lr ({_num(o.lr)}), got {_num(o.min_lr)}")
    _need("optim.warmup_steps", o.warmup_steps, o.warmup_steps >= 0, ">= 0")
    for key in ("beta1", "beta2"):
        _need(f"optim.{key}", getattr(o, key), 0 <= getattr(o, key) < 1, "in [0, 1)")
    _positive("optim.eps", o.eps)
    _non_negative("optim.weight_decay", o.weight_decay)
    _non_negative("optim.grad_clip", o.grad_clip, " (0 disables clipping)")
    _one_of("optim.decay", o.decay, DECAYS)
    _one_of("optim.moment_dtype", o.moment_dtype, moment_dtypes())
    _one_of("optim.master", o.master, masters())
    if o.decay == "phases" and not o.phases:
        raise ConfigError("optim.phases: optim.decay=phases needs at least one phase {tokens, lr, shape}")
    if o.decay != "phases" and o.phases:
        raise ConfigError(f"optim.phases: set, but optim.decay={o.decay} ignores them; set optim.decay=phases")
    for i, ph in enumerate(o.phases):
        _positive(f"optim.phases[{i}].tokens", ph.tokens)
        _non_negative(f"optim.phases[{i}].lr", ph.lr)
        _one_of(f"optim.phases[{i}].shape", ph.shape, LR_SHAPES)


def _check_train(t: TrainConfig) -> None:
    for key in ("max_steps", "global_batch_size", "micro_batch_size"):
        _need(f"train.{key}", getattr(t, key), getattr(t, key) > 0, "> 0")
    if t.stop_at_step is not None:
        _need("train.stop_at_step", t.stop_at_step, t.stop_at_step > 0, "> 0 or null")
    _need("train.seed", t.seed, 0 <= t.seed < 2**63, "in 0..2**63-1")
    _need("train.eval_every", t.eval_every, t.eval_every >= 0, ">= 0 (0 = only before the first and after the last step)")
    _need("train.eval_batches", t.eval_batches, t.eval_batches >= 0, ">= 0 (0 = the whole validation split)")
    _non_negative("train.aux_loss_alpha", t.aux_loss_alpha)
    _check_piecewise("train.bias_update_speed", t.bias_update_speed)
    _check_piecewise("train.mtp_loss_weight", t.mtp_loss_weight)
    _need("train.max_skipped_steps", t.max_skipped_steps, t.max_skipped_steps >= 1, ">= 1")
    h = t.health
    _need("train.health.patience", h.patience, h.patience >= 1, ">= 1")
    _need("train.health.max_rollbacks", h.max_rollbacks, h.max_rollbacks >= 0, ">= 0 (0: stop at the first unhealthy streak)")
    _need("train.health.spike_sigmas", h.spike_sigmas, _finite(h.spike_sigmas) and h.spike_sigmas > 0, "finite and > 0")
    _need("train.health.warmup_steps", h.warmup_steps, h.warmup_steps >= 1, ">= 1")
    _need("train.health.max_loss_over_uniform", h.max_loss_over_uniform,
          _finite(h.max_loss_over_uniform) and h.max_loss_over_uniform > 1, "finite and > 1")
    _check_ramp(t)
    if t.ema_decay is not None:
        _need("train.ema_decay", t.ema_decay, _finite(t.ema_decay) and 0 < t.ema_decay < 1, "in (0, 1), or null (off)")
    _one_of("train.precision", t.precision, precisions())
    _one_of("train.recompute", t.recompute, recompute_modes())
    _one_of("train.head_loss", t.head_loss, head_losses())
    _one_of("train.compile", t.compile, compile_modes())
    _one_of("train.cuda_graph", t.cuda_graph, cuda_graph_modes())
    _one_of("train.device", t.device, DEVICES)
    if t.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ConfigError("train.device: 'cuda' requested but no CUDA device is available (use auto or cpu)")


def _check_piecewise(key: str, pw: Piecewise) -> None:
    for part in ("value", "then"):
        v = getattr(pw, part)
        if v is not None:
            _non_negative(f"{key}.{part}", v)
    for part in ("after_steps", "after_tokens"):
        v = getattr(pw, part)
        if v is not None:
            _need(f"{key}.{part}", v, v >= 0, ">= 0 or null")
    switch = pw.after_steps is not None or pw.after_tokens is not None
    if pw.then is not None and not switch:
        raise ConfigError(f"{key}.then: set to {_num(pw.then)} but {key}.after_steps and {key}.after_tokens are "
                          "both null, so it never applies; set one of them (or then=null)")
    if pw.then is None and switch:
        raise ConfigError(f"{key}.then: null, so {key}.after_steps / after_tokens switch to nothing; "
                          "set then (the value after the switch) or clear them")


def _check_ramp(t: TrainConfig) -> None:
    r = t.batch_ramp
    if r.start is None:
        if r.increment is not None or r.tokens:
            raise ConfigError("train.batch_ramp.start: null (no ramp) but increment/tokens are set; set start")
        return
    _need("train.batch_ramp.start", r.start, 0 < r.start < t.global_batch_size,
          f"> 0 and < train.global_batch_size ({t.global_batch_size})")
    inc = r.increment if r.increment is not None else r.start
    _need("train.batch_ramp.increment", inc, inc > 0, "> 0 (or null: the start value)")
    if (t.global_batch_size - r.start) % inc:
        raise ConfigError(f"train.batch_ramp.increment: {inc} steps from start {r.start} never reach "
                          f"train.global_batch_size {t.global_batch_size}; (global - start) must be a multiple of it")
    _positive("train.batch_ramp.tokens", r.tokens)


def _check_parallel(p: ParallelConfig) -> None:
    for key in ("pp", "ep", "ranks_per_node"):
        _need(f"parallel.{key}", getattr(p, key), getattr(p, key) >= 1, ">= 1")
    _need("parallel.timeout_s", p.timeout_s, p.timeout_s > 0, "> 0 (seconds)")
    _positive("parallel.zero_bucket_mb", p.zero_bucket_mb)
    _one_of("parallel.ep_dispatcher", p.ep_dispatcher, dispatchers())
    _one_of("parallel.zero_backend", p.zero_backend, ZERO_BACKENDS)


def _check_data(d: DataConfig, m: ModelConfig) -> None:
    _need("data.val_fraction", d.val_fraction, 0 <= d.val_fraction < 1, "in [0, 1) (0 = no validation)")
    _one_of("data.on_bad_document", d.on_bad_document, BAD_DOCUMENT)
    if d.seq_len <= 1 or d.seq_len > m.max_seq_len:
        raise ConfigError(f"data.seq_len: must be in 2..model.max_seq_len ({m.max_seq_len}), got {d.seq_len}")
    for key in ("blend", "val_blend"):
        names = []
        for i, s in enumerate(getattr(d, key)):
            if s.path in (None, "", "???"):
                raise ConfigError(f"data.{key}[{i}].path: missing (a tools.prepare_data dir or a Megatron prefix)")
            _positive(f"data.{key}[{i}].weight", s.weight)
            names.append(s.name or os.path.basename(os.path.normpath(s.path)))
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"data.{key}: two sources are named {dup[0]}; give them distinct `name`s")
    if d.blend and (d.path is not None or d.tokenizer is not None):
        which = "data.path" if d.path is not None else "data.tokenizer"
        raise ConfigError(f"{which}: set together with data.blend; token datasets carry their tokenizer, so use "
                          f"one or the other (a single dataset is a blend of one)")
    if d.val_blend and not d.blend:
        raise ConfigError("data.val_blend: needs data.blend (a text corpus is split by data.val_fraction)")


def _check_logging(lg: LoggingConfig) -> None:
    _need("logging.log_every", lg.log_every, lg.log_every >= 0, ">= 0 (0 = no plain lines)")
    if lg.peak_tflops is not None:
        _need("logging.peak_tflops", lg.peak_tflops, _finite(lg.peak_tflops) and lg.peak_tflops > 0,
              "finite and > 0, or null")
    _one_of("logging.wandb.mode", lg.wandb.mode, WANDB_MODES)
    if os.environ.get("WANDB_MODE"):   # wins over logging.wandb.mode (trainer.wandb_panels.wandb_mode)
        _one_of("WANDB_MODE (environment)", os.environ["WANDB_MODE"], WANDB_MODES)
    _positive("logging.straggler_threshold", lg.straggler_threshold)
    _need("logging.straggler_steps", lg.straggler_steps, lg.straggler_steps >= 1, ">= 1")


def _check_checkpoint(c: CheckpointConfig) -> None:
    _need("checkpoint.every", c.every, c.every >= 0, ">= 0 (0 = only at the end)")
    _need("checkpoint.keep", c.keep, c.keep >= 0, ">= 0 (0 keeps all)")
    if c.resume not in ("auto", "none") and not os.path.isdir(os.path.expanduser(c.resume)):
        raise ConfigError(f"checkpoint.resume: {c.resume!r} is not a directory (use auto, none or a checkpoint dir)")

