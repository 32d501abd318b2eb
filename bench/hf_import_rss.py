"""Peak host memory of a sharded, streaming HF import (``models.hf.load_hf_into``), one process per rank.

    python -m bench.hf_import_rss --dir /tmp/dsv3-hf-rss --world 4 [--fp8] [--experts 64 --dim 512 --moe-inter 512]

Writes a synthetic HF DeepseekV3 checkpoint (random weights, split over ``--files`` safetensors files with an
index; ``--fp8``: the release's layout, float8_e4m3fn linear weights + float32 ``weight_scale_inv`` per 128x128
block) whose routed experts dominate, then starts ``--world`` processes at once. Each builds the model on
meta, keeps its ``1/world`` of every layer's experts (as ``apply_ep`` does: ``[E/world, ...]`` tensors and
``expert_offset``), materialises it (``to_empty``: untouched pages, not yet resident), takes its baseline
(VmRSS after resetting the peak with ``/proc/self/clear_refs``), calls ``load_hf_into`` and reads the peak
(VmHWM, what ``ru_maxrss`` reports). ``growth = peak - baseline`` is compared with the bytes the rank holds
(``shard``: its state dict). A ``world=1`` process (the full model) runs last for comparison.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
# the linear weights DeepSeek-V3's release stores as FP8 (embedding, lm_head, router gate, norms and the
# balancing bias stay bf16 / fp32)
QUANTISED = re.compile(r"(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)"
                       r"\.weight$")


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """The release's format: ``(float8_e4m3fn weight, float32 scale_inv [ceil(rows/br), ceil(cols/bc)])`` with
    ``weight * scale_inv`` (per block) approximating ``w``; scale = block amax / 448."""
    (rows, cols), (br, bc) = w.shape, block
    R, C = -(-rows // br), -(-cols // bc)
    tiles = F.pad(w.float(), (0, C * bc - cols, 0, R * br - rows)).view(R, br, C, bc)
    scale = (tiles.abs().amax((1, 3)) / 448).clamp(min=1e-12)
    q = (tiles / scale[:, None, :, None]).view(R * br, C * bc)[:rows, :cols].to(torch.float8_e4m3fn)
    return q, scale


def write_hf_checkpoint(tensors, hf_config, out: Path, n_files: int = 3, fp8: bool = False,
                        block: tuple[int, int] = (128, 128)) -> dict[str, torch.Tensor]:
    """Write ``tensors`` (HF key -> tensor, or -> a zero-argument function making it) as ``n_files``
    safetensors files of about equal size plus ``model.safetensors.index.json`` and ``config.json``.
    ``fp8``: linear weights quantised as in the release, ``quantization_config`` added. Returns, for each
    quantised key, its dequantised value (what an import must produce)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    sizes = {k: math.prod(_shape(t)) for k, t in tensors.items()}
    total, files, acc = sum(sizes.values()), [[] for _ in range(n_files)], 0
    for key in tensors:   # contiguous runs of keys, as save_pretrained writes them
        files[min(n_files - 1, int(acc * n_files / total))].append(key)
        acc += sizes[key]
    weight_map, expected = {}, {}
    for i, keys in enumerate(files, start=1):
        name = f"model-{i:05d}-of-{n_files:05d}.safetensors"
        part = {}
        for key in keys:
            t = tensors[key]() if callable(tensors[key]) else tensors[key]
            if fp8 and QUANTISED.search(key):
                q, s = quantize_fp8(t, block)
                part[key], part[key + "_scale_inv"] = q, s
                expected[key] = q.float() * s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[
                    :t.shape[0], :t.shape[1]]
            else:
                part[key] = t.contiguous()
        save_file(part, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
        del part
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    hf_config.save_pretrained(str(out))
    if fp8:
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "weight_block_size": list(block)}
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return expected


def _shape(t):
    return t.shape if isinstance(t, torch.Tensor) else t.shape_hint


class _Random:
    """A lazily generated random tensor (the checkpoint is written file by file, never whole in memory)."""

    def __init__(self, shape, seed: int, std: float = 0.02):
        self.shape_hint, self.seed, self.std = tuple(shape), seed, std

    def __call__(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        return torch.randn(self.shape_hint, generator=g) * self.std


def synthetic_checkpoint(out: Path, *, experts: int = 64, dim: int = 512, moe_inter: int = 512, layers: int = 2,
                         vocab: int = 1024, n_files: int = 3, fp8: bool = False) -> None:
    """An HF checkpoint of a model whose routed experts dominate (fp32, or FP8 linears)."""
    from models import ModelConfig, build
    from models.hf import hf_state_dict
    from models.hf_config import config_to_hf

    cfg = ModelConfig(vocab_size=vocab, dim=dim, n_layers=layers, first_k_dense=0, inter_dim=2 * dim, n_heads=4,
                      q_lora_rank=0, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                      moe_inter_dim=moe_inter, n_routed_experts=experts, n_shared_experts=1, n_activated_experts=4,
                      n_expert_groups=4, n_limited_groups=2, route_scale=2.5, mtp_depth=0)
    meta = hf_state_dict(build(cfg, "meta"))
    tensors = {k: _Random(t.shape, i) for i, (k, t) in enumerate(meta.items())}
    write_hf_checkpoint(tensors, config_to_hf(cfg), out, n_files=n_files, fp8=fp8)


def slice_experts(model, start: int, n_local: int):
    """Keep experts ``[start, start + n_local)`` of every MoE layer, as ``parallel.ep.apply_ep`` does (without
    its dispatcher, which needs process groups). Works on a meta model."""
    from models.moe import GroupedExperts

    for experts in (m for m in model.modules() if isinstance(m, GroupedExperts)):
        for w in ("w13", "w2"):
            full = getattr(experts, w)
            setattr(experts, w, torch.nn.Parameter(full.detach()[start:start + n_local].clone()))
        experts.expert_offset = start
    return model


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def child(hf_dir: str, rank: int, world: int) -> dict:
    """One rank: build, baseline, ``load_hf_into``, peak. Returns the row (bytes)."""
    import gc
    import resource

    from models import build
    from models.hf import config_from_hf_dir, load_hf_into

    torch.set_num_threads(1)
    cfg = config_from_hf_dir(hf_dir)
    n_local = cfg.n_routed_experts // world
    model = slice_experts(build(cfg, "meta"), rank * n_local, n_local).to_empty(device="cpu")
    shard = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    gc.collect()
    try:   # "5": reset the peak (VmHWM) to the current RSS (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        method = "VmHWM after clear_refs"
    except OSError:
        method = "ru_maxrss (peak since start: conservative)"
    base = _status("VmRSS")
    stats = load_hf_into(model, hf_dir)
    peak = max(_status("VmHWM"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
               if method.startswith("ru_") else 0)
    return dict(rank=rank, world=world, shard=shard, base=base, peak=peak, growth=peak - base, read=stats["bytes"],
                tensors=stats["tensors"], seconds=round(stats["seconds"], 2), method=method)


def measure(hf_dir: Path, world: int, timeout: float = 600) -> list[dict]:
    """Start ``world`` rank processes at once; their rows, by rank."""
    procs = [subprocess.Popen([sys.executable, "-m", "bench.hf_import_rss", "--child", str(hf_dir), str(r),
                               str(world)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
             for r in range(world)]
    rows = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        if p.returncode:
            raise RuntimeError(f"rank process failed ({p.returncode}): {err.strip().splitlines()[-1:]}")
        rows.append(json.loads(out.strip().splitlines()[-1]))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs=3, metavar=("HF_DIR", "RANK", "WORLD"), help=argparse.SUPPRESS)
    ap.add_argument("--dir", default="/tmp/dsv3-hf-rss")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--moe-inter", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--files", type=int, default=3)
    ap.add_argument("--fp8", action="store_true")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), int(args.child[2]))))
        return 0
    out = Path(args.dir)
    if not (out / "config.json").exists():
        synthetic_checkpoint(out, experts=args.experts, dim=args.dim, moe_inter=args.moe_inter, layers=args.layers,
                             n_files=args.files, fp8=args.fp8)
    on_disk = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"checkpoint {out}: {on_disk / MiB:,.1f} MiB in {args.files} files{' (FP8)' if args.fp8 else ''}")
    print("world rank  shard MiB  read MiB  peak growth MiB  growth/shard  seconds")
    for rows in (measure(out, args.world), measure(out, 1)):
        for r in rows:
            print(f"{r['world']:5d} {r['rank']:4d} {r['shard'] / MiB:10.1f} {r['read'] / MiB:9.1f} "
                  f"{r['growth'] / MiB:16.1f} {r['growth'] / r['shard']:13.2f} {r['seconds']:8.2f}")
    print(f"(peak: {rows[0]['method']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
