"""Time the dense blockwise FP8 GEMM (Fprop, Dgrad, Wgrad layouts) against torch BF16 matmul and
``torch._scaled_mm`` in the same run; reports TFLOP/s, the ratios, and the error vs the torch reference.

    python -m bench.fp8_gemm                       # default shapes (DeepSeek-V3 projections, M = 4096 tokens)
    python -m bench.fp8_gemm --shapes 4096x7168x7168 --config BLOCK_M=128,BLOCK_N=256,num_stages=3

Shapes are MxNxK for Fprop ``y[M,N] = x[M,K]·W[N,K]ᵀ``; Dgrad computes ``dx[M,K] = dy[M,N]·W`` and Wgrad
``dW[N,K] = dyᵀ·x`` (contraction over the M tokens) — 2·M·N·K FLOP each. The ``_scaled_mm`` baseline uses
1×128 / 128×128 block scales (cuBLAS, needs sm_90 and CUDA ≥ 12.9); where torch refuses, it falls back
to row-wise scales and says so.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bench import common
from bench.common import (base_parser, parse_config, print_table, ratio, rel_err, require_cuda, tflops,
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


def scaled_mm_baseline(xq, xs, wq, ws):
    """``torch`` blockwise-scaled FP8 GEMM for Fprop, or row-wise scaling if blockwise is refused."""
    xs_mmajor = xs.t().contiguous().t()                     # cuBLAS wants the 1x128 scales M-major

    def blockwise():
        return F.scaled_mm(xq, wq.t(), xs_mmajor, F.ScalingType.BlockWise1x128, ws.t(),
                           F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
    try:
        blockwise()
        return blockwise, "blockwise 1x128/128x128"
    except Exception as e:                                  # noqa: BLE001
        print(f"  _scaled_mm blockwise refused ({type(e).__name__}: {str(e).splitlines()[0][:100]}); using row-wise")
    sa = xs.amax(1, keepdim=True).contiguous()              # not the same numerics: a speed reference only
    sb = ws.amax(1).repeat_interleave(128)[: wq.shape[0]][None, :].contiguous()
    return (lambda: torch._scaled_mm(xq, wq.t(), sa, sb, out_dtype=torch.bfloat16)), "row-wise"


def main() -> None:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="*", help="MxNxK ...")
    args = p.parse_args()
    require_cuda()
    from kernels import gemm as tgemm
    from kernels import quant as tquant
    from kernels import reference as ref
    cfg = parse_config(args.config)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes] if args.shapes else DEFAULT_SHAPES
    rows = []
    for M, N, K in shapes:
        torch.manual_seed(0)
        x = torch.randn(M, K, device=common.DEVICE, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=common.DEVICE, dtype=torch.bfloat16) * 0.02
        dy = torch.randn(M, N, device=common.DEVICE, dtype=torch.bfloat16)
        xq, xs = tquant.quant_act(x, args.pow2)
        wq, ws, wq_t = tquant.quant_weight(w, args.pow2, transpose=True)
        dyq, dys = tquant.quant_act(dy, args.pow2)
        dyt, dyts = tquant.quant_act_t(dy, None, args.pow2)
        xt, xts = tquant.quant_act_t(x, None, args.pow2)
        flop = 2.0 * M * N * K
        cases = {
            "fprop": ((xq, xs, wq, ws, torch.bfloat16), lambda: x @ w.t()),
            "dgrad": ((dyq, dys, wq_t, ws.t(), torch.bfloat16), lambda: dy @ w),
            "wgrad": ((dyt, dyts, xt, xts, torch.float32), lambda: dy.t() @ x),
        }
        scaled_fn, scaled_kind = scaled_mm_baseline(xq, xs, wq, ws)
        t_scaled, why = try_time(scaled_fn)
        for name, (gargs, bf16_fn) in cases.items():
            err = rel_err(tgemm.gemm(*gargs, config=cfg), ref.gemm(*gargs))
            t_fp8, why_fp8 = try_time(lambda: tgemm.gemm(*gargs, config=cfg))
            t_bf16, _ = try_time(bf16_fn)
            sc = (t_scaled if name == "fprop" else None)
            rows.append([f"{M}x{N}x{K}", name, tflops(flop, t_fp8), tflops(flop, t_bf16), ratio(t_fp8, t_bf16),
                         tflops(flop, sc) if name == "fprop" else "", ratio(t_fp8, sc) if name == "fprop" else "",
                         f"{err:.1e}", why_fp8 or (why if name == "fprop" and sc is None else "")])
        print(f"  {M}x{N}x{K}: _scaled_mm baseline = {scaled_kind}")
    print_table(["shape MxNxK", "gemm", "triton fp8 TFLOP/s", "bf16 TFLOP/s", "fp8/bf16",
                 "_scaled_mm TFLOP/s", "fp8/_scaled_mm", "err vs ref", "note"], rows)


if __name__ == "__main__":
    main()
