"""Time the grouped FP8 GEMMs of the routed experts (forward, Dgrad, Wgrad; tokens sorted by expert,
ragged counts) against ``torch._grouped_mm`` in BF16 and ``torch._scaled_grouped_mm`` (row-wise FP8)
in the same run; reports TFLOP/s, the ratios and the error vs the torch reference.

    python -m bench.fp8_grouped_gemm                         # DeepSeek-V3 expert shapes
    python -m bench.fp8_grouped_gemm --experts 8 --tokens 32768

DeepSeek-V3 experts: hidden D = 7168, expert width F = 2048. Each "up" GEMM is ``[R,D]·W[E,F,D]ᵀ``, each
"down" GEMM ``[R,F]·W[E,D,F]ᵀ`` — 2·R·N·K FLOP for forward, Dgrad and Wgrad alike.
"""
from __future__ import annotations

import torch

from bench import common
from bench.common import base_parser, parse_config, print_table, ratio, rel_err, require_cuda, tflops, try_time


def ragged_counts(tokens: int, experts: int, seed: int = 0) -> torch.Tensor:
    """Token counts per expert, uneven (0.5x to 1.5x of the mean) and summing to ``tokens``."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(experts, generator=g) + 0.5
    counts = (p / p.sum() * tokens).floor().long()
    counts[0] += tokens - counts.sum()
    return counts


def main() -> None:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, nargs="*", default=[8, 32], help="local experts per GPU")
    p.add_argument("--tokens", type=int, default=32768, help="routed token copies per GPU (R)")
    p.add_argument("--dim", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048)
    args = p.parse_args()
    require_cuda()
    from kernels import grouped_gemm as tg
    from kernels import quant as tquant
    from kernels import reference as ref
    cfg = parse_config(args.config)
    rows = []
    for E in args.experts:
        tpe = ragged_counts(args.tokens, E).to(common.DEVICE)
        offs = torch.cumsum(tpe, 0, dtype=torch.int32)
        R = args.tokens
        for label, N, K in (("up (w1/w3)", args.inter, args.dim), ("down (w2)", args.dim, args.inter)):
            torch.manual_seed(0)
            x = torch.randn(R, K, device=common.DEVICE, dtype=torch.bfloat16)
            w = torch.randn(E, N, K, device=common.DEVICE, dtype=torch.bfloat16) * 0.02
            dy = torch.randn(R, N, device=common.DEVICE, dtype=torch.bfloat16)
            xq, xs = tquant.quant_act(x, args.pow2)
            wq, ws, wq_t = tquant.quant_weight(w, args.pow2, transpose=True)
            dyq, dys = tquant.quant_act(dy, args.pow2)
            dyt, dyts = tquant.quant_act_t(dy, tpe, args.pow2)
            xt, xts = tquant.quant_act_t(x, tpe, args.pow2)
            flop = 2.0 * R * N * K
            wt = w.transpose(1, 2)
            cases = {
                "fprop": (lambda: tg.grouped_gemm(xq, xs, wq, ws, tpe, config=cfg),
                          lambda: ref.grouped_gemm(xq, xs, wq, ws, tpe),
                          lambda: torch._grouped_mm(x, wt, offs=offs)),
                "dgrad": (lambda: tg.grouped_gemm(dyq, dys, wq_t, ws.mT, tpe, config=cfg),
                          lambda: ref.grouped_gemm(dyq, dys, wq_t, ws.mT, tpe),
                          lambda: torch._grouped_mm(dy, w, offs=offs)),
                "wgrad": (lambda: tg.grouped_wgrad(dyt, dyts, xt, xts, tpe, config=cfg),
                          lambda: ref.grouped_wgrad(dyt, dyts, xt, xts, tpe),
                          lambda: torch._grouped_mm(dy.t(), x, offs=offs)),
            }
            # Row-wise FP8 grouped GEMM from torch (forward only; per-token / per-channel scales).
            sa = xs.amax(1).contiguous()
            sb = ws.amax(-1).repeat_interleave(128, dim=1)[:, :N].contiguous()
            t_scaled, why_scaled = try_time(lambda: torch._scaled_grouped_mm(
                xq, wq.transpose(1, 2), sa, sb, offs=offs, out_dtype=torch.bfloat16))
            for name, (fn, ref_fn, bf16_fn) in cases.items():
                err = rel_err(fn(), ref_fn())
                t, why = try_time(fn)
                t_bf16, why_bf16 = try_time(bf16_fn)
                sc = t_scaled if name == "fprop" else None
                rows.append([E, label, name, tflops(flop, t), tflops(flop, t_bf16), ratio(t, t_bf16),
                             tflops(flop, sc) if name == "fprop" else "", ratio(t, sc) if name == "fprop" else "",
                             f"{err:.1e}", why or why_bf16 or (why_scaled if name == "fprop" else "")])
    print(f"R = {args.tokens} token copies, D = {args.dim}, F = {args.inter}")
    print_table(["E", "gemm", "pass", "triton fp8 TFLOP/s", "bf16 _grouped_mm", "fp8/bf16",
                 "_scaled_grouped_mm (row-wise)", "fp8/scaled", "err vs ref", "note"], rows)


if __name__ == "__main__":
    main()
