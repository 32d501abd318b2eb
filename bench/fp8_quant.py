"""Time the FP8 quantisation kernels (1×128 activations, 128×1 transposed, 128×128 weights) in GB/s
against a same-size device copy (the bandwidth ceiling) and the plain-torch reference, in one run.

    python -m bench.fp8_quant
    python -m bench.fp8_quant --shapes 16384x7168 --pow2

GB/s counts bytes read (BF16 input) + bytes written (E4M3 output + FP32 scales).
"""
from __future__ import annotations

import torch

from bench import common
from bench.common import base_parser, print_table, require_cuda, try_time

DEFAULT_SHAPES = [(4096, 7168), (16384, 7168), (4096, 2048), (16384, 2048), (7168, 18432)]


def main() -> None:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="*", help="RxC ...")
    args = p.parse_args()
    require_cuda()
    from kernels import quant as tquant
    from kernels import reference as ref
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes] if args.shapes else DEFAULT_SHAPES
    rows = []
    for R, C in shapes:
        x = torch.randn(R, C, device=common.DEVICE, dtype=torch.bfloat16)
        copy_src, copy_dst = x.view(-1), torch.empty_like(x).view(-1)
        t_copy, _ = try_time(lambda: copy_dst.copy_(copy_src))
        cases = {
            "act 1x128": (lambda: tquant.quant_act(x, args.pow2), lambda: ref.quant_act(x, args.pow2),
                          R * C * 3 + R * -(-C // 128) * 4),
            "act 128x1 (T)": (lambda: tquant.quant_act_t(x, None, args.pow2),
                              lambda: ref.quant_act_t(x, None, args.pow2), R * C * 3 + C * -(-R // 128) * 4),
            "weight 128x128": (lambda: tquant.quant_weight(x, args.pow2), lambda: ref.quant_weight(x, args.pow2),
                               R * C * 3),
            "weight +T copy": (lambda: tquant.quant_weight(x, args.pow2, transpose=True),
                               lambda: ref.quant_weight(x, args.pow2, transpose=True), R * C * 4),
        }
        copy_gbs = 4 * R * C / t_copy / 1e6
        for name, (fn, ref_fn, nbytes) in cases.items():
            got, want = fn(), ref_fn()
            exact = all(torch.equal(g.view(torch.uint8) if g.dtype == ref.FP8_DTYPE else g,
                                    w.view(torch.uint8) if w.dtype == ref.FP8_DTYPE else w) for g, w in zip(got, want))
            t, why = try_time(fn)
            t_ref, _ = try_time(ref_fn)
            gbs = None if t is None else nbytes / t / 1e6
            rows.append([f"{R}x{C}", name, "n/a" if gbs is None else f"{gbs:.0f}", f"{copy_gbs:.0f}",
                         "n/a" if gbs is None else f"{gbs / copy_gbs:.2f}",
                         "n/a" if t_ref is None else f"{nbytes / t_ref / 1e6:.0f}",
                         "n/a" if t is None or t_ref is None else f"{t_ref / t:.1f}x", "yes" if exact else "NO", why])
    print_table(["shape", "kernel", "triton GB/s", "copy GB/s", "of copy", "torch ref GB/s", "speedup",
                 "bit-exact", "note"], rows)


if __name__ == "__main__":
    main()
