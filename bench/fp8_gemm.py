"""Time the dense blockwise FP8 GEMM (Fprop, Dgrad, Wgrad layouts) against torch BF16 matmul and
``torch._scaled_mm`` in the same run; reports TFLOP/s, the ratios, and the error vs the torch reference.

    python -m bench.fp8_gemm                       # default shapes (DeepSeek-V3 projections, M = 4096 tokens)
    python -m bench.fp8_gemm --shapes 4096x7168x7168 --config BLOCK_M=128,BLOCK_N=256,num_stages=3

Shapes are MxNxK for Fprop ``y[M,N] = x[M,K]·W[N,K]ᵀ``; Dgrad computes ``dx[M,K] = dy[M,N]·W`` and Wgrad
``dW[N,K] = dyᵀ·x`` (contraction over the M tokens) — 2·M·N·K FLOP each. Every layout is checked against
``kernels.reference.gemm`` (dequantise, FP32 matmul) on fresh random inputs before it is timed.

The ``_scaled_mm`` baseline is cuBLAS with the same block scales (1×128 activations / 128×128 weights for
Fprop and Dgrad, 1×128 × 1×128 for Wgrad; needs sm_90 and CUDA ≥ 12.9). A candidate call is kept only if
it runs *and* matches the reference; otherwise the row-wise FP8 GEMM (per-row amax scales: a speed
reference with other numerics) is timed and the row says so.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bench import common
from bench.common import (base_parser, fmt, parse_config, parse_shapes, past, print_table, rel_err, require_cuda,
                          try_time)

DEFAULT_SHAPES = [
    (4096, 7168, 7168),     # square-ish reference point
    (4096, 2112, 7168),     # MLA wq_a + wkv_a (1536 + 576)
    (4096, 24576, 1536),    # MLA wq_b (128 heads x 192)
    (4096, 32768, 512),     # MLA wkv_b (128 heads x (128 + 128))
    (4096, 7168, 16384),    # MLA wo
    (4096, 18432, 7168),    # dense MLP w1 / w3
    (4096, 7168, 18432),    # dense MLP w2
]
LAYOUTS = ("fprop", "dgrad", "wgrad")
ERR_TOL = 1e-2   # gross-error gate before timing; the tight bounds (1e-3) are the kernel tests'


def scaled_mm_candidates(a, sa, b, sb, out_dtype):
    """``(kind, fn)`` candidates computing ``a·bᵀ`` (our operand convention: both K-major, ``sa`` 1×128,
    ``sb`` 128×128 blocks or per-row 1×128) with torch's FP8 GEMMs, most faithful first."""
    from kernels.reference import TILE, _b_group
    blocks_b = _b_group(b, sb) == TILE
    sa_mm = sa.t().contiguous().t()                                     # 1×128 scales: outer-dim (M) major
    sb_mm = sb.contiguous() if blocks_b else sb.t().contiguous().t()
    cands = []
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        rec_b = F.ScalingType.BlockWise128x128 if blocks_b else F.ScalingType.BlockWise1x128
        cands.append(("blockwise (F.scaled_mm)", lambda: F.scaled_mm(
            a, b.t(), sa_mm, F.ScalingType.BlockWise1x128, sb_mm.t(), rec_b, output_dtype=out_dtype)))
    cands.append(("blockwise (torch._scaled_mm)", lambda: torch._scaled_mm(
        a, b.t(), sa_mm, sb_mm.t(), out_dtype=out_dtype)))
    row_a = sa.float().amax(1, keepdim=True).contiguous()               # other numerics: speed reference only
    row_b = (sb.float().amax(1).repeat_interleave(128)[: b.shape[0]] if blocks_b else sb.float().amax(1))
    row_b = row_b[None, :].contiguous()
    cands.append(("row-wise (other numerics)", lambda: torch._scaled_mm(
        a, b.t(), row_a, row_b, out_dtype=out_dtype)))
    return cands


def scaled_mm_baseline(a, sa, b, sb, out_dtype, want: torch.Tensor):
    """``(fn, kind, err, why)``: the first blockwise candidate that runs and matches ``want`` within
    ``ERR_TOL``, else the row-wise one (if it runs), else ``(None, "", None, reasons)``."""
    reasons = []
    for kind, fn in scaled_mm_candidates(a, sa, b, sb, out_dtype):
        try:
            err = rel_err(fn(), want)
        except Exception as e:      # noqa: BLE001 - torch refuses this recipe/layout here: try the next
            reasons.append(f"{kind}: {common.first_line(e, 80)}")
            continue
        if kind.startswith("row-wise") or err <= ERR_TOL:
            return fn, kind, err, "; ".join(reasons)
        reasons.append(f"{kind}: err {err:.1e} vs reference")
    return None, "", None, "; ".join(reasons)


def operands(M: int, N: int, K: int, pow2: bool = False, seed: int = 0):
    """Fresh random BF16 tensors and their FP8 forms; ``{layout: (gemm args, bf16 baseline fn)}``."""
    from kernels import get_ops
    tq = get_ops("triton")
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


def measure(shapes, pow2: bool = False, config: dict | None = None, deadline: float | None = None,
            layouts=LAYOUTS, seed: int = 0) -> list[dict]:
    """One row per (shape, layout) with ``ms`` (Triton FP8), ``bf16_ms``, ``scaled_ms`` / ``scaled_kind`` /
    ``scaled_err``, ``err`` (vs reference), ``ok`` (err <= ERR_TOL), ``tflops`` & co., ``vs_bf16`` and
    ``vs_scaled`` (speed-ups of the FP8 kernel). Shapes not started before ``deadline``: ``skipped=True``."""
    from kernels import get_ops
    from kernels import reference as ref
    tg = get_ops("triton")
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
            row = base | {"layout": lay, "skipped": False, "flop": flop, "note": ""}
            try:
                want = ref.gemm(*gargs)
                row["err"] = rel_err(tg.gemm(*gargs, config=config), want)
            except Exception as e:      # noqa: BLE001 - a kernel that does not run is a failed row
                rows.append(row | {"err": None, "ok": False, "ms": None, "note": common.first_line(e)})
                continue
            row["ok"] = row["err"] <= ERR_TOL
            row["ms"], why = try_time(lambda: tg.gemm(*gargs, config=config))
            row["bf16_ms"], why_bf16 = try_time(bf16_fn)
            sfn, kind, serr, why_s = scaled_mm_baseline(*gargs, want)
            del want
            row["scaled_ms"], why_st = try_time(sfn) if sfn is not None else (None, "")
            row.update(scaled_kind=kind or "refused", scaled_err=serr)
            for key, ms in (("tflops", row["ms"]), ("bf16_tflops", row["bf16_ms"]), ("scaled_tflops", row["scaled_ms"])):
                row[key] = None if ms is None else flop / ms / 1e9
            row["vs_bf16"] = _speedup(row["ms"], row["bf16_ms"])
            row["vs_scaled"] = _speedup(row["ms"], row["scaled_ms"])
            row["note"] = "; ".join(n for n in (why, why_bf16 and f"bf16: {why_bf16}", why_st, why_s) if n)
            rows.append(row)
        del cases
    return rows


def _speedup(ms: float | None, base_ms: float | None) -> float | None:
    return None if ms is None or base_ms is None else base_ms / ms


HEADERS = ["shape MxNxK", "gemm", "triton fp8 TFLOP/s", "bf16 TFLOP/s", "fp8/bf16", "_scaled_mm TFLOP/s",
           "fp8/_scaled_mm", "_scaled_mm kind", "err vs ref", "_scaled_mm err", "note"]


def table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        if r.get("skipped"):
            out.append([r["shape"], r["layout"], *[""] * 8, "not run: time budget"])
            continue
        err = fmt(r.get("err"), ".1e") + ("" if r.get("ok") else " FAIL")
        out.append([r["shape"], r["layout"], fmt(r.get("tflops")), fmt(r.get("bf16_tflops")),
                    fmt(r.get("vs_bf16"), ".2f", "x"), fmt(r.get("scaled_tflops")), fmt(r.get("vs_scaled"), ".2f", "x"),
                    r.get("scaled_kind", ""), err, fmt(r.get("scaled_err"), ".1e"), r.get("note", "")])
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
