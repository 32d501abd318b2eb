"""Tune the Triton FP8 GEMMs on this GPU: time a grid of launch configs per kernel, write the tuning table.

    python -m bench.fp8_tune --out kernels/tuning/$(slug).json [--deadline-s 200] [--kernels gemm,grouped_gemm]

For each kernel (``gemm``, ``grouped_gemm``, ``grouped_wgrad``) and each of its ``candidates`` (tile shape,
warps, pipeline depth, and for the grouped Fprop/Dgrad the program order; TMA loads, no warp specialisation),
every case of ``CASES`` (the routed-expert GEMMs of
``v3_small`` and of DeepSeek-V3 at 32 local experts, Fprop and Dgrad; two dense shapes) is run once against
``kernels.reference`` (relative error <= ``selfcheck.GEMM_TOL``, else the config is out) and timed
(``triton.testing.do_bench``, median, L2 flushed). A config's score is the geometric mean over the kernel's
cases of (built-in config's time / its time); the table keeps, per kernel, the best-scoring config that was
right on every case (the built-in one when nothing beats it). The JSON also holds every measurement.
``kernels/tuning.py`` reads the table; the kernels self-check a tuned config before using it.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from bench.common import print_table, require_cuda

# (BLOCK_M, BLOCK_N, num_warps, num_stages); the first is the built-in config (gemm.VARIANTS["tma"]).
CONFIGS = [(128, 128, 8, 4), (128, 128, 8, 3), (128, 128, 8, 5), (128, 128, 4, 4), (64, 128, 4, 4),
           (64, 128, 4, 6), (64, 256, 4, 4), (128, 256, 8, 3), (128, 256, 8, 4), (256, 128, 8, 3),
           (128, 64, 4, 4), (64, 64, 4, 6)]
# The grouped Fprop/Dgrad's program orders beside its built-in one (``GROUP_M`` 0, ``gemm.tile_order``): GROUP_M
# row tiles at a time over every column tile, for the tiles most likely to win.
GROUPED_ORDERS = [c + (g,) for c in [(64, 128, 4, 4), (128, 128, 8, 4), (128, 256, 8, 3)] for g in (8, 16)]
# kernel -> cases: (label, shape); grouped: (E, R, N, K, pass), dense: (M, N, K)
CASES = {
    "grouped_gemm": [("v3_small w13 fprop", (64, 65536, 1536, 1024, "fprop")),
                     ("v3_small w2 fprop", (64, 65536, 1024, 768, "fprop")),
                     ("v3_small w13 dgrad", (64, 65536, 1536, 1024, "dgrad")),
                     ("V3 E32 w13 fprop", (32, 32768, 4096, 7168, "fprop")),
                     ("V3 E32 w2 fprop", (32, 32768, 7168, 2048, "fprop")),
                     ("V3 E32 w13 dgrad", (32, 32768, 4096, 7168, "dgrad"))],
    "grouped_wgrad": [("v3_small w13", (64, 65536, 1536, 1024, "wgrad")),
                      ("v3_small w2", (64, 65536, 1024, 768, "wgrad")),
                      ("V3 E32 w13", (32, 32768, 4096, 7168, "wgrad")),
                      ("V3 E32 w2", (32, 32768, 7168, 2048, "wgrad"))],
    "gemm": [("v3_small 8192x4096x1024", (8192, 4096, 1024)), ("v3_small 8192x1024x4096", (8192, 1024, 4096)),
             ("16384x7168x7168", (16384, 7168, 7168))],
}


def candidates(kernel: str) -> list[tuple]:
    """The configs timed for ``kernel``, the built-in one first: ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``,
    or with ``GROUP_M`` fifth (``GROUPED_ORDERS``, next: the deadline cuts the list's tail)."""
    return [CONFIGS[0], *GROUPED_ORDERS, *CONFIGS[1:]] if kernel == "grouped_gemm" else CONFIGS


def config_dict(kernel: str, c: tuple) -> dict:
    cfg = {"BLOCK_M": c[0], "BLOCK_N": c[1], "num_warps": c[2], "num_stages": c[3]}
    if len(c) > 4:
        return cfg | {"GROUP_M": c[4]}
    return cfg | ({"GROUP_M": 8} if kernel == "gemm" else {})


def build_case(kernel: str, shape: tuple):
    """-> (run(config) -> output, reference output, FLOPs) on fresh random operands."""
    from bench.fp8_grouped_gemm import ragged_counts
    from kernels import gemm as dg
    from kernels import grouped_gemm as gg
    from kernels import quant
    from kernels import reference as ref
    dev = torch.device("cuda")
    torch.manual_seed(0)
    if kernel == "gemm":
        M, N, K = shape
        a, sa = quant.quant_act(torch.randn(M, K, device=dev, dtype=torch.bfloat16))
        b, sb = quant.quant_weight(torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02)[:2]
        return (lambda cfg: dg.gemm(a, sa, b, sb, torch.bfloat16, config=cfg)), ref.gemm(a, sa, b, sb), 2.0 * M * N * K
    E, R, N, K, pas = shape
    tpe = ragged_counts(R, E).to(dev)
    x = torch.randn(R, K, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(R, N, device=dev, dtype=torch.bfloat16)
    flop = 2.0 * R * N * K
    if pas == "wgrad":
        (g, gs), (xt, xs) = quant.quant_act_t(dy, tpe), quant.quant_act_t(x, tpe)
        return ((lambda cfg: gg.grouped_wgrad(g, gs, xt, xs, tpe, config=cfg)),
                ref.grouped_wgrad(g, gs, xt, xs, tpe), flop)
    wq, ws, wq_t = quant.quant_weight(torch.randn(E, N, K, device=dev, dtype=torch.bfloat16) * 0.02, transpose=True)
    if pas == "fprop":
        a, sa = quant.quant_act(x)
        return (lambda cfg: gg.grouped_gemm(a, sa, wq, ws, tpe, config=cfg)), ref.grouped_gemm(a, sa, wq, ws, tpe), flop
    a, sa = quant.quant_act(dy)
    return ((lambda cfg: gg.grouped_gemm(a, sa, wq_t, ws.mT, tpe, config=cfg)),
            ref.grouped_gemm(a, sa, wq_t, ws.mT, tpe), flop)


def measure(kernel: str, deadline: float) -> list[dict]:
    """One row per (case, config): ``ms`` (None when it failed or was wrong), ``err``, ``why``."""
    import triton.testing

    from kernels import selfcheck
    rows = []
    for label, shape in CASES[kernel]:
        run, want, flop = build_case(kernel, shape)
        for i, c in enumerate(candidates(kernel)):
            if i and time.monotonic() > deadline:
                rows.append({"case": label, "config": c, "ms": None, "err": None, "why": "not run: time budget"})
                continue
            cfg = {"TMA": True, "WARP_SPECIALIZE": False, **config_dict(kernel, c)}
            row = {"case": label, "config": c, "flop": flop, "ms": None, "err": None, "why": ""}
            try:
                row["err"] = selfcheck.rel_err(run(cfg), want)
                if not row["err"] <= selfcheck.GEMM_TOL:
                    row["why"] = f"wrong: relative error {row['err']:.1e}"
                else:
                    row["ms"] = triton.testing.do_bench(lambda: run(cfg), warmup=5, rep=25, return_mode="median")
            except Exception as e:  # noqa: BLE001 - a config that does not compile or run is out
                row["why"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:100] if str(e).strip() else ''}"
            rows.append(row)
            print(f"  {kernel} {label} {c}: " + (f"{flop / row['ms'] / 1e9:.0f} TFLOP/s" if row["ms"] else row["why"]),
                  flush=True)
        del run, want
        torch.cuda.empty_cache()
    return rows


def best(rows: list[dict], configs: list[tuple]) -> tuple[tuple, dict[tuple, float]]:
    """(best config, {config: score}) where score = geometric mean over cases of built-in (``configs[0]``) ms /
    config ms; only configs measured on every case."""
    cases = sorted({r["case"] for r in rows})
    ms = {(r["case"], r["config"]): r["ms"] for r in rows}
    scores = {}
    for c in configs:
        if all(ms.get((case, c)) and ms.get((case, configs[0])) for case in cases):
            scores[c] = math.exp(sum(math.log(ms[(case, configs[0])] / ms[(case, c)]) for case in cases) / len(cases))
    return (max(scores, key=scores.get) if scores else configs[0]), scores


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the tuning table (JSON) to write")
    p.add_argument("--kernels", default=",".join(CASES), help="comma list of " + ",".join(CASES))
    p.add_argument("--deadline-s", type=float, default=240.0, help="stop trying new configs after this many seconds")
    args = p.parse_args()
    require_cuda()
    import triton

    import kernels
    from kernels.tuning import slug
    kernels.configure()
    t0 = time.monotonic()
    kinds = args.kernels.split(",")
    name = torch.cuda.get_device_name()
    table = {"device": name, "triton": triton.__version__, "torch": torch.__version__,
             "command": "python -m bench.fp8_tune " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
             "configs": {}, "scores": {}, "measured": {}}
    for i, kernel in enumerate(kinds):
        share = t0 + (args.deadline_s * (i + 1) / len(kinds))     # each kernel its share of the time
        rows = measure(kernel, share)
        choice, scores = best(rows, candidates(kernel))
        table["configs"][kernel] = config_dict(kernel, choice)
        table["scores"][kernel] = {"x".join(map(str, c)): round(s, 3) for c, s in scores.items()}
        table["measured"][kernel] = [{**r, "config": "x".join(map(str, r["config"])),
                                      "tflops": r["ms"] and round(r["flop"] / r["ms"] / 1e9)} for r in rows]
        print(f"{kernel}: best {choice} (x{scores.get(choice, 1.0):.3f} vs built-in {CONFIGS[0]})", flush=True)
        print_table(["config (BM, BN, warps, stages)", "score vs built-in"],
                    [["x".join(map(str, c)), f"{s:.3f}"] for c, s in sorted(scores.items(), key=lambda kv: -kv[1])])
    Path(args.out).write_text(json.dumps(table, indent=1) + "\n")
    print(f"tuning table for {name} ({slug(name)}.json): {args.out} in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
