"""A run before its first step: the pre-flight verdict, the data, the model, and the log's start-up lines."""
from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf

import models
from configs.schema import Config
from data import (BlendedBatches, PackedBatches, batch_size_at, blend_val_batches, carried_tokenizer, find_eos_id,
                  load_corpus, load_tokenizer, micro_batches, val_batches, vocab_difference)
from errors import ConfigError
from parallel.cuda_graph import WARMUP, why_eager
from parallel.dims import ParallelDims
from parallel.parallelize import ParallelSpec, parallelize
from parallel.precision import Precision

from .metrics import MetricsLogger, run_dir_writing, saved_run_id


def barrier(dims: ParallelDims) -> None:
    if dims.world_size > 1:
        torch.distributed.barrier()


def preflight_all_ranks(cfg: Config, dims: ParallelDims, device: torch.device) -> str:
    """trainer.preflight on every rank, one verdict for all: free memory differs per GPU, and a rank
    that stopped alone would leave the others waiting for it at the next collective."""
    from .preflight import preflight
    try:
        note, error = preflight(cfg, dims, device), None
    except ConfigError as e:
        note, error = "", e
    if dims.world_size > 1:
        flags = torch.zeros(dims.world_size, device=device)
        flags[dims.rank] = float(error is not None)
        torch.distributed.all_reduce(flags)
        short = [r for r, f in enumerate(flags.tolist()) if f]
        if short and error is None:
            raise ConfigError(f"memory: rank(s) {', '.join(map(str, short))} lack the memory this run needs "
                              f"(their own error line says how much); this rank: {note.removeprefix('memory: ')}")
    if error is not None:
        raise error
    return note


def load_corpus_rank0_first(cfg: Config, dims: ParallelDims):
    """Rank 0 tokenizes (and caches) first; the others then read the cache."""
    if not dims.is_main:
        barrier(dims)
    corpus = load_corpus(cfg.data, cfg.model.vocab_size)
    if dims.is_main:
        barrier(dims)
    return corpus


def parallel_spec(cfg: Config, dims: ParallelDims) -> ParallelSpec:
    """What ``parallel.parallelize`` needs of the config (the first step's micro-batches per rank)."""
    t, p = cfg.train, cfg.parallel
    return ParallelSpec(Precision(t.precision), p.ep_dispatcher, p.fp8_dispatch, p.schedule,
                        micro_batches(batch_size_at(t, 0), t.micro_batch_size, dims.dp),
                        tuple(p.pp_layout) if p.pp_layout is not None else None, p.overlap, t.recompute,
                        t.head_loss, t.compile)


def build_model(cfg: Config, dims: ParallelDims, device: torch.device, on_meta: bool):
    """The model, parallelized (``parallel.parallelize``: this rank's expert shard, FP8 layers, its pipeline
    stages, recomputation). Returns (model, pipe or None), in train mode."""
    model = models.build(cfg.model, device="meta" if on_meta else device, seed=cfg.train.seed)
    return parallelize(model, parallel_spec(cfg, dims), dims, device)


def open_data(cfg: Config, dims: ParallelDims, corpus):
    """(training batches, validation batches, validation batches per data.val_blend source)."""
    d, t = cfg.data, cfg.train
    if d.blend:
        batches, val_sources = open_blend(cfg, dims)
        return batches, [b for per_source in val_sources.values() for b in per_source], val_sources
    batches = PackedBatches(corpus.train_tokens, d.seq_len, t.global_batch_size, t.seed,
                            dp_rank=dims.dp_rank, dp_size=dims.dp)
    return batches, val_batches(corpus.val_tokens, d.seq_len, t.micro_batch_size, t.eval_batches), {}


def open_blend(cfg: Config, dims: ParallelDims):
    """data.blend / data.val_blend: memory-mapped token datasets (data/shards.py, data/blend.py)."""
    from data import open_tokens
    d, t = cfg.data, cfg.train
    opened = {}
    for key in ("blend", "val_blend"):
        srcs = [open_tokens(s.path) for s in getattr(d, key)]
        names = [s.name or Path(s.path).name for s in getattr(d, key)]
        opened[key] = (srcs, names)
    everything = [(f"data.{k}[{i}]", s) for k, (srcs, _) in opened.items() for i, s in enumerate(srcs)]
    tokenizers = {s.tokenizer_hash for _, s in everything if s.tokenizer_hash is not None}
    if len(tokenizers) > 1:
        listing = "; ".join(f"{k} {s.path}: {s.tokenizer_hash[:12]}" for k, s in everything if s.tokenizer_hash)
        raise ConfigError(f"data.blend: the sources were tokenized with different tokenizers ({listing}); "
                          "re-run tools.prepare_data with one tokenizer for all of them")
    for k, s in everything:
        if s.vocab_size is not None and s.vocab_size > cfg.model.vocab_size:
            raise ConfigError(f"{k}: {s.path} was tokenized with a vocabulary of {s.vocab_size}, more than "
                              f"model.vocab_size ({cfg.model.vocab_size}); raise model.vocab_size")
    srcs, names = opened["blend"]
    batches = BlendedBatches(srcs, [s.weight for s in d.blend], names, d.seq_len, t.seed,
                             dp_rank=dims.dp_rank, dp_size=dims.dp, vocab_size=cfg.model.vocab_size,
                             on_bad_document=d.on_bad_document)
    val = blend_val_batches(*opened["val_blend"], d.seq_len, t.micro_batch_size, t.eval_batches,
                            vocab_size=cfg.model.vocab_size, on_bad_document=d.on_bad_document)
    return batches, val


def run_tokenizer(cfg: Config, corpus):
    """The tokenizer the run's token ids come from: the text corpus's, or the first token dataset's own copy
    (``tools.prepare_data`` writes it to ``<dataset>/tokenizer/``); None for datasets without one (Megatron's)."""
    if corpus is not None:
        return corpus.tokenizer
    for s in cfg.data.blend:
        d = Path(s.path).expanduser() / "tokenizer"
        if d.is_dir():
            tok, _ = load_tokenizer(str(d))
            find_eos_id(tok, str(d))
            return tok
    return None


def check_init_tokenizer(cfg: Config) -> None:
    """``checkpoint.init_from`` carries a tokenizer (``data.carried_tokenizer``): the data must have been or be
    tokenized with one that gives every token the same id (and the same EOS), else one ``ConfigError`` line naming
    both. A Hugging Face directory without a tokenizer needs ``data.tokenizer`` for a text corpus: a BPE trained on
    the corpus would give the weights' ids other tokens. Token datasets without a tokenizer copy (Megatron's) are
    not checked; ``data.blend``'s vocabulary size against ``model.vocab_size`` is (``open_blend``)."""
    from configs.init_from import is_hf_dir
    src, d = cfg.checkpoint.init_from, cfg.data
    carried = carried_tokenizer(src)
    if carried is None:
        if is_hf_dir(src) and not d.blend and d.tokenizer is None:
            raise ConfigError(f"checkpoint.init_from: {src} holds no tokenizer (tokenizer.json, tokenizer_config.json): "
                              "set data.tokenizer to the tokenizer its weights were trained with (a byte-level BPE "
                              "trained on this corpus would give the weights' ids other tokens)")
        return
    if not d.blend and d.tokenizer is not None and Path(d.tokenizer).expanduser() == carried:
        return   # the carried one itself (configs.init_from's default)
    try:
        model_tok, _ = load_tokenizer(str(carried))
        find_eos_id(model_tok, str(carried))
    except ConfigError as e:   # its messages name data.tokenizer; this one is checkpoint.init_from's
        raise ConfigError(str(e).replace("data.tokenizer", "checkpoint.init_from", 1)) from None
    theirs = f"the tokenizer of checkpoint.init_from={src} ({carried})"
    if not d.blend:
        if d.tokenizer is None:
            raise ConfigError(f"data.tokenizer: unset, so a byte-level BPE would be trained on the corpus, but {theirs} "
                              f"gave the weights their ids: set data.tokenizer={carried}")
        data_tok, _ = load_tokenizer(d.tokenizer)
        diff = vocab_difference(data_tok, model_tok)
        if diff:
            raise ConfigError(f"data.tokenizer: {d.tokenizer} is not {theirs}: {diff}; leave data.tokenizer unset to "
                              "train with that one, or start from weights trained with yours")
        return
    for key in ("blend", "val_blend"):
        for i, s in enumerate(getattr(d, key)):
            own = Path(s.path).expanduser() / "tokenizer"
            if not own.is_dir():
                continue
            data_tok, _ = load_tokenizer(str(own))
            diff = vocab_difference(data_tok, model_tok)
            if diff:
                raise ConfigError(f"data.{key}[{i}]: {s.path} was tokenized with {own}, which is not {theirs}: {diff}; "
                                  f"prepare it again with python -m tools.prepare_data --tokenizer {carried}")


def _overlap_note(p, pipe) -> str:
    if pipe is not None and pipe.overlap:
        return " (F&B overlap on)"
    return " (F&B overlap off" + (": ep = 1, no expert all-to-all to hide)" if p.overlap else ")")


def graph_note(trainer) -> str:
    """On CUDA: whether the forward and backward replay from a CUDA graph (``train.cuda_graph``), or why not."""
    t = trainer.cfg.train
    if trainer.device.type != "cuda":
        return ""
    if trainer.graphed is not None:
        return f"; forward and backward replayed from a CUDA graph after {WARMUP} eager steps"
    why = why_eager(t.cuda_graph, trainer.device, trainer.dims.world_size, trainer.precision.weights, t.recompute)
    return f"; eager steps, no CUDA graph ({why})"


def startup_lines(trainer) -> list[str]:
    """What a cluster log needs first: run dir and resolved config, layout, parameter counts, data. Rank 0
    also writes the resolved config and the tokenizer (``<run dir>/tokenizer/``) into the run dir (they travel
    with it)."""
    from models.params import count_params
    c, d, p, run_dir = trainer.cfg, trainer.dims, trainer.cfg.parallel, trainer.run_dir
    if d.is_main:
        with run_dir_writing(run_dir / "config.yaml", "the resolved config"):
            (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(c)))
        if trainer.tokenizer_files:
            with run_dir_writing(run_dir / "tokenizer", "the tokenizer"):
                (run_dir / "tokenizer").mkdir(exist_ok=True)
                for name, data in trainer.tokenizer_files.items():
                    (run_dir / "tokenizer" / name).write_bytes(data)
    n = count_params(models.build(c.model, device="meta"))
    lines = [f"run dir {run_dir} (resolved config: {run_dir / 'config.yaml'})",
             f"layout: {d.world_size} rank(s) = pp {d.pp} x dp {d.dp} (ep {d.ep}, expert-dp {d.edp}); schedule "
             f"{p.schedule}{_overlap_note(p, trainer.pipe) if d.pp > 1 else ''}; zero {p.zero}; precision {c.train.precision}; "
             f"device {trainer.device}{graph_note(trainer)}",
             f"model: {n.total / 1e6:,.1f}M parameters, {n.activated / 1e6:,.1f}M activated per token, MTP "
             f"{n.mtp / 1e6:,.1f}M; {c.model.n_layers} layers, {c.model.n_routed_experts} routed experts"]
    if d.ep > 1:
        lines.append(routing_line(c.model, d, p.ep_dispatcher))
    if c.train.precision == "fp8":
        lines.append(fp8_engines_line(trainer.device))
    if trainer.corpus is not None:
        lines.append(trainer.corpus.summary(c.data.path or "embedded corpus (CPython's pydoc topics)"))
    else:
        b = trainer.batches
        lines.append("data: blend of " + ", ".join(
            f"{name} ({src.num_tokens:,} tokens, weight {w:g})" for name, src, w in zip(b.names, b.sources, b.weights))
            + (f"; validation: {', '.join(trainer.val_sources)}" if trainer.val_sources else "; no validation"))
    return lines


def routing_line(m, d: ParallelDims, dispatcher: str) -> str:
    """How the model's routing groups lie on the EP group's nodes, and the bound node-limited routing gives."""
    G, nodes = m.n_expert_groups, d.ep_nodes
    M, N = d.routing_reach(m)
    where = f"{G // nodes} per node" if G >= nodes else f"each spans {nodes // G} nodes"
    return (f"routing: {G} expert groups on {nodes} EP node(s) ({where}), dispatcher {dispatcher}; each token "
            f"reaches <= {M} groups = <= {N} node(s)")


def fp8_engines_line(device: torch.device) -> str:
    """Which FP8 engines run each op here (``kernels.get_ops("auto")``; on a GPU this runs their self-checks)."""
    import kernels
    ops = kernels.get_ops("auto", device)
    if hasattr(ops, "summary"):
        return ops.summary()
    return f"fp8 engines on {device.type}: emulation (kernels/reference.py: plain torch, FP32 matmuls)"


def open_logger(trainer) -> MetricsLogger:
    """The run's MetricsLogger, with the start-up lines, the memory lines, the start-up notes and the resume
    line already written."""
    cfg = trainer.cfg
    logger = MetricsLogger(trainer.run_dir, cfg.logging.wandb, OmegaConf.to_container(OmegaConf.structured(cfg)),
                           cfg.train.max_steps, trainer.step, cfg.logging.progress, is_main=trainer.dims.is_main,
                           device=trainer.device, world_size=trainer.dims.world_size,
                           run_id=saved_run_id(trainer.resumed_from), log_every=cfg.logging.log_every)
    for line in [*startup_lines(trainer), trainer.memory_note, trainer.memory.line(), *trainer.notes]:
        if line:
            logger.write(line)
    if trainer.resumed_from:
        logger.write(f"resumed from {trainer.resumed_from} at step {trainer.step}")
        if getattr(trainer, "config_changes", None):
            logger.write(trainer.config_changes)
    return logger
