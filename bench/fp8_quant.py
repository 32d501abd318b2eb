"""Time the FP8 quantisation kernels (1×128 activations, 128×1 transposed, both from one launch, 128×128
weights) in GB/s against a same-size device copy (the bandwidth ceiling) and the plain-torch reference, in
one run; the two activation quantisers one after the other are timed too, beside the fused launch.

    python -m bench.fp8_quant
    python -m bench.fp8_quant --shapes 16384x7168 --pow2

GB/s counts bytes read (BF16 input) + bytes written (E4M3 output + FP32 scales); the copy moves the same
BF16 tensor (bytes read + written). Each kernel's output is checked bit-exact against the reference
(``kernels/reference.py``) on fresh random inputs before it is timed.
"""
from __future__ import annotations

import torch

from bench import common
from bench.common import base_parser, fmt, parse_shapes, past, print_table, require_cuda, try_time

DEFAULT_SHAPES = [(4096, 7168), (16384, 7168), (4096, 2048), (16384, 2048), (7168, 18432)]
KERNELS = ("act 1x128", "act 128x1 (T)", "act both, 1 launch", "act both, 2 launches", "weight 128x128",
           "weight +T copy")


def _bit_exact(got, want) -> bool:
    from kernels import reference as ref

    def bits(t):
        return t.view(torch.uint8) if t.dtype == ref.FP8_DTYPE else t
    return all(g.shape == w.shape and torch.equal(bits(g), bits(w)) for g, w in zip(got, want))


def measure(shapes, pow2: bool = False, deadline: float | None = None, seed: int = 0) -> list[dict]:
    """One row per (shape, kernel): ``gbs`` (kernel), ``copy_gbs``, ``of_copy`` (gbs / copy_gbs), ``ref_gbs``,
    ``exact`` (bit-exact vs the reference), ``note``. Shapes not started before ``deadline`` get rows with
    ``skipped=True``."""
    import kernels
    kernels.configure()
    from kernels import quant as tquant     # the raw kernels: get_ops("triton") would fall back to the reference
    from kernels import reference as ref
    rows = []
    for i, (R, C) in enumerate(shapes):
        if past(deadline):
            rows += [{"shape": f"{R}x{C}", "R": R, "C": C, "kernel": k, "skipped": True} for k in KERNELS]
            continue
        torch.manual_seed(seed + i)
        x = torch.randn(R, C, device=common.DEVICE, dtype=torch.bfloat16)
        copy_src, copy_dst = x.view(-1), torch.empty_like(x).view(-1)
        t_copy, why_copy = try_time(lambda: copy_dst.copy_(copy_src))
        copy_gbs = None if t_copy is None else 4 * R * C / t_copy / 1e6
        both = R * C * 4 + (R * -(-C // 128) + C * -(-R // 128)) * 4     # x read once, two copies written
        cases = {
            "act 1x128": (lambda: tquant.quant_act(x, pow2), lambda: ref.quant_act(x, pow2),
                          R * C * 3 + R * -(-C // 128) * 4),
            "act 128x1 (T)": (lambda: tquant.quant_act_t(x, None, pow2),
                              lambda: ref.quant_act_t(x, None, pow2), R * C * 3 + C * -(-R // 128) * 4),
            "act both, 1 launch": (lambda: tquant.quant_act_both(x, None, pow2),
                                   lambda: ref.quant_act_both(x, None, pow2), both),
            "act both, 2 launches": (lambda: (*tquant.quant_act(x, pow2), *tquant.quant_act_t(x, None, pow2)),
                                     lambda: ref.quant_act_both(x, None, pow2), both),
            "weight 128x128": (lambda: tquant.quant_weight(x, pow2), lambda: ref.quant_weight(x, pow2),
                               R * C * 3),
            "weight +T copy": (lambda: tquant.quant_weight(x, pow2, transpose=True),
                               lambda: ref.quant_weight(x, pow2, transpose=True), R * C * 4),
        }
        for name, (fn, ref_fn, nbytes) in cases.items():
            row = {"shape": f"{R}x{C}", "R": R, "C": C, "kernel": name, "bytes": nbytes, "copy_gbs": copy_gbs,
                   "skipped": False, "note": why_copy}
            try:
                row["exact"] = _bit_exact(fn(), ref_fn())
            except Exception as e:      # noqa: BLE001 - a kernel that does not run is a failed row
                row.update(exact=False, gbs=None, of_copy=None, ref_gbs=None, note=common.first_line(e))
                rows.append(row)
                continue
            t, why = try_time(fn)
            t_ref, _ = try_time(ref_fn)
            gbs = None if t is None else nbytes / t / 1e6
            row.update(gbs=gbs, ms=t, of_copy=None if gbs is None or not copy_gbs else gbs / copy_gbs,
                       ref_gbs=None if t_ref is None else nbytes / t_ref / 1e6,
                       speedup=None if t is None or t_ref is None else t_ref / t, note=why or why_copy)
            rows.append(row)
        del x, copy_src, copy_dst
    return rows


HEADERS = ["shape", "kernel", "triton GB/s", "copy GB/s", "of copy", "torch ref GB/s", "speedup", "bit-exact", "note"]


def table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        if r.get("skipped"):
            out.append([r["shape"], r["kernel"], "", "", "", "", "", "", "not run: time budget"])
            continue
        out.append([r["shape"], r["kernel"], fmt(r.get("gbs")), fmt(r.get("copy_gbs")), fmt(r.get("of_copy"), ".2f"),
                    fmt(r.get("ref_gbs")), fmt(r.get("speedup"), ".1f", "x"), "yes" if r.get("exact") else "NO",
                    r.get("note", "")])
    return out


def main() -> None:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="*", help="RxC ...")
    args = p.parse_args()
    require_cuda()
    rows = measure(parse_shapes(args.shapes, DEFAULT_SHAPES), args.pow2)
    print_table(HEADERS, table_rows(rows))


if __name__ == "__main__":
    main()
