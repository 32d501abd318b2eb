"""Typed configuration schema, registered in Hydra's ConfigStore as ``schema``.

YAML files in the groups beside this file only fill values; every key must exist here.
``validate(cfg, world_size)`` checks cross-field rules and raises ``ConfigError`` naming the key,
before anything is built.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from models.config import ConfigError, ModelConfig

PRECISIONS = ("fp32", "bf16", "fp8")
DEVICES = ("auto", "cpu", "cuda")
SCHEDULES = ("none", "1f1b", "dualpipe", "dualpipev")
WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class ParallelConfig:
    pp: int = 1                 # pipeline-parallel size
    ep: int = 1                 # expert-parallel size (inside the data-parallel ranks)
    schedule: str = "none"      # pipeline schedule: none | 1f1b | dualpipe | dualpipev
    ranks_per_node: int = 1     # GPUs per node; routing groups map to the nodes of the EP group
    zero: int = 0               # ZeRO stage: 0 (off), 1 (optimizer state), 2 (+ gradients)
    zero_backend: str = "native"  # native (parallel/zero) | deepspeed (DeepSpeed's ZeRO-1/2 optimizer; pp = 1)
    zero_bucket_mb: float = 32.0  # gradient reduce-scatter / parameter all-gather bucket size (native)
    ep_dispatcher: str = "hierarchical"  # hierarchical (node-limited, 2-stage) | alltoall (flat)
    timeout_s: int = 600        # collective timeout; a hung peer raises an error naming rank and layer
    pp_layout: Optional[list[int]] = None  # layers per pipeline stage; None = even split (extra to the middle)
    overlap: bool = True        # DualPipe/DualPipeV F&B: interleave forward and backward pieces around the expert all-to-alls (docs/pipeline.md)
    ep_latency_ms: float = 0.0  # injected latency per expert all-to-all (for overlap measurements)
    fp8_dispatch: bool = False  # MoE dispatch sends tokens as FP8 (E4M3, pow2 1x128 scales); combine stays BF16


@dataclass
class OptimConfig:
    lr: float = 3e-3            # peak learning rate
    min_lr: float = 3e-4        # end of the cosine decay
    warmup_steps: int = 20      # linear warmup from 0
    decay: str = "cosine"       # cosine | constant (after warmup)
    weight_decay: float = 0.1   # applied to matrices and embeddings, not to norms
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0      # max global grad norm; 0 disables clipping
    moment_dtype: str = "auto"  # AdamW moments: auto (bf16 with parallel.zero >= 1, else fp32) | bf16 | fp32


@dataclass
class Piecewise:
    """A value that switches to ``then`` once ``after_steps`` steps or ``after_tokens`` tokens are done."""
    value: float = 0.0
    then: Optional[float] = None
    after_steps: Optional[int] = None
    after_tokens: Optional[int] = None

    def at(self, step: int, tokens: int) -> float:
        if self.then is None:
            return self.value
        if (self.after_steps is not None and step >= self.after_steps) or \
                (self.after_tokens is not None and tokens >= self.after_tokens):
            return self.then
        return self.value


@dataclass
class TrainConfig:
    max_steps: int = 200              # optimizer steps; the LR schedule spans these
    stop_at_step: Optional[int] = None  # exit after this step (e.g. a job's time slice); resume continues
    seed: int = 0                     # model init and data order
    global_batch_size: int = 16       # sequences per optimizer step (over all data-parallel ranks)
    micro_batch_size: int = 8         # sequences per forward/backward on one rank
    precision: str = "fp32"           # fp32 | bf16 (autocast, fp32 master weights) | fp8 (bf16 + FP8 linears/experts)
    device: str = "auto"              # auto (cuda if available) | cpu | cuda
    eval_every: int = 50              # validation every N steps (and before the first / after the last); 0 = only those
    eval_batches: int = 4             # validation batches of micro_batch_size sequences
    aux_loss_alpha: float = 1e-4      # weight of the sequence-wise balance loss (V3: 1e-4)
    # Aux-loss-free balancing speed gamma (V3: 0.001, then 0 for the last 500B tokens).
    bias_update_speed: Piecewise = field(default_factory=lambda: Piecewise(value=0.001))
    # MTP loss weight lambda (V3: 0.3 for the first 10T tokens, then 0.1).
    mtp_loss_weight: Piecewise = field(default_factory=lambda: Piecewise(value=0.3))


@dataclass
class DataConfig:
    path: Optional[str] = None        # None: embedded corpus (CPython's pydoc topics); else file/glob/dir/saved dataset
    tokenizer: Optional[str] = None   # None: byte-level BPE trained on first use (vocab = model.vocab_size); else HF tokenizer dir
    seq_len: int = 128
    text_field: str = "text"
    val_fraction: float = 0.05
    cache_dir: str = "~/.cache/dsv3-train"


@dataclass
class WandbConfig:
    mode: str = "offline"             # offline | online (needs WANDB_API_KEY) | disabled
    project: str = "dsv3-train"
    entity: Optional[str] = None
    name: Optional[str] = None
    tags: list[str] = field(default_factory=list)


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress: bool = True             # tqdm bar on rank 0


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None         # None: <run dir>/checkpoints
    every: int = 0                    # save every N steps; 0 = only at the end
    resume: str = "auto"              # auto (newest complete checkpoint in dir, if any) | none | <path>
    keep: int = 3                     # newest checkpoints kept; 0 keeps all
    save_final: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def register() -> None:
    ConfigStore.instance().store(name="schema", node=Config)


def to_object(cfg: Any) -> Config:
    """DictConfig from Hydra -> typed ``Config`` dataclass."""
    if isinstance(cfg, Config):
        return cfg
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), cfg))


def _one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}")


def moment_dtype(cfg: Config) -> str:
    """The AdamW moment dtype a config resolves to: ``auto`` is bf16 under the native ZeRO optimizer
    (DeepSeek-V3's recipe) and fp32 otherwise (torch.optim.AdamW; DeepSpeed's optimizer)."""
    o, p = cfg.optim, cfg.parallel
    if o.moment_dtype != "auto":
        return o.moment_dtype
    return "bf16" if p.zero >= 1 and p.zero_backend == "native" else "fp32"


def validate(cfg: Config, world_size: int = 1) -> Config:
    """Cross-field checks; raises ``ConfigError('<key>: <what is wrong>')``. Runs before anything is built."""
    cfg.model.validate("model")
    t, p, o, d = cfg.train, cfg.parallel, cfg.optim, cfg.data
    _one_of("train.precision", t.precision, PRECISIONS)
    _one_of("train.device", t.device, DEVICES)
    _one_of("parallel.schedule", p.schedule, SCHEDULES)
    _one_of("logging.wandb.mode", cfg.logging.wandb.mode, WANDB_MODES)
    _one_of("optim.decay", o.decay, ("cosine", "constant"))
    _one_of("parallel.ep_dispatcher", p.ep_dispatcher, ("hierarchical", "alltoall"))
    for key in ("max_steps", "global_batch_size", "micro_batch_size"):
        if getattr(t, key) <= 0:
            raise ConfigError(f"train.{key}: must be > 0, got {getattr(t, key)}")
    for key in ("pp", "ep", "ranks_per_node"):
        if getattr(p, key) <= 0:
            raise ConfigError(f"parallel.{key}: must be >= 1, got {getattr(p, key)}")
    if p.zero not in (0, 1, 2):
        raise ConfigError(f"parallel.zero: must be 0, 1 or 2, got {p.zero}")
    from parallel.dims import ParallelDims   # validates pp/ep/ranks_per_node against the world size
    dims = ParallelDims(world_size=world_size, pp=p.pp, ep=p.ep, ranks_per_node=p.ranks_per_node)
    dims.check_model(cfg.model)
    dp = dims.dp
    _one_of("parallel.zero_backend", p.zero_backend, ("native", "deepspeed"))
    _one_of("optim.moment_dtype", o.moment_dtype, ("auto", "bf16", "fp32"))
    if o.moment_dtype == "bf16" and p.zero == 0:
        raise ConfigError("optim.moment_dtype=bf16 needs parallel.zero >= 1 (without ZeRO the optimizer is "
                          "torch.optim.AdamW, whose moments are fp32; use auto or fp32)")
    if p.zero_bucket_mb <= 0:
        raise ConfigError(f"parallel.zero_bucket_mb: must be > 0, got {p.zero_bucket_mb}")
    if p.zero_backend == "deepspeed":
        if p.zero == 0:
            raise ConfigError("parallel.zero_backend=deepspeed needs parallel.zero = 1 or 2")
        if world_size < 2:
            raise ConfigError("parallel.zero_backend=deepspeed needs >= 2 data-parallel processes (torchrun); "
                              "in one process use parallel.zero=0 or zero_backend=native")
        if p.pp > 1:
            raise ConfigError(f"parallel.zero_backend=deepspeed with parallel.pp ({p.pp}): DeepSpeed's ZeRO "
                              "optimizer does not compose with our pipeline executor; use zero_backend=native")
        if o.moment_dtype == "bf16":
            raise ConfigError("optim.moment_dtype=bf16 with parallel.zero_backend=deepspeed: DeepSpeed's ZeRO-1/2 "
                              "keeps the wrapped AdamW's moments in fp32; use fp32 (or auto) or zero_backend=native")
    if (p.pp > 1) != (p.schedule != "none"):
        raise ConfigError(f"parallel.schedule ({p.schedule}) with parallel.pp ({p.pp}): pp > 1 needs a schedule "
                          "(1f1b, zb1p, dualpipe, dualpipev) and pp = 1 needs schedule=none")
    if t.stop_at_step is not None and t.stop_at_step <= 0:
        raise ConfigError(f"train.stop_at_step: must be > 0 or null, got {t.stop_at_step}")
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            f"train.global_batch_size ({t.global_batch_size}) must be divisible by train.micro_batch_size "
            f"({t.micro_batch_size}) x data-parallel size ({dp})")
    if p.pp > 1:
        from parallel.pipeline.schedules import get_schedule
        from parallel.pipeline.stages import layer_split, n_stages_of
        n_micro = t.global_batch_size // (t.micro_batch_size * dp)
        try:
            get_schedule(p.schedule, p.pp, n_micro)
            layer_split(cfg.model.n_layers, n_stages_of(p.schedule, p.pp), p.pp_layout)
        except ValueError as e:
            raise ConfigError(f"parallel.schedule={p.schedule} with {n_micro} micro-batches per step "
                              f"(train.global_batch_size / (train.micro_batch_size x dp {dp})): {e}") from e
    if d.seq_len <= 1 or d.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"data.seq_len ({d.seq_len}) must be in 2..model.max_seq_len ({cfg.model.max_seq_len})")
    if not 0 < d.val_fraction < 1:
        raise ConfigError(f"data.val_fraction ({d.val_fraction}) must be in (0, 1)")
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise ConfigError(f"optim.min_lr ({o.min_lr}) must be in [0, optim.lr ({o.lr})] and optim.lr > 0")
    if o.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps: must be >= 0, got {o.warmup_steps}")
    if cfg.checkpoint.every < 0 or cfg.checkpoint.keep < 0:
        raise ConfigError("checkpoint.every and checkpoint.keep must be >= 0")
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none") and not os.path.isdir(os.path.expanduser(resume)):
        raise ConfigError(f"checkpoint.resume: {resume!r} is not a directory (use auto, none or a checkpoint dir)")
    if t.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ConfigError("train.device: 'cuda' requested but no CUDA device is available (use auto or cpu)")
    return cfg
