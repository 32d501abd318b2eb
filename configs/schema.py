"""Typed configuration schema, registered in Hydra's ConfigStore as ``schema``.

Every key and its default live here; the YAML groups beside this file hold only what differs (model presets,
experiments). ``to_object`` refuses a key the schema lacks (Hydra's ``+key=value`` adds any), and ``check_key``
checks a command-line key and the type of its value before Hydra composes: a typo has a "did you mean" hint, a
value of the wrong type (``train.max_steps=abc``, a dict where a list goes) names what was expected.
``validate(cfg, world_size)`` checks every key's range (NaN and infinities included), its allowed values
(``configs.checks``) and the cross-field rules, and raises a one-line ``ConfigError`` naming the key, before
anything is built.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException
from omegaconf.nodes import BooleanNode, FloatNode, IntegerNode, StringNode

from errors import ConfigError
from models.config import ModelConfig, ModelError
from parallel.pipeline.schedules import NO_PIPELINE

from .checks import check_sections


@dataclass
class ParallelConfig:
    pp: int = 1                 # pipeline-parallel size
    ep: int = 1                 # expert-parallel size (inside the data-parallel ranks)
    schedule: str = NO_PIPELINE  # pipeline schedule: none (pp = 1) or a name in parallel.pipeline.schedules.SCHEDULES
    ranks_per_node: int = 1     # GPUs per node: where the hierarchical dispatcher's node boundaries lie
    zero: int = 0               # ZeRO stage: 0 (off), 1 (optimizer state), 2 (+ gradients)
    zero_backend: str = "native"  # native (parallel/zero) | deepspeed (DeepSpeed's ZeRO-1/2 optimizer; pp = 1)
    zero_bucket_mb: float = 32.0  # gradient reduce-scatter / parameter all-gather bucket size (native)
    ep_dispatcher: str = "hierarchical"  # hierarchical (node-limited, 2-stage) | alltoall (flat)
    timeout_s: int = 600        # collective timeout and the wait for all ranks to join (s, > 0)
    pp_layout: Optional[list[int]] = None  # layers per pipeline stage; None = even split (extra to the middle)
    overlap: bool = True        # DualPipe/DualPipeV F&B: interleave forward and backward pieces around the expert all-to-alls, where there are some (ep > 1; parallel.parallelize.fb_overlap, docs/pipeline.md)
    fp8_dispatch: bool = False  # MoE dispatch sends tokens as FP8 (E4M3, pow2 1x128 scales); combine stays BF16


@dataclass
class LRPhase:
    """One phase of ``optim.decay=phases``: lasts ``tokens`` and moves from the previous phase's end value
    (``optim.lr`` for the first) to ``lr``."""
    tokens: float = 0.0         # length in consumed tokens, > 0
    lr: float = 0.0             # value at the end (throughout, for constant)
    shape: str = "constant"     # constant | linear | cosine


@dataclass
class OptimConfig:
    lr: float = 3e-3            # peak learning rate
    min_lr: float = 3e-4        # end of the cosine decay
    warmup_steps: int = 20      # linear warmup from 0
    decay: str = "cosine"       # cosine | constant (after warmup, over train.max_steps) | phases (optim.phases, by tokens)
    phases: list[LRPhase] = field(default_factory=list)   # decay=phases: consecutive phases (V3: configs/schedule/v3.yaml)
    weight_decay: float = 0.1   # applied to matrices and embeddings, not to norms
    beta1: float = 0.9          # AdamW first-moment decay, in [0, 1)
    beta2: float = 0.95         # AdamW second-moment decay, in [0, 1)
    eps: float = 1e-8           # AdamW denominator term, > 0
    grad_clip: float = 1.0      # max global grad norm; 0 disables clipping
    moment_dtype: str = "auto"  # AdamW moments: auto (bf16 beside an FP32 master: BF16 weights, ZeRO) | bf16 | fp32
    master: str = "fp32"        # the FP32 master of BF16 weights: fp32 (its own tensor) | split (the BF16 weight
                                # + 16 low bits: 2 bytes less per parameter; parallel.zero=0; opt-in until measured)


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
class BatchRamp:
    """Batch-size ramp-up: ``start`` sequences per step, growing by ``increment`` evenly over the first
    ``tokens`` consumed tokens to ``train.global_batch_size`` (V3: 3,072 -> 15,360 over 469B tokens)."""
    start: Optional[int] = None       # None: no ramp
    increment: Optional[int] = None   # None: start (every size is then a multiple of start)
    tokens: float = 0.0


@dataclass
class HealthConfig:
    """The health guard (trainer/health.py): a step is unhealthy when its loss or gradient norm spikes, the model has
    collapsed (no gradient, or the loss back at ln(vocab) after it had learned), or every token goes to the same
    experts; ``patience`` unhealthy steps in a row roll the run back to the newest checkpoint written while healthy
    and skip the data read since."""
    enabled: bool = True
    patience: int = 3                 # unhealthy steps in a row that trigger a rollback
    max_rollbacks: int = 3            # rollbacks in one run (resumes included) before it stops with exit 3
    spike_sigmas: float = 6.0         # a loss (log grad norm) this many running deviations above its running mean is a spike
    warmup_steps: int = 20            # healthy steps of history before the spike and collapse rules apply
    max_loss_over_uniform: float = 1.5  # a loss above this multiple of ln(model.vocab_size) (uniform guessing) is unhealthy from step 1


@dataclass
class TrainConfig:
    max_steps: int = 200              # optimizer steps; the LR schedule spans these
    stop_at_step: Optional[int] = None  # exit after this step (e.g. a job's time slice); resume continues
    seed: int = 0                     # model init and data order
    global_batch_size: int = 16       # sequences per optimizer step (over all data-parallel ranks)
    micro_batch_size: int = 8         # sequences per forward/backward on one rank
    precision: str = "fp32"           # fp32 | bf16 (BF16 weights, FP32 master + grads in the optimizer) | fp8 (bf16 + FP8 linears/experts)
    # Activation recomputation (parallel/recompute.py): none | selective (V3's set: RMSNorm, MLA up-projections + attention,
    # SwiGLU; recomputed in backward from their inputs, MoE SwiGLU inputs kept in FP8 with precision=fp8) | full (each
    # dense layer; a MoE layer's compute between its all-to-alls)
    recompute: str = "none"
    # The output heads' cross-entropy: plain (head(x), then F.cross_entropy in FP32) | chunked (models/loss.py: no N x V
    # FP32 tensor kept or made, for a batch whose FP32 logits do not fit; more elementwise passes, so slower in eager)
    head_loss: str = "fused"
    # Regional torch.compile of the norms and SwiGLU products (parallel/compile.py): auto (on CUDA; the CPU stays eager)
    # | on | off
    compile: str = "auto"
    # The step's forward and backward replayed as one CUDA graph after two eager steps (parallel/cuda_graph.py): the
    # host launches them with one call. auto (one process on CUDA, BF16 weights, no recomputation: what a GPU has run)
    # | on (FP32 weights and recomputation too; refused without CUDA or with more processes) | off
    cuda_graph: str = "auto"
    device: str = "auto"              # auto (cuda if available) | cpu | cuda
    eval_every: int = 50              # validation every N steps (and before the first / after the last); 0 = only those
    eval_batches: int = 4             # validation batches of micro_batch_size sequences
    aux_loss_alpha: float = 1e-4      # weight of the sequence-wise balance loss (V3: 1e-4)
    # Aux-loss-free balancing speed gamma (V3: 0.001, then 0 for the last 500B tokens).
    bias_update_speed: Piecewise = field(default_factory=lambda: Piecewise(value=0.001))
    # MTP loss weight lambda (V3: 0.3 for the first 10T tokens, then 0.1).
    mtp_loss_weight: Piecewise = field(default_factory=lambda: Piecewise(value=0.3))
    batch_ramp: BatchRamp = field(default_factory=BatchRamp)
    ema_decay: Optional[float] = None  # parameter EMA in CPU memory, updated in the background after each step (V3 §3.3); null = off
    memory_check: bool = True         # before building: stop with one line if the per-rank memory estimate exceeds free memory
    max_skipped_steps: int = 3        # consecutive optimizer steps skipped for a non-finite loss or gradient norm before the run stops with an error
    health: HealthConfig = field(default_factory=HealthConfig)


@dataclass
class BlendSource:
    path: str = "???"                 # a tools.prepare_data output dir, or a Megatron-LM prefix (foo for foo.bin/.idx)
    weight: float = 1.0               # share of the samples, relative to the other sources' weights
    name: Optional[str] = None        # label in metrics (default: the path's last component)


@dataclass
class DataConfig:
    path: Optional[str] = None        # None: embedded corpus (CPython's pydoc topics); else file/glob/dir/saved dataset
    tokenizer: Optional[str] = None   # HF tokenizer dir or tokenizer.json; None: the one checkpoint.init_from carries, else a byte-level BPE trained on first use (vocab = model.vocab_size)
    seq_len: int = 128
    text_field: str = "text"
    val_fraction: float = 0.05        # share of documents held out for validation, in [0, 1); 0 = no validation
    cache_dir: str = "~/.cache/dsv3-train"
    # Token datasets (python -m tools.prepare_data, or Megatron-LM .bin/.idx prefixes; docs/data.md), read
    # memory-mapped: [{path, weight}, ...]. Replaces data.path / tokenizer / text_field / val_fraction.
    blend: list[BlendSource] = field(default_factory=list)
    val_blend: list[BlendSource] = field(default_factory=list)   # validation sources (val_loss per source); empty: none
    on_bad_document: str = "error"    # a token id >= model.vocab_size in data.blend: error (one line naming shard, document, position) | skip (its windows replaced by the next clean ones, deterministically)


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
    progress: bool = True             # tqdm bar on rank 0 (only when stderr is a terminal)
    log_every: int = 10               # a plain line (step, loss, lr, grad norm, tok/s, MFU, memory, ETA) every N steps on rank 0, also in <run dir>/train.log; 0 = none
    peak_tflops: Optional[float] = None  # peak TFLOP/s per device for MFU (null: known GPUs by name, or $DSV3_PEAK_TFLOPS)
    # Stragglers (world > 1): a rank whose compute time of a step (forward/backward less its waits in expert all-to-alls;
    # pipeline: its compute actions) exceeds the median rank's by this share for straggler_steps steps in a row is named
    straggler_threshold: float = 0.2
    straggler_steps: int = 5


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None         # None: <run dir>/checkpoints
    every: int = 0                    # save every N steps; 0 = only at the end
    resume: str = "auto"              # auto (newest complete checkpoint in dir, if any) | none | <path>
    # Start from these weights (our checkpoint's step dir, or a Hugging Face DeepseekV3 directory): model and
    # balancing biases only, step 0, fresh optimizer, any layout. Ignored once checkpoint.resume finds a checkpoint.
    # A HF directory's config.json is the model unless model=<preset> is on the command line; the tokenizer it
    # carries (a HF directory's, a step dir's) is data.tokenizer unless that is set (configs/init_from.py).
    init_from: Optional[str] = None
    keep: int = 3                     # newest checkpoints kept; 0 keeps all
    save_final: bool = True
    # Periodic saves (checkpoint.every) copy the state to CPU memory and write it on a background thread while
    # training goes on; a save waits for the one before, a stop and the run's end for the last. A failed write
    # ends the run like a failed synchronous save (exit 2). Costs a CPU copy of this rank's state.
    async_save: bool = False


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


def compose(overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The typed config of ``configs/config.yaml`` with Hydra ``overrides``, as ``python -m trainer`` composes it
    (not yet validated; ``checkpoint.init_from`` applied, ``configs.init_from``): the one compose for the tools and
    benchmarks."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from .init_from import apply_init_from
    register()
    with initialize_config_module("configs", version_base=None):
        return apply_init_from(to_object(hydra_compose("config", overrides=list(overrides))), overrides)


def to_object(cfg: Any) -> Config:
    """DictConfig from Hydra -> typed ``Config`` dataclass. A key the schema lacks is a ``ConfigError``: Hydra's
    ``+key=value`` adds any key (``+train.max_step=3``), and the merge below would silently drop it."""
    if isinstance(cfg, Config):
        return cfg
    _check_tree(OmegaConf.to_container(cfg, resolve=False), Config, "")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), cfg))
    except OmegaConfBaseException as e:   # a value no command-line check saw: an experiment file's, a missing one
        raise ConfigError(omegaconf_message(e)) from None


def omegaconf_message(e: OmegaConfBaseException) -> str:
    """``<key>: <OmegaConf's first line>`` for an error OmegaConf raised while composing or converting a config
    (its ``full_key`` names the key when it knows it)."""
    key, text = getattr(e, "full_key", None), str(e).splitlines()[0] if str(e) else type(e).__name__
    if isinstance(e, MissingMandatoryValue):
        return f"{key or text}: missing (this key has no default); set it"
    return f"{key}: {text}" if key else text


# ------------------------------------------------------------------------------------------- strict keys
_NO_VALUE = object()   # check_key without a value: the key alone (a deletion, a sweep)


def check_key(dotted: str, value: Any = _NO_VALUE, top_level_extra: tuple[str, ...] = ()) -> None:
    """``ConfigError`` unless ``dotted`` (``train.max_steps``, ``optim.phases``, ``optim.phases.0.lr``) names a
    key of the schema or a group of keys, and every key inside ``value`` (a dict or list given on the command
    line: ``+optim.phases=[{tokens: 1e9, lr: 1e-4}]``) is one too; the message suggests the closest keys at the
    level that went wrong; a value of the wrong type for its key is one too (``_check_types``).
    ``top_level_extra``: more names to suggest at the top (the config groups: ``exp``)."""
    node: Any = Config
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        node, path = _strip_optional(node), ".".join(parts[:i])
        if dataclasses.is_dataclass(node):
            fields = _field_types(node)
            if part not in fields:
                raise _unknown_key(path, part, list(fields), suggest=top_level_extra if i == 0 else ())
            node = fields[part]
        elif get_origin(node) is list:
            if not part.isdigit():
                raise ConfigError(f"{dotted}: not a config key; {path} is a list (its entries: {path}.0, {path}.1, ...)")
            node = get_args(node)[0]
        elif node is Any or get_origin(node) is dict:
            return
        else:
            raise ConfigError(f"{dotted}: not a config key; {path} is a single value, not a group of keys")
    if value is not _NO_VALUE:
        _check_tree(value, node, dotted)
        _check_types(value, node, dotted)


def _check_tree(value: Any, node: Any, path: str) -> None:
    """Every dict key in ``value`` (a composed config as plain containers) must be a field of the dataclass
    ``node`` at that place; list elements are checked against the list's element type."""
    node = _strip_optional(node)
    if dataclasses.is_dataclass(node) and isinstance(value, dict):
        fields = _field_types(node)
        for key, sub in value.items():
            if key not in fields:
                raise _unknown_key(path, str(key), list(fields))
            _check_tree(sub, fields[key], f"{path}.{key}" if path else str(key))
    elif get_origin(node) is list and isinstance(value, list):
        for i, sub in enumerate(value):
            _check_tree(sub, get_args(node)[0], f"{path}[{i}]")


# A command-line value as OmegaConf converts it for a key of this type (Hydra composes with the same rules):
# ``"5"`` is an int, ``"abc"`` or ``1.5`` is not; ``${...}`` interpolations pass.
_SCALARS = {int: IntegerNode, float: FloatNode, bool: BooleanNode, str: StringNode}


def _check_types(value: Any, node: Any, path: str) -> None:
    """``ConfigError('<key>: <what is wrong> (expected <type>, got <value>)')`` for the first value in ``value`` (a
    command-line value, Hydra-parsed: scalars, lists, dicts) that OmegaConf would refuse for the schema type
    ``node``; keys inside dicts are checked by ``_check_tree``."""
    declared, node = node, _strip_optional(node)
    if value is None or node is Any or get_origin(node) is dict:
        if value is None and declared is node and node is not Any:
            raise _wrong(path, node, value, "null is not allowed here")
        return
    if dataclasses.is_dataclass(node):
        if not isinstance(value, dict):
            raise _wrong(path, declared, value, f"{_kind(value)} where a group of keys is expected")
        fields = _field_types(node)
        for key, sub in value.items():
            _check_types(sub, fields[key], f"{path}.{key}")
    elif get_origin(node) is list:
        if not isinstance(value, list):
            raise _wrong(path, declared, value, f"{_kind(value)} where a list is expected")
        for i, sub in enumerate(value):
            _check_types(sub, get_args(node)[0], f"{path}[{i}]")
    elif node in _SCALARS:
        if isinstance(value, (dict, list)):
            raise _wrong(path, declared, value, f"{_kind(value)} where a single value is expected")
        try:
            _SCALARS[node](value)
        except OmegaConfBaseException:
            raise _wrong(path, declared, value, f"not {_type_name(node, article=True)}") from None


def _wrong(path: str, node: Any, value: Any, what: str) -> ConfigError:
    return ConfigError(f"{path}: {what} (expected {_type_name(node)}, got {_show(value)})")


def _kind(value: Any) -> str:
    return "a dict" if isinstance(value, dict) else "a list" if isinstance(value, list) else "a single value"


def _type_name(tp: Any, article: bool = False) -> str:
    """``int``, ``list of {path, weight, name}``; with ``article``: ``an integer``, ``a number``."""
    if article and tp in _SCALARS:
        return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[tp]
    if get_origin(tp) is Union:
        return " or ".join("null" if a is type(None) else _type_name(a) for a in get_args(tp))
    if get_origin(tp) is list:
        return f"list of {_type_name(get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "{" + ", ".join(f.name for f in dataclasses.fields(tp)) + "}"
    return getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
    """A value as it would be written on the command line: ``'abc'``, ``{path: x}``, ``[1]``, ``null``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value)


def _unknown_key(path: str, key: str, keys: list[str], suggest: tuple[str, ...] = ()) -> ConfigError:
    """``train.max_step: not a config key; did you mean train.max_steps?``: the best difflib matches among
    ``keys`` (and ``suggest``) at that level, or all of ``keys`` when nothing is close."""
    prefix = f"{path}." if path else ""
    candidates = [*keys, *suggest]
    scores = {c: difflib.SequenceMatcher(None, key, c).ratio() for c in candidates}
    best = max(scores.values(), default=0.0)
    close = [c for c in candidates if scores[c] >= 0.6 and scores[c] == best][:3]
    if close:
        hint = "did you mean " + " or ".join(prefix + c for c in close) + "?"
    else:
        hint = f"the keys {'under ' + path if path else 'at the top'} are {', '.join(keys)}"
    return ConfigError(f"{prefix}{key}: not a config key; {hint}")


def _strip_optional(tp: Any) -> Any:
    if get_origin(tp) is Union:
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else Any
    return tp


def _field_types(cls: type) -> dict[str, Any]:
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _check_cuda_graph(t: TrainConfig, world_size: int) -> None:
    if world_size > 1:
        raise ConfigError(f"train.cuda_graph=on: one process only (world size {world_size}): the graph would hold "
                          "the collectives; set train.cuda_graph=auto or off")
    import torch
    if t.device == "cpu" or not torch.cuda.is_available():
        none = "" if t.device == "cpu" else ", and none is available"
        raise ConfigError(f"train.cuda_graph=on needs a CUDA device (train.device={t.device}{none}); "
                          "set train.cuda_graph=auto or off")


def validate(cfg: Config, world_size: int = 1) -> Config:
    """Per-key ranges, then cross-field checks; raises ``ConfigError('<key>: <what is wrong>')``. Runs before
    anything is built."""
    try:
        cfg.model.validate("model")
    except ModelError as e:
        raise ConfigError(str(e)) from None
    check_sections(cfg)
    t, p, o = cfg.train, cfg.parallel, cfg.optim
    from parallel.dims import validate_layout
    from parallel.precision import Precision
    validate_layout(world_size, p.pp, p.ep, p.ranks_per_node, model=cfg.model, zero=p.zero,
                    zero_backend=p.zero_backend, moment_dtype=o.moment_dtype, schedule=p.schedule,
                    weights=Precision(t.precision).weights)
    if o.master == "split" and Precision(t.precision).weights == "fp32":
        raise ConfigError(f"optim.master: split keeps the FP32 master of BF16 weights as the weights and 16 low bits; "
                          f"train.precision={t.precision} has FP32 weights, their own master (set optim.master=fp32)")
    if o.master == "split" and p.zero:
        raise ConfigError(f"optim.master: split runs without ZeRO (parallel.zero=0), got parallel.zero={p.zero}: "
                          "ZeRO keeps its master as FP32 pieces (set optim.master=fp32)")
    if t.cuda_graph == "on":
        _check_cuda_graph(t, world_size)
    dp = world_size // p.pp
    from data.ramp import micro_batches, ramp_sizes
    for gbs in ramp_sizes(t):   # the ramp's sizes first: each must fit the layout as the final one does
        final = gbs == t.global_batch_size
        key = "train.global_batch_size" if final else "train.batch_ramp"
        if gbs % (t.micro_batch_size * dp):
            raise ConfigError(
                f"{key}: {'' if final else 'its step of '}{gbs} sequences must be divisible by train.micro_batch_size "
                f"({t.micro_batch_size}) x data-parallel size ({dp})"
                + ("" if final else "; choose batch_ramp.start and increment as multiples of it"))
        if p.pp > 1:
            from parallel.pipeline.schedules import get_schedule
            n_micro = micro_batches(gbs, t.micro_batch_size, dp)
            try:
                get_schedule(p.schedule, p.pp, n_micro)
            except ValueError as e:
                raise ConfigError(f"parallel.schedule={p.schedule} with {n_micro} micro-batches per step ({key}"
                                  f"{'' if final else ' step'} {gbs} / (train.micro_batch_size x dp {dp})): {e}") from e
    if p.pp > 1:
        from parallel.pipeline.schedules import get_schedule
        n_stages, layout = get_schedule(p.schedule, p.pp).n_stages, p.pp_layout
        if layout is not None and (len(layout) != n_stages or sum(layout) != cfg.model.n_layers or min(layout) < 0):
            raise ConfigError(f"parallel.pp_layout: need {n_stages} non-negative layer counts (stages of "
                              f"{p.schedule} with pp={p.pp}) summing to model.n_layers ({cfg.model.n_layers}), "
                              f"got {list(layout)}")
    elif p.pp_layout is not None:
        raise ConfigError(f"parallel.pp_layout: set to {list(p.pp_layout)} but parallel.pp is 1 (no pipeline); "
                          "remove it or set parallel.pp and parallel.schedule")
    return cfg
