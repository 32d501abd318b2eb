"""Conversion between our ``DeepSeekV3`` and the Hugging Face ``transformers`` DeepseekV3 format.

Weights: one table (``_TOP``/``_BLOCK``/``_MTP``) names every tensor; ``hf_state_dict`` applies it to a model,
export writes what it returns and import copies into it. Block ``i`` is ``model.layers.{i}``:

    attn_norm / ffn_norm           input_layernorm / post_attention_layernorm
    attn.wqkv_a (query rows)       self_attn.q_a_proj (q_proj without q_lora_rank)
    attn.wqkv_a (key/value rows)   self_attn.kv_a_proj_with_mqa
    attn.q_norm, wq_b              self_attn.q_a_layernorm, q_b_proj
    attn.kv_norm, wkv_b, wo        self_attn.kv_a_layernorm, kv_b_proj, o_proj
    ffn.w13 (halves) / w2 (dense)  mlp.gate_proj + up_proj / down_proj (same in shared_experts)
    ffn.gate.weight, expert_bias   mlp.gate.weight, mlp.gate.e_score_correction_bias
    ffn.experts.w13 / w2 [E,..]    mlp.experts.{e}.gate_proj + up_proj / down_proj.weight

Our ``w13`` stacks the gate and up projections (gate rows first, ``models.layers.MLP``) and ``wqkv_a`` the query
and key/value projections of the attention's input (``models.attention.MLA``); the table names their parts along
dim -2 (``_parts``), and every other step works on those parts as views.

HF checkpoints (``save_pretrained``, the Hub) store routed experts one tensor per expert, as above; a
``transformers`` model in memory fuses them (``mlp.experts.gate_up_proj [E,2F,D]``, gate rows first, and
``down_proj [E,D,F]``). Import accepts both, export writes the per-expert form. A model holding a slice of the
experts (after ``apply_ep``: tensors ``[E_local, ...]`` and ``experts.expert_offset``, the global id of local
expert 0) maps local expert ``e`` to HF expert ``expert_offset + e``.

MTP: DeepSeek's release stores MTP module k as ``model.layers.{n_layers + k}``: ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm`` (our ``mtp.k.norm``), ``shared_head.head`` (a copy of ``lm_head``; ours shares the main head,
so it is written on export and skipped on import) and ordinary block weights (our ``mtp.k.block.*``).
``transformers`` builds no MTP module: ``from_pretrained`` silently skips checkpoint keys matching
``DeepseekV3PreTrainedModel._keys_to_ignore_on_load_unexpected`` (``model\\.layers\\.61.*``, the 671B layout;
its ``generate(use_mtp=True)`` drafter reads them from there) and logs a LOAD REPORT warning for any other
unexpected key. So export writes MTP tensors into the main files only when that pattern covers them, else
into ``mtp.safetensors`` (``mtp-rankNNNNN.safetensors`` when sharded), which ``from_pretrained`` never opens
(it reads ``model.safetensors`` or the files its index names). Import reads the files the index names and
every ``*.safetensors`` it does not name.

Import streams (``load_hf_into``), opening the file once per tensor: a ``safe_open`` handle maps the whole file
and every page read through it stays resident until the handle closes. Export: ``models/hf_export.py``.
Recipes: docs/hf.md.

Config: ``models/hf_config.py`` (what our model cannot express raises ``ModelError`` naming the key).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
import time
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from .config import ModelConfig, ModelError
from .hf_config import config_from_hf, mtp_depth_of
from .moe import GroupedExperts
from .transformer import DeepSeekV3, build

# ---- the weight-name table ---------------------------------------------------------------------------
def _prefixed(prefix: str, names: str | tuple[str, ...]) -> str | tuple[str, ...]:
    return tuple(prefix + n for n in names) if isinstance(names, tuple) else prefix + names


_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "head.weight": "lm_head.weight"}
_MLP = {"w13.weight": ("gate_proj.weight", "up_proj.weight"), "w2.weight": "down_proj.weight"}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wqkv_a.weight": ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),   # _parts
    "attn.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"ffn.{k}": _prefixed("mlp.", v) for k, v in _MLP.items()},
    **{f"ffn.shared_experts.{k}": _prefixed("mlp.shared_experts.", v) for k, v in _MLP.items()},
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.expert_bias": "mlp.gate.e_score_correction_bias",
    # stacked [E, ...] on our side, one tensor per expert on theirs
    **{f"ffn.experts.{k.split('.')[0]}": _prefixed("mlp.experts.{e}.", v) for k, v in _MLP.items()},
}
_MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "norm.weight": "shared_head.norm.weight", **{f"block.{k}": v for k, v in _BLOCK.items()}}
_MTP_HEAD = "shared_head.head.weight"
_SKIPPED_ON_IMPORT = re.compile(rf"{re.escape(_MTP_HEAD)}$|rotary_emb\.inv_freq$|_scale_inv$")
_ROUTED = re.compile(r"\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
INDEX = "model.safetensors.index.json"


def hf_key(name: str, n_layers: int) -> str | tuple[str, str]:
    """HF checkpoint key of our state-dict key ``name`` (routed-expert stacks: a template with ``{e}``); for a
    stacked weight (``w13``, ``wqkv_a``) the keys of its parts along dim -2 (``_parts``)."""
    if name in _TOP:
        return _TOP[name]
    top, idx, rest = name.split(".", 2)
    if top == "layers":
        return _prefixed(f"model.layers.{idx}.", _BLOCK[rest])
    if top == "mtp":
        return _prefixed(f"model.layers.{n_layers + int(idx)}.", _MTP[rest])
    raise KeyError(name)


def expert_starts(model: DeepSeekV3, expert_range: tuple[int, int] | None = None) -> dict[str, int]:
    """Global id of local expert 0 for each routed-expert module (by module name).

    After ``apply_ep`` every ``GroupedExperts`` carries ``expert_offset``; ``expert_range = (start, end)``
    names the slice for a model cut some other way (checked against the tensors and any offset).
    """
    n = model.cfg.n_routed_experts
    out = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, GroupedExperts):
            continue
        held, offset = mod.w2.shape[0], mod.expert_offset
        if expert_range is not None:
            start, end = expert_range
            if not 0 <= start < end <= n or end - start != held:
                raise ModelError(f"expert_range={tuple(expert_range)}: {name} holds {held} of model.n_routed_experts"
                                  f" ({n}) experts; pass (start, start + {held}) with start + {held} <= {n}")
            if offset is not None and offset != start:
                raise ModelError(f"expert_range={tuple(expert_range)} but {name}.expert_offset={offset} (set by "
                                  f"apply_ep): leave expert_range unset for a model after apply_ep")
            offset = start
        elif offset is None:
            if held != n:
                raise ModelError(f"{name} holds {held} of model.n_routed_experts ({n}) experts and has no "
                                  f"expert_offset: pass expert_range=(start, start + {held})")
            offset = 0
        out[name] = offset
    return out


def _hf_items(model: DeepSeekV3, expert_range=None) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(HF key, our state-dict name, tensor view)`` for every tensor the model holds."""
    starts = expert_starts(model, expert_range)
    for name, t in model.state_dict().items():
        try:
            key = hf_key(name, model.cfg.n_layers)
        except KeyError:
            raise ModelError(f"model tensor {name} has no Hugging Face name (models/hf.py _BLOCK); convert "
                              "weights before swapping modules (e.g. before apply_fp8)") from None
        for key, t in (_parts(name, key, t, model.cfg) if isinstance(key, tuple) else [(key, t)]):
            if "{e}" in key:
                start = starts[name.rpartition(".")[0]]
                yield from ((key.format(e=start + e), name, t[e]) for e in range(len(t)))
            else:
                yield key, name, t


def _parts(name: str, keys: tuple[str, str], t: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """A stacked tensor's parts along dim -2 under their HF keys: ``wqkv_a``'s query rows (``q_a_proj``, or
    ``q_proj`` without ``q_lora_rank``) and key/value rows; a ``w13``'s gate and up halves."""
    if name.endswith("attn.wqkv_a.weight"):
        if not cfg.q_lora_rank:
            keys = (keys[0].replace(".q_a_proj.", ".q_proj."), keys[1])
        return list(zip(keys, t.split([cfg.q_rows, t.shape[-2] - cfg.q_rows], dim=-2)))
    return list(zip(keys, t.chunk(2, dim=-2)))


def hf_state_dict(model: DeepSeekV3, expert_range: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """Our tensors under their HF checkpoint names (views; routed-expert stacks sliced one per expert, under
    their global ids)."""
    return {key: t for key, _, t in _hf_items(model, expert_range)}


def config_from_hf_dir(path: str | os.PathLike) -> ModelConfig:
    """Our ModelConfig for an HF checkpoint directory: ``config.json``, with ``mtp_depth`` the number of MTP
    modules whose weights the directory holds (``save_pretrained`` of a ``transformers`` model keeps
    ``num_nextn_predict_layers`` but writes no MTP weights). Reads only file headers."""
    return _HFDir(path).config()


def check_config(cfg: ModelConfig, path: str | os.PathLike) -> None:
    """Raise ``ModelError`` naming the key, both values and the fix when a model built from ``cfg`` cannot
    hold the weights in ``path`` as they were trained. ``init_std`` and ``max_seq_len`` touch no weight;
    a smaller ``mtp_depth`` drops the extra MTP modules; ``group_topk`` compares the routing it means."""
    _check_config(cfg, _HFDir(path))


# ---- import ------------------------------------------------------------------------------------------
class _HFDir:
    """An HF checkpoint directory: its config and where each tensor lives (index + unlisted files' headers)."""

    def __init__(self, path: str | os.PathLike):
        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: no such directory")
        if not (root / "config.json").is_file():
            raise FileNotFoundError(f"{root}: no config.json (not a Hugging Face checkpoint directory)")
        from transformers import DeepseekV3Config
        self.root, self.hf_cfg = root, DeepseekV3Config.from_pretrained(str(root))
        self.where: dict[str, Path] = {}
        if (root / INDEX).is_file():
            self.where = {k: root / v for k, v in json.loads((root / INDEX).read_text())["weight_map"].items()}
        listed = set(self.where.values())
        for file in sorted(root.glob("*.safetensors")):
            if file not in listed:      # e.g. our mtp side file; the index wins where both name a key
                for key in _header(file):
                    self.where.setdefault(key, file)
        if not self.where:
            raise FileNotFoundError(f"{root}: no *.safetensors files")
        quant = getattr(self.hf_cfg, "quantization_config", None) or {}
        self.block = tuple(quant.get("weight_block_size") or (128, 128))

    def config(self) -> ModelConfig:
        return config_from_hf(self.hf_cfg, mtp_depth=mtp_depth_of(self.hf_cfg, self.where))

    def file_of(self, key: str, name: str) -> Path:
        file = self.where.get(key)
        if file is None:
            raise ModelError(f"{self.root}: no tensor {key} (our {name}) in "
                              f"{INDEX if (self.root / INDEX).is_file() else 'the *.safetensors files'}; either a "
                              "shard file is missing or the model config does not match config.json (build the "
                              "model from models.hf.config_from_hf_dir)")
        if not file.is_file():
            raise ModelError(f"{self.root / INDEX} maps {key} to {file.name}, which does not exist: copy every "
                              "shard file the index names")
        return file


def _header(file: Path) -> dict:
    """A safetensors file's header (``{key: {dtype, shape, data_offsets}}``), read without mapping the file."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def _check_config(cfg: ModelConfig, src: _HFDir) -> None:
    theirs = src.config()
    for field in dataclasses.fields(ModelConfig):
        key = field.name
        a, b = getattr(cfg, key), getattr(theirs, key)
        if key in ("init_std", "max_seq_len") or (key == "mtp_depth" and a <= b):
            continue
        if key == "group_topk":
            a, b = cfg.effective_group_topk, theirs.effective_group_topk
        if a != b:
            hint = "holds MTP weights for" if key == "mtp_depth" else "gives"
            raise ModelError(f"model.{key}={a!r} but {src.root} {hint} {b!r}: set model.{key}={b!r} (or build "
                              f"the model from models.hf.config_from_hf_dir('{src.root}'))")


@torch.no_grad()
def load_hf_into(model: DeepSeekV3, hf_dir: str | os.PathLike, *, expert_range: tuple[int, int] | None = None,
                 strict: bool = False) -> dict:
    """Fill every tensor in ``model.state_dict()`` from the HF checkpoint directory ``hf_dir``; returns stats.

    ``model`` may be pruned to a rank's pipeline stages (``prune_model``: absent layers, embedding or head are
    simply not read) and hold a slice of the routed experts: after ``apply_ep`` each ``experts.expert_offset``
    says which (leave ``expert_range`` unset); ``expert_range=(start, end)`` names global expert ids
    ``[start, end)`` for a model sliced by other means. Call it on materialised plain tensors (``to_empty``
    after building on meta), before wrapping for ZeRO/FSDP or swapping modules (``apply_fp8``).

    Reads only the tensors needed, one ``safe_open`` per tensor, so peak host memory is the model's own
    tensors plus about one checkpoint tensor. FP8 weights are dequantised with their ``weight_scale_inv``
    blocks. The balancing bias is loaded; the per-expert token counters are zeroed. ``strict``: every tensor
    in the directory must have found a place (a full model; ``from_hf`` uses it).

    Returns ``{"tensors", "bytes", "files", "dequantized", "seconds"}``: checkpoint tensors read (scales
    included), their bytes as stored, files opened, FP8 tensors dequantised. Raises ``ModelError`` naming
    the HF key, file and fix for a config mismatch, a missing tensor or a shape mismatch.
    """
    src = hf_dir if isinstance(hf_dir, _HFDir) else _HFDir(hf_dir)
    _check_config(model.cfg, src)
    t0 = time.perf_counter()
    stats = {"tensors": 0, "bytes": 0, "files": set(), "dequantized": 0}
    plain, fused = [], {}
    for key, name, dst in _hf_items(model, expert_range):
        routed = _ROUTED.search(key)
        if key not in src.where and routed:   # a transformers-fused expert tensor: [E, 2F, D] / [E, D, F]
            base = key[:routed.start()] + ".mlp.experts." + ("down_proj" if routed[2] == "down" else "gate_up_proj")
            if base in src.where:
                fused.setdefault(base, []).append((int(routed[1]), routed[2], name, dst))
                continue
        plain.append((src.file_of(key, name), key, name, dst))
    read = set()
    for file, key, name, dst in sorted(plain, key=lambda p: (str(p[0]), p[1])):
        _read_into(src, file, key, name, dst, stats)
        read.add(key)
    for base, parts in fused.items():
        _read_fused_into(src, base, parts, stats)
        read.add(base)
    if strict:
        unused = sorted(k for k in src.where if k not in read and not _SKIPPED_ON_IMPORT.search(k))
        if unused:
            raise ModelError(f"{src.root}: {len(unused)} tensors have no place in the model, e.g. "
                              f"{unused[:3]} in {src.where[unused[0]].name}: config.json does not describe "
                              "these weights")
    for moe in model.moe_layers():
        moe.tokens_per_expert.zero_()
    return {**stats, "files": len(stats["files"]), "seconds": time.perf_counter() - t0}


def _read_into(src: _HFDir, file: Path, key: str, name: str, dst: torch.Tensor, stats: dict) -> None:
    scale = None
    scale_file = src.where.get(key + "_scale_inv")
    if scale_file is not None:
        with safe_open(scale_file, "pt") as f:
            scale = f.get_tensor(key + "_scale_inv").float().clone()   # small; owns its memory
        _count(stats, scale_file, scale.numel() * 4)
    with safe_open(file, "pt") as f:   # one handle per tensor: its pages leave RSS when it closes
        t = f.get_tensor(key)          # mapped, not yet read
        if tuple(t.shape) != tuple(dst.shape):
            raise ModelError(f"{file}: {key} has shape {tuple(t.shape)}, our {name} needs {tuple(dst.shape)}: "
                              f"the model config does not match {src.root / 'config.json'} (build the model from "
                              "models.hf.config_from_hf_dir)")
        if scale is not None:
            _dequant_into(dst, t, scale, src.block, key, file)
            stats["dequantized"] += 1
        elif t.dtype in _FP8:
            raise ModelError(f"{file}: {key} is {t.dtype} but the checkpoint has no {key}_scale_inv")
        else:
            dst.copy_(t)
        _count(stats, file, t.numel() * t.element_size())
        del t


def _read_fused_into(src: _HFDir, base: str, parts: list, stats: dict) -> None:
    """``parts``: ``(global expert, "gate"|"up"|"down", our name, target)``; reads experts min..max only."""
    file = src.file_of(base, parts[0][2])
    lo, hi = min(p[0] for p in parts), max(p[0] for p in parts) + 1
    with safe_open(file, "pt") as f:
        t = f.get_slice(base)[lo:hi]
        for e, proj, name, dst in parts:
            w = t[e - lo]
            if proj != "down":
                half = w.shape[0] // 2
                w = w[:half] if proj == "gate" else w[half:]
            if tuple(w.shape) != tuple(dst.shape):
                raise ModelError(f"{file}: {base}[{e}] ({proj}) has shape {tuple(w.shape)}, our {name} needs "
                                  f"{tuple(dst.shape)}: the model config does not match config.json")
            dst.copy_(w)
        _count(stats, file, t.numel() * t.element_size())


def _count(stats: dict, file: Path, nbytes: int) -> None:
    stats["tensors"] += 1
    stats["bytes"] += nbytes
    stats["files"].add(file)


def _dequant_into(dst: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                  key: str = "", file: Path | None = None) -> None:
    """``dst = w * scale_inv`` per ``block`` tile, one block row at a time (temporaries: one block row)."""
    (rows, cols), (br, bc) = w.shape, block
    want = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != want:
        raise ModelError(f"{file}: {key}_scale_inv has shape {tuple(scale_inv.shape)}, expected {want} for "
                          f"{tuple(w.shape)} in {br}x{bc} blocks (config.json quantization_config.weight_block_size)")
    for i in range(want[0]):
        s = scale_inv[i].repeat_interleave(bc)[:cols]
        dst[i * br:(i + 1) * br].copy_(w[i * br:(i + 1) * br].float() * s)


def empty_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32, device="cpu") -> DeepSeekV3:
    """A model built on meta and materialised uninitialised on ``device``: parameters in ``dtype``, buffers
    (balancing bias, load counters) fp32. Fill it with ``load_hf_into``."""
    model = build(cfg, "meta")
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model.to_empty(device=device)


def from_hf(path_or_hf_model, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> DeepSeekV3:
    """Our model with the weights of an HF checkpoint directory (``empty_model(config_from_hf_dir(dir))`` filled
    by ``load_hf_into(strict=True)``) or of a ``transformers`` DeepseekV3ForCausalLM; parameters in ``dtype``, the
    balancing bias fp32."""
    if not isinstance(path_or_hf_model, (str, os.PathLike)):
        model = empty_model(config_from_hf(path_or_hf_model.config, mtp_depth=0), dtype, device)
        _copy_in(model, path_or_hf_model.state_dict().items())
        return model
    src = _HFDir(path_or_hf_model)
    model = empty_model(src.config(), dtype, device)
    load_hf_into(model, src, strict=True)
    return model


def _unfuse(key: str, t: torch.Tensor):
    """Split a ``transformers`` in-memory fused expert tensor into the per-expert checkpoint keys."""
    base, _, leaf = key.rpartition(".")
    if base.endswith("mlp.experts") and leaf in ("gate_up_proj", "down_proj"):
        parts = t.chunk(2, dim=1) if leaf == "gate_up_proj" else (t,)
        names = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
        for e in range(t.shape[0]):
            for name, part in zip(names, parts):
                yield f"{base}.{e}.{name}.weight", part[e]
    else:
        yield key, t


@torch.no_grad()
def _copy_in(model: DeepSeekV3, items) -> None:
    """Copy a ``transformers`` model's in-memory state dict into ``model``."""
    targets, unexpected, done = hf_state_dict(model), [], set()
    for key, t in items:
        for key, t in _unfuse(key, t):
            if key in targets:
                if targets[key].shape != t.shape:
                    raise ValueError(f"{key}: shape {tuple(t.shape)}, expected {tuple(targets[key].shape)}")
                targets[key].copy_(t)
                done.add(key)
            elif not _SKIPPED_ON_IMPORT.search(key):
                unexpected.append(key)
    missing = sorted(set(targets) - done)
    if unexpected or missing:
        raise ValueError(f"HF weights do not match the config: missing {missing[:5]} ({len(missing)}), "
                         f"unexpected {unexpected[:5]} ({len(unexpected)})")
    for moe in model.moe_layers():
        moe.tokens_per_expert.zero_()
