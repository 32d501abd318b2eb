"""Export of our ``DeepSeekV3`` to a Hugging Face DeepseekV3 directory (the key table, config mapping and
import are in ``models/hf.py``). ``to_hf`` writes everything from one process; ``save_hf_shard`` writes one
rank's tensors and ``write_hf_index`` ties the ranks' files together once; both write ``config.json`` and
``generation_config.json`` and, given a tokenizer, its files, with ``bos/eos/pad`` ids taken from it.
"""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Collection, Iterable

import torch
from safetensors.torch import save_file

from .config import ModelError, ModelConfig
from .hf import INDEX, _MTP_HEAD, _ROUTED, _header, _hf_items
from .hf_config import config_to_hf
from .transformer import DeepSeekV3, build


def to_hf(model: DeepSeekV3, out_dir: str | os.PathLike, max_shard_bytes: int = 5 * 2**30, *,
          tokenizer=None) -> Path:
    """Write ``config.json``, ``generation_config.json`` and safetensors (in the model's dtype) that
    ``from_pretrained`` loads cleanly, plus the tokenizer's files when one is given (see ``write_hf_metadata``).

    Above ``max_shard_bytes`` the weights are split into ``model-0000i-of-0000n.safetensors`` + index.
    MTP modules go where the module docstring says. Returns the output directory.
    """
    _check_tokenizer(tokenizer, model.cfg)   # before writing anything
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("*.safetensors")):
        raise FileExistsError(f"{out}: already holds *.safetensors; export into an empty directory")
    main, side = _split_mtp(model.cfg, _export_items(model))
    _write_shards(out, main, max_shard_bytes)
    if side:
        save_file(_cpu_copies(side), str(out / "mtp.safetensors"), metadata={"format": "pt"})
    write_hf_metadata(out, model.cfg, model.embed.weight.dtype, tokenizer)
    return out


def save_hf_shard(model: DeepSeekV3, out_dir: str | os.PathLike, rank: int, *,
                  expert_range: tuple[int, int] | None = None, replicated: bool = True,
                  exclude: Collection[str] = ()) -> dict[str, str]:
    """Write this rank's tensors to ``model-rank{rank:05d}.safetensors`` (MTP tensors that ``from_pretrained``
    would warn about to ``mtp-rank{rank:05d}.safetensors``); returns ``{HF key: file name}`` for
    ``write_hf_index``. Nothing is gathered: peak memory is one CPU copy of this rank's tensors.

    ``model`` may be pruned and expert-sliced as for ``load_hf_into`` (same ``expert_range`` rule). Every
    tensor must be written by exactly one rank: routed experts always (each rank holds its own), the
    replicated rest only where ``replicated`` is True (e.g. ``ep_rank == 0`` on ``dp_rank == 0`` of each
    pipeline rank); ``exclude`` drops our state-dict names, e.g. ``{"embed.weight"}`` on a last pipeline
    stage that holds a tied copy of stage 0's embedding.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    items = _export_items(model, expert_range, exclude)
    main, side = _split_mtp(model.cfg, [(k, t) for k, t in items if replicated or _ROUTED.search(k)])
    names = {}
    for prefix, part in (("model", main), ("mtp", side)):
        if part:
            name = f"{prefix}-rank{rank:05d}.safetensors"
            if (out / name).exists():
                raise FileExistsError(f"{out / name} exists; export into an empty directory")
            save_file(_cpu_copies(part), str(out / name), metadata={"format": "pt"})
            names.update(dict.fromkeys((k for k, _ in part), name))
    return names


def write_hf_index(out_dir: str | os.PathLike, weight_maps: Iterable[dict[str, str]], cfg: ModelConfig, *,
                   tokenizer=None) -> Path:
    """Tie the files of ``save_hf_shard`` together: merge the ranks' maps (e.g. from an ``all_gather_object``),
    check that every tensor of ``cfg`` was written exactly once, write ``model.safetensors.index.json``
    (side files left out, see the module docstring), ``config.json`` (dtype read from the shards),
    ``generation_config.json`` and the tokenizer. Call it on one rank after every rank has written."""
    _check_tokenizer(tokenizer, cfg)
    out = Path(out_dir)
    merged: dict[str, str] = {}
    for part in weight_maps:
        for key, file in part.items():
            if merged.setdefault(key, file) != file:
                raise ModelError(f"{key} was written to both {merged[key]} and {file}: each tensor must come from "
                                  "one rank (save_hf_shard(replicated=False) or exclude= on the others)")
    expected = set(_export_keys(cfg))
    missing, extra = sorted(expected - set(merged)), sorted(set(merged) - expected)
    if missing or extra:
        raise ModelError(f"{out}: the shards do not hold the model of this config: missing {missing[:3]} "
                          f"({len(missing)}), unexpected {extra[:3]} ({len(extra)}); every rank must call "
                          "save_hf_shard (with its experts and stages) before write_hf_index")
    headers = {}
    for file in sorted(set(merged.values())):
        if not (out / file).is_file():
            raise FileNotFoundError(f"{out / file}: named by a rank's weight map but not written")
        headers[file] = _header(out / file)
    indexed = {k: f for k, f in sorted(merged.items()) if not f.startswith("mtp")}
    total = sum(headers[f][k]["data_offsets"][1] - headers[f][k]["data_offsets"][0] for k, f in indexed.items())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": indexed}, indent=2))
    dtypes = Counter(h["dtype"] for f in headers for k, h in headers[f].items() if "e_score_correction" not in k)
    write_hf_metadata(out, cfg, _DTYPES[dtypes.most_common(1)[0][0]], tokenizer)
    return out


_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def write_hf_metadata(out_dir: str | os.PathLike, cfg: ModelConfig, dtype: torch.dtype, tokenizer=None) -> dict:
    """``config.json`` + ``generation_config.json``, and the tokenizer's files via its ``save_pretrained``.

    ``tokenizer``: a loaded ``transformers`` tokenizer whose ``eos_token`` is the end-of-text token the model
    was trained with (``tools.convert_hf.load_tokenizer`` finds it as the trainer does). ``bos_token_id``,
    ``eos_token_id`` and ``pad_token_id`` in ``config.json`` are the tokenizer's (None when it has none, and
    all None without a tokenizer); ``generation_config.json`` pads with EOS when the tokenizer has no pad
    token (config.json keeps None there: HF uses it as the embedding's padding_idx, whose row gets no
    gradient). Returns the three ids.
    """
    from transformers import GenerationConfig

    out = Path(out_dir)
    ids = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    _check_tokenizer(tokenizer, cfg)
    if tokenizer is not None:
        ids = {k: getattr(tokenizer, k) for k in ids}
        tokenizer.save_pretrained(str(out))
    hf_cfg = config_to_hf(cfg)
    hf_cfg.dtype = dtype
    for k, v in ids.items():
        setattr(hf_cfg, k, v)
    hf_cfg.save_pretrained(str(out))
    pad = ids["eos_token_id"] if ids["pad_token_id"] is None else ids["pad_token_id"]
    GenerationConfig(bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"],
                     pad_token_id=pad).save_pretrained(str(out))
    return ids


def _check_tokenizer(tokenizer, cfg: ModelConfig) -> None:
    if tokenizer is None:
        return
    if len(tokenizer) > cfg.vocab_size:
        raise ModelError(f"tokenizer has {len(tokenizer)} tokens, more than model.vocab_size ({cfg.vocab_size})")
    if tokenizer.eos_token_id is None:
        raise ModelError("tokenizer defines no eos_token: set it (tokenizer.eos_token = ...) before export")


def _export_items(model: DeepSeekV3, expert_range=None, exclude: Collection[str] = ()) -> list:
    """``(HF key, tensor)`` to write: the model's tensors plus, on a model holding the head, the MTP
    modules' ``shared_head.head`` copies of it."""
    items = [(key, t) for key, name, t in _hf_items(model, expert_range) if name not in exclude]
    if model.head is not None and "head.weight" not in exclude:
        n = model.cfg.n_layers
        items += [(f"model.layers.{n + k}.{_MTP_HEAD}", model.head.weight) for k in range(len(model.mtp))]
    return items


def _export_keys(cfg: ModelConfig) -> list[str]:
    return [key for key, _ in _export_items(build(cfg, "meta"))]


def _split_mtp(cfg: ModelConfig, items: list) -> tuple[list, list]:
    """``(main, side)``: MTP tensors go to the side file unless ``from_pretrained`` skips them silently."""
    main, side = [], []
    ignored = re.compile("(?!)")
    if cfg.mtp_depth:   # the checkpoint keys from_pretrained skips without a warning
        from transformers import DeepseekV3ForCausalLM
        patterns = DeepseekV3ForCausalLM._keys_to_ignore_on_load_unexpected or ["(?!)"]
        ignored = re.compile("|".join(f"({p})" for p in patterns))
    for key, t in items:
        layer = re.match(r"model\.layers\.(\d+)\.", key)
        is_mtp = layer is not None and int(layer[1]) >= cfg.n_layers
        (side if is_mtp and not ignored.search(key) else main).append((key, t))
    return main, side


def _cpu_copies(items) -> dict[str, torch.Tensor]:
    # own storage per tensor: safetensors refuses tensors that share memory (expert slices, the head copy)
    return {k: t.detach().to("cpu", copy=True).contiguous() for k, t in items}


def _write_shards(out: Path, items: list, max_shard_bytes: int) -> None:
    shards, size = [[]], 0
    for key, t in items:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, t))
        size += nbytes
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    for name, shard in zip(names, shards):
        save_file(_cpu_copies(shard), str(out / name), metadata={"format": "pt"})
    if len(shards) > 1:
        weight_map = {key: name for name, shard in zip(names, shards) for key, _ in shard}
        total = sum(t.numel() * t.element_size() for _, t in items)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2))
