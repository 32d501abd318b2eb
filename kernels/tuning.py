"""Launch configurations measured fastest per device: the Triton GEMMs' tuning table.

``python -m bench.fp8_tune --out FILE.json`` times a grid of tile shapes, warps and pipeline depths for each
Triton GEMM (``gemm``, ``grouped_gemm``, ``grouped_wgrad``) on the shapes DeepSeek-V3 models run, on the GPU it
runs on, and writes the fastest right one per kernel. Such files live in ``kernels/tuning/``, one per device
model, named by ``slug(device name)``; ``DSV3_FP8_TUNING=FILE.json`` uses that file instead (a tuning run
measuring its own table). A tuned configuration is only a preference: ``gemm.default_variant`` self-checks it
on the device like every other launch variant, and falls back to the built-in ones when it is wrong.

File format (JSON): ``{"device": <torch.cuda.get_device_name>, "triton": <version>, "configs": {kernel:
{"BLOCK_M": .., "BLOCK_N": .., "num_warps": .., "num_stages": .., ["GROUP_M": ..]}}, ...}``; other keys (the
measurements behind the choice) are kept for the reader and ignored here.
"""
from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import torch

TABLE_DIR = Path(__file__).parent / "tuning"
ENV = "DSV3_FP8_TUNING"
KERNELS = ("gemm", "grouped_gemm", "grouped_wgrad")
KEYS = ("BLOCK_M", "BLOCK_N", "GROUP_M", "num_warps", "num_stages")


def slug(device_name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``: the table's file name."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


@functools.lru_cache(maxsize=None)
def _load(path: str) -> dict:
    data = json.loads(Path(path).read_text())
    configs = data.get("configs", {})
    for kernel, cfg in configs.items():
        unknown = set(cfg) - set(KEYS)
        if kernel not in KERNELS or unknown:
            raise ValueError(f"{path}: tuning entry {kernel!r} {cfg}: kernels are {KERNELS}, keys {KEYS}")
    return data


def table_path(device_name: str) -> Path | None:
    """The tuning file for ``device_name``: ``$DSV3_FP8_TUNING`` if set, else ``kernels/tuning/<slug>.json``
    if it exists, else None."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    path = TABLE_DIR / f"{slug(device_name)}.json"
    return path if path.is_file() else None


def tuned(kernel: str, device: torch.device | str) -> dict | None:
    """The tuned launch config of ``kernel`` on ``device`` (a CUDA device), or None when there is none."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    cfg = _tuned(kernel, index, os.environ.get(ENV, ""))
    return dict(cfg) if cfg else None


@functools.lru_cache(maxsize=None)
def _tuned(kernel: str, index: int, env: str) -> dict | None:     # per call of a GEMM: no file system access
    path = table_path(torch.cuda.get_device_name(index))
    return None if path is None else _load(str(path)).get("configs", {}).get(kernel)
