"""Time the grouped FP8 GEMMs of the routed experts (forward, Dgrad, Wgrad; tokens sorted by expert,
ragged counts) against ``torch._grouped_mm`` in BF16 and ``torch._scaled_grouped_mm`` (FP8 with row-wise
scales, the only scaling torch's grouped FP8 GEMM takes: a speed reference) in the same run; reports
TFLOP/s, the ratios and the error vs the torch reference.

    python -m bench.fp8_grouped_gemm                         # DeepSeek-V3 expert shapes
    python -m bench.fp8_grouped_gemm --experts 8 --tokens 32768

DeepSeek-V3 experts: hidden D = 7168, expert width F = 2048. Each "up" GEMM is ``[R,D]·W13[E,2F,D]ᵀ`` (gate and
up stacked, as ``models.moe.GroupedExperts`` runs them), each
"down" GEMM ``[R,F]·W[E,D,F]ᵀ`` — 2·R·N·K FLOP for forward, Dgrad and Wgrad alike. Expert token counts
are ragged (0.5x to 1.5x of the mean) in multiples of 16 (torch's grouped GEMMs want 16-aligned groups;
the kernels' own tests cover arbitrary counts). Every pass is checked against ``kernels.reference`` on
fresh random inputs before it is timed.
"""
from __future__ import annotations

import torch

from bench import common
from bench.common import base_parser, fmt, parse_config, past, print_table, rel_err, require_cuda, try_time

ERR_TOL = 1e-2   # gross-error gate before timing; the tight bounds (1e-3) are the kernel tests'
PASSES = ("fprop", "dgrad", "wgrad")


def ragged_counts(tokens: int, experts: int, seed: int = 0, align: int = 16) -> torch.Tensor:
    """Token counts per expert, uneven (0.5x to 1.5x of the mean), multiples of ``align``, summing to
    ``tokens`` (which must be a multiple of ``align``)."""
    assert tokens % align == 0, (tokens, align)
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(experts, generator=g) + 0.5
    counts = (p / p.sum() * (tokens // align)).floor().long() * align
    counts[0] += tokens - counts.sum()
    return counts


def _rowmax(s: torch.Tensor, n: int) -> torch.Tensor:
    """Block scales ``[..., ⌈n/128⌉, ⌈k/128⌉]`` -> one scale per row ``[..., n]``: the max over the row's blocks."""
    return s.amax(-1).repeat_interleave(128, dim=-1)[..., :n].contiguous()


def _cases(tq, ref, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, tpe: torch.Tensor, offs: torch.Tensor,
           pow2: bool, cfg: dict | None) -> dict:
    """Per pass: (Triton FP8, ``kernels.reference``, ``torch._grouped_mm`` BF16, ``torch._scaled_grouped_mm``)
    callables on inputs ``x [R,K]``, weights ``w [E,N,K]`` and output gradient ``dy [R,N]``, quantized here."""
    E, N, K = w.shape
    xq, xs = tq.quant_act(x, pow2)
    wq, ws, wq_t = tq.quant_weight(w, pow2, transpose=True)
    dyq, dys = tq.quant_act(dy, pow2)
    dyt, dyts = tq.quant_act_t(dy, tpe, pow2)
    xt, xts = tq.quant_act_t(x, tpe, pow2)
    wt = w.transpose(1, 2)
    # torch's FP8 grouped GEMM takes row-wise scales only (per row of each operand): other numerics than
    # the block scales, so it is a speed reference; its scales are the row maxima of ours.
    rs = {"fprop": (xs.amax(1).contiguous(), _rowmax(ws, N)), "dgrad": (dys.amax(1).contiguous(), _rowmax(ws.mT, K)),
          "wgrad": (dyts.amax(1).repeat(E).contiguous(), xts.amax(1).repeat(E).contiguous())}
    return {
        "fprop": (lambda: tq.grouped_gemm(xq, xs, wq, ws, tpe, config=cfg),
                  lambda: ref.grouped_gemm(xq, xs, wq, ws, tpe),
                  lambda: torch._grouped_mm(x, wt, offs=offs),
                  lambda: torch._scaled_grouped_mm(xq, wq.transpose(1, 2), *rs["fprop"], offs=offs,
                                                   out_dtype=torch.bfloat16)),
        "dgrad": (lambda: tq.grouped_gemm(dyq, dys, wq_t, ws.mT, tpe, config=cfg),
                  lambda: ref.grouped_gemm(dyq, dys, wq_t, ws.mT, tpe),
                  lambda: torch._grouped_mm(dy, w, offs=offs),
                  lambda: torch._scaled_grouped_mm(dyq, wq_t.transpose(1, 2), *rs["dgrad"], offs=offs,
                                                   out_dtype=torch.bfloat16)),
        "wgrad": (lambda: tq.grouped_wgrad(dyt, dyts, xt, xts, tpe, config=cfg),
                  lambda: ref.grouped_wgrad(dyt, dyts, xt, xts, tpe),
                  lambda: torch._grouped_mm(dy.t(), x, offs=offs),
                  lambda: torch._scaled_grouped_mm(dyt, xt.t(), *rs["wgrad"], offs=offs,
                                                   out_dtype=torch.bfloat16)),
    }


def _measure_case(row: dict, fn, ref_fn, bf16_fn, scaled_fn) -> dict:
    """``row`` (with ``flop``) completed by one pass: its error against the reference, then the three timings
    and what follows from them."""
    flop = row["flop"]
    try:
        row["err"] = rel_err(fn(), ref_fn())
    except Exception as e:      # noqa: BLE001 - a kernel that does not run is a failed row
        return row | {"err": None, "ok": False, "ms": None, "note": common.first_line(e)}
    row["ok"] = row["err"] <= ERR_TOL
    row["ms"], why = try_time(fn)
    row["bf16_ms"], why_bf16 = try_time(bf16_fn)
    row["scaled_ms"], why_scaled = try_time(scaled_fn)
    for key, ms in (("tflops", row["ms"]), ("bf16_tflops", row["bf16_ms"]),
                    ("scaled_tflops", row["scaled_ms"])):
        row[key] = None if ms is None else flop / ms / 1e9
    row["vs_bf16"] = None if row["ms"] is None or row["bf16_ms"] is None else row["bf16_ms"] / row["ms"]
    row["vs_scaled"] = (None if row["ms"] is None or row["scaled_ms"] is None
                        else row["scaled_ms"] / row["ms"])
    row["note"] = "; ".join(n for n in (why, why_bf16 and f"_grouped_mm: {why_bf16}",
                                        why_scaled and f"_scaled_grouped_mm: {why_scaled}") if n)
    return row


def measure(experts_list, tokens: int = 32768, dim: int = 7168, inter: int = 2048, pow2: bool = False,
            config: dict | None = None, deadline: float | None = None, seed: int = 0) -> list[dict]:
    """One row per (E, up/down, pass) with ``ms`` (Triton FP8), ``bf16_ms`` (``torch._grouped_mm``),
    ``scaled_ms`` (``torch._scaled_grouped_mm``, row-wise scales), ``err``, ``ok``, TFLOP/s and
    speed-ups ``vs_bf16`` / ``vs_scaled``. Cases not started before ``deadline``: ``skipped=True``."""
    import types

    from kernels import get_ops, quant
    from kernels import reference as ref
    tg = get_ops("triton", common.DEVICE)       # raw quantisers (bench.fp8_quant checks them), default GEMMs
    tq = types.SimpleNamespace(quant_act=quant.quant_act, quant_act_t=quant.quant_act_t,
                               quant_weight=quant.quant_weight, grouped_gemm=tg.grouped_gemm,
                               grouped_wgrad=tg.grouped_wgrad)
    rows = []
    R = tokens
    for E in experts_list:
        tpe = ragged_counts(R, E, seed).to(common.DEVICE)
        offs = torch.cumsum(tpe, 0, dtype=torch.int32)
        for label, N, K in (("up (w13)", 2 * inter, dim), ("down (w2)", dim, inter)):
            base = {"E": E, "R": R, "gemm": label, "N": N, "K": K}
            if past(deadline):
                rows += [base | {"pass": p, "skipped": True} for p in PASSES]
                continue
            torch.manual_seed(seed + E * 7 + N)
            x = torch.randn(R, K, device=common.DEVICE, dtype=torch.bfloat16)
            w = torch.randn(E, N, K, device=common.DEVICE, dtype=torch.bfloat16) * 0.02
            dy = torch.randn(R, N, device=common.DEVICE, dtype=torch.bfloat16)
            cases = _cases(tq, ref, x, w, dy, tpe, offs, pow2, config)
            flop = 2.0 * R * N * K
            rows += [_measure_case(base | {"pass": name, "skipped": False, "flop": flop}, *fns)
                     for name, fns in cases.items()]
            del x, w, dy, cases
    return rows


HEADERS = ["E", "gemm", "pass", "triton fp8 TFLOP/s", "bf16 _grouped_mm", "fp8/bf16",
           "_scaled_grouped_mm (row-wise)", "fp8/scaled", "err vs ref", "note"]


def table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        if r.get("skipped"):
            out.append([r["E"], r["gemm"], r["pass"], *[""] * 6, "not run: time budget"])
            continue
        err = fmt(r.get("err"), ".1e") + ("" if r.get("ok") else " FAIL")
        out.append([r["E"], r["gemm"], r["pass"], fmt(r.get("tflops")), fmt(r.get("bf16_tflops")),
                    fmt(r.get("vs_bf16"), ".2f", "x"), fmt(r.get("scaled_tflops")), fmt(r.get("vs_scaled"), ".2f", "x"),
                    err, r.get("note", "")])
    return out


def main() -> None:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, nargs="*", default=[8, 32], help="local experts per GPU")
    p.add_argument("--tokens", type=int, default=32768, help="routed token copies per GPU (R)")
    p.add_argument("--dim", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048)
    args = p.parse_args()
    require_cuda()
    rows = measure(args.experts, args.tokens, args.dim, args.inter, args.pow2, parse_config(args.config))
    print(f"R = {args.tokens} token copies, D = {args.dim}, F = {args.inter}")
    print_table(HEADERS, table_rows(rows))


if __name__ == "__main__":
    main()
