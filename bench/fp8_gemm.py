"""Time the dense blockwise FP8 GEMM (Fprop, Dgrad, Wgrad layouts): the ``auto`` backend, the Triton kernel and
torch's blockwise ``scaled_mm`` (cuBLASLt, ``kernels/torch_gemm.py``) against torch BF16 matmul, all in the same
run; reports TFLOP/s, the ratios, the engine ``auto`` chose and each engine's error vs the reference.

    python -m bench.fp8_gemm                       # default shapes (DeepSeek-V3 projections, M = 4096 tokens)
    python -m bench.fp8_gemm --shapes 4096x7168x7168 --config BLOCK_M=128,BLOCK_N=256,num_stages=3

Shapes are MxNxK for Fprop ``y[M,N] = x[M,K]·W[N,K]ᵀ``; Dgrad computes ``dx[M,K] = dy[M,N]·W`` and Wgrad
``dW[N,K] = dyᵀ·x`` (contraction over the M tokens) — 2·M·N·K FLOP each. Every engine is checked against
``kernels.reference.gemm`` (dequantise, FP32 matmul) on fresh random inputs before it is timed; a row whose
engine is off by more than ``ERR_TOL`` fails. torch's blockwise GEMM takes the same block scales (1×128
activations / 128×128 weights for Fprop and Dgrad, 1×128 × 1×128 for Wgrad; sm_90, CUDA >= 12.9).
"""
from __future__ import annotations

import torch

from bench import common
from bench.common import base_parser, fmt, parse_config, parse_shapes, past, print_table, rel_err, require_cuda, try_time

DEFAULT_SHAPES = [
    (4096, 7168, 7168),     # square-ish reference point
    (4096, 2112, 7168),     # MLA wqkv_a (1536 + 576)
    (4096, 24576, 1536),    # MLA wq_b (128 heads x 192)
    (4096, 32768, 512),     # MLA wkv_b (128 heads x (128 + 128))
    (4096, 7168, 16384),    # MLA wo
    (4096, 18432, 7168),    # dense MLP, one half of w13 (gate or up)
    (4096, 7168, 18432),    # dense MLP w2
]
LAYOUTS = ("fprop", "dgrad", "wgrad")
ERR_TOL = 1e-2   # gross-error gate before timing; the tight bounds (1e-3) are the kernel tests'


def operands(M: int, N: int, K: int, pow2: bool = False, seed: int = 0):
    """Fresh random BF16 tensors and their FP8 forms; ``{layout: (gemm args, bf16 baseline fn)}``."""
    import kernels
    kernels.configure()
    from kernels import quant as tq         # the raw kernels (the quantiser bench checks them bit for bit)
    torch.manual_seed(seed)
    dev = common.DEVICE
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    xq, xs = tq.quant_act(x, pow2)
    wq, ws, wq_t = tq.quant_weight(w, pow2, transpose=True)
    dyq, dys = tq.quant_act(dy, pow2)
    dyt, dyts = tq.quant_act_t(dy, None, pow2)
    xt, xts = tq.quant_act_t(x, None, pow2)
    return {
        "fprop": ((xq, xs, wq, ws, torch.bfloat16), lambda: x @ w.t()),
        "dgrad": ((dyq, dys, wq_t, ws.t(), torch.bfloat16), lambda: dy @ w),
        "wgrad": ((dyt, dyts, xt, xts, torch.float32), lambda: dy.t() @ x),
    }


def _engine_row(row: dict, prefix: str, fn, want: torch.Tensor) -> None:
    """``row[prefix + "_err"]`` vs ``want``, then ``row[prefix + "_ms"]`` if it is right (or why not)."""
    try:
        row[f"{prefix}_err"] = rel_err(fn(), want)
    except Exception as e:      # noqa: BLE001 - an engine that does not run is a failed/absent row
        row[f"{prefix}_err"], row[f"{prefix}_ms"] = None, None
        row["notes"].append(f"{prefix}: {common.first_line(e, 100)}")
        return
    if not row[f"{prefix}_err"] <= ERR_TOL:
        row[f"{prefix}_ms"] = None
        row["notes"].append(f"{prefix}: wrong (err {row[f'{prefix}_err']:.1e}), not timed")
        return
    row[f"{prefix}_ms"], why = try_time(fn)
    if why:
        row["notes"].append(f"{prefix}: {why}")


def measure(shapes, pow2: bool = False, config: dict | None = None, deadline: float | None = None,
            layouts=LAYOUTS, seed: int = 0) -> list[dict]:
    """One row per (shape, layout): for each engine ``auto``, ``triton``, ``torch`` (blockwise scaled_mm) its
    ``<engine>_err`` vs the reference and ``<engine>_ms``; ``bf16_ms``; ``auto_engine`` (what auto chose);
    ``<engine>_tflops``; ``vs_bf16`` (auto over BF16), ``vs_torch`` (auto over torch blockwise) and
    ``triton_vs_torch``; ``ok`` (auto and triton right). Shapes not started before ``deadline``:
    ``skipped=True``."""
    from kernels import get_ops, torch_gemm
    from kernels import reference as ref
    tg = get_ops("triton", common.DEVICE)
    auto = get_ops("auto", common.DEVICE)
    torch_why = torch_gemm.unavailable(common.DEVICE)
    rows = []
    for i, (M, N, K) in enumerate(shapes):
        base = {"shape": f"{M}x{N}x{K}", "M": M, "N": N, "K": K}
        if past(deadline):
            rows += [base | {"layout": lay, "skipped": True} for lay in layouts]
            continue
        cases = operands(M, N, K, pow2, seed + i)
        flop = 2.0 * M * N * K
        for lay in layouts:
            gargs, bf16_fn = cases[lay]
            row = base | {"layout": lay, "skipped": False, "flop": flop, "notes": []}
            want = ref.gemm(*gargs)
            _engine_row(row, "triton", lambda: tg.gemm(*gargs, config=config), want)
            if torch_why:
                row.update(torch_err=None, torch_ms=None)
                row["notes"].append(f"torch: {torch_why}")
            else:
                _engine_row(row, "torch", lambda: torch_gemm.gemm(*gargs), want)
            if config is None:
                _engine_row(row, "auto", lambda: auto.gemm(*gargs), want)
                row["auto_engine"] = (auto.choices.get(auto.gemm_key(gargs[0], gargs[2], gargs[3], gargs[4]), "?")
                                      if hasattr(auto, "choices") else "emulation")
            else:                               # an explicit launch config: auto is the Triton kernel here
                row.update(auto_err=row["triton_err"], auto_ms=row["triton_ms"], auto_engine="triton (config)")
            del want
            row["bf16_ms"], why_bf16 = try_time(bf16_fn)
            if why_bf16:
                row["notes"].append(f"bf16: {why_bf16}")
            for eng in ("auto", "triton", "torch", "bf16"):
                ms = row.get(f"{eng}_ms")
                row[f"{eng}_tflops"] = None if ms is None else flop / ms / 1e9
            row["vs_bf16"] = _speedup(row["auto_ms"], row["bf16_ms"])
            row["vs_torch"] = _speedup(row["auto_ms"], row["torch_ms"])
            row["triton_vs_torch"] = _speedup(row["triton_ms"], row["torch_ms"])
            row["ok"] = all(row.get(f"{e}_err") is not None and row[f"{e}_err"] <= ERR_TOL for e in ("auto", "triton"))
            row["note"] = "; ".join(row.pop("notes"))
            rows.append(row)
        del cases
    return rows


def _speedup(ms: float | None, base_ms: float | None) -> float | None:
    return None if ms is None or base_ms is None else base_ms / ms


HEADERS = ["shape MxNxK", "gemm", "auto fp8 TFLOP/s", "auto engine", "triton fp8 TFLOP/s", "torch blockwise TFLOP/s",
           "bf16 TFLOP/s", "auto/bf16", "auto/torch", "triton/torch", "err auto", "err triton", "err torch", "note"]


def table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        if r.get("skipped"):
            out.append([r["shape"], r["layout"], *[""] * 11, "not run: time budget"])
            continue

        def err(key):
            v = r.get(key)
            return fmt(v, ".1e") + ("" if v is not None and v <= ERR_TOL else " FAIL" if v is not None else "")
        out.append([r["shape"], r["layout"], fmt(r.get("auto_tflops")), r.get("auto_engine", ""),
                    fmt(r.get("triton_tflops")), fmt(r.get("torch_tflops")), fmt(r.get("bf16_tflops")),
                    fmt(r.get("vs_bf16"), ".2f", "x"), fmt(r.get("vs_torch"), ".2f", "x"),
                    fmt(r.get("triton_vs_torch"), ".2f", "x"), err("auto_err"), err("triton_err"), err("torch_err"),
                    r.get("note", "")])
    return out


def main() -> None:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="*", help="MxNxK ...")
    args = p.parse_args()
    require_cuda()
    rows = measure(parse_shapes(args.shapes, DEFAULT_SHAPES), args.pow2, parse_config(args.config))
    print_table(HEADERS, table_rows(rows))


if __name__ == "__main__":
    main()
