"""One training step of ``v3_small`` on one GPU, variant against variant in one process:
``python -m bench.step_variants [--layers 12] [--variants A,C,D,E | pending] [--deadline-s 300] [--json out.json]``.

Variants (``VARIANTS``): A the step before the lean-step work (eager, torch's clip + fused AdamW + master cast), B
compiled regions with torch's AdamW, C the trainer's settings on CUDA launched eagerly (``train.compile=auto``, the
Triton AdamW, BF16 moments), D C in FP8, E C at batch 8, F C with FP32 moments (as C was measured before BF16
moments became the default), G and H: C and D with their forward and backward replayed from a CUDA graph
(``train.cuda_graph``, the trainer's default for G), I G at batch 8, J H with the opt-in ``quant_act_both``, K H
with torch's copy instead of the weights' transpose kernel (the baseline), L G with each new compiled graph checked
against eager, M G with the FFN norms' compiled regions taking the residual add before them
(``DSV3_COMPILE_RESIDUAL=1``, opt-in until measured), N G with ``train.head_loss=inplace``, O G with
``optim.master=split``, P G with the dispatch's copies gathered back per token (``DSV3_GATHER_COPIES=1``), Q G with
the combine's un-sort by a gathered backward (``DSV3_UNSORT_GATHER=1``), R G with the attention heads laid out
``[B,T,H,.]`` (``DSV3_HEADS_BTHD=1``), S H with the Wgrad GEMMs writing BF16 (``DSV3_FP8_WGRAD_BF16=1``), T H with
the grouped GEMMs reading the quantiser's tile table in parts (``DSV3_FP8_SHARED_TILES=1``; all opt-in until
measured). All but N with
the fused head (``train.head_loss=fused``), batch 4 x 2048 unless stated, random tokens
(``bench.train_check.measure_step``). Prints per variant: median step, the host's enqueue time (a step whose host
time is close to its wall time is host-bound), MFU, tokens/s, peak memory, loss, the top GPU kernels of one
profiled step and the ops (with input shapes and calling lines) whose kernels took the most of it, the copies and
casts among them however small (the eager variants: a graph's replay runs no op), and with
``--host-profile N`` the N functions with the most own host time. Needs CUDA (and
omegaconf for the presets: the carried wheels).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

VARIANTS = {   # key: (label, precision, train.compile, adamw, batch, optim.moment_dtype, train.cuda_graph)
    "A": ("bf16, eager, torch AdamW (before)", "bf16", "off", "torch", 4, "fp32", False),
    "B": ("bf16, compiled, torch AdamW", "bf16", "auto", "torch", 4, "fp32", False),
    "C": ("bf16, compiled, Triton AdamW (the trainer's)", "bf16", "auto", "auto", 4, "auto", False),
    "D": ("fp8, compiled, Triton AdamW", "fp8", "auto", "auto", 4, "auto", False),
    "E": ("bf16, compiled, Triton AdamW, batch 8", "bf16", "auto", "auto", 8, "auto", False),
    "F": ("bf16, compiled, Triton AdamW, FP32 moments", "bf16", "auto", "auto", 4, "fp32", False),
    "G": ("C with its forward and backward as a CUDA graph", "bf16", "auto", "auto", 4, "auto", True),
    "H": ("D with its forward and backward as a CUDA graph", "fp8", "auto", "auto", 4, "auto", True),
    "I": ("G at batch 8", "bf16", "auto", "auto", 8, "auto", True),
    "J": ("H with one quantiser launch for both copies (DSV3_FUSED_QUANT=1)", "fp8", "auto", "auto", 4, "auto", True),
    "K": ("H with torch's copy for the weights' Dgrad copies, not the transpose kernel (DSV3_FP8_TRANSPOSE=0)", "fp8",
          "auto", "auto", 4, "auto", True),
    "L": ("G with the compiled regions' check (DSV3_COMPILE_CHECK=1)", "bf16", "auto", "auto", 4, "auto", True),
    "M": ("G with the residual add in the FFN norm's region (DSV3_COMPILE_RESIDUAL=1)", "bf16", "auto", "auto", 4,
          "auto", True),
    "N": ("G with the heads' gradient taken in the forward (train.head_loss=inplace)", "bf16", "auto", "auto", 4,
          "auto", True),
    "O": ("G with the FP32 master as the BF16 weights and 16 low bits (optim.master=split)", "bf16", "auto", "auto",
          4, "auto", True),
    "P": ("G with the dispatch's copies gathered back per token (DSV3_GATHER_COPIES=1)", "bf16", "auto", "auto", 4,
          "auto", True),
    "Q": ("G with the combine's un-sort by a gathered backward (DSV3_UNSORT_GATHER=1)", "bf16", "auto", "auto", 4,
          "auto", True),
    "R": ("G with the attention heads laid out [B,T,H,.] (DSV3_HEADS_BTHD=1)", "bf16", "auto", "auto", 4, "auto",
          True),
    "S": ("H with the Wgrad GEMMs writing the BF16 weights' gradients (DSV3_FP8_WGRAD_BF16=1)", "fp8", "auto", "auto",
          4, "auto", True),
    "T": ("H with the grouped GEMMs reading the quantiser's tile table in parts (DSV3_FP8_SHARED_TILES=1)", "fp8",
          "auto", "auto", 4, "auto", True),
}
HEAD_LOSS = {"N": "inplace"}   # train.head_loss of a variant; the others run the trainer's default, fused
MASTER = {"O": "split"}        # optim.master of a variant; the others: fp32
# Opt-in changes waiting for a GPU's verdict against G (``--variants pending``: G and these, in one process);
# a change that a GPU timed faster and right becomes the default, and its variant leaves this list.
PENDING = ("M", "N", "O", "P", "Q", "R")
# The same for the FP8 step, against H (``--variants pending-fp8``: H and these).
PENDING_FP8 = ("S", "T")
# Environment of a variant (kernels.quant.FUSED_ENV, TRANSPOSE_ENV, parallel.compile.CHECK_ENV), restored after it
ENV = {"J": {"DSV3_FUSED_QUANT": "1"}, "K": {"DSV3_FP8_TRANSPOSE": "0"}, "L": {"DSV3_COMPILE_CHECK": "1"},
       "M": {"DSV3_COMPILE_RESIDUAL": "1"}, "P": {"DSV3_GATHER_COPIES": "1"}, "Q": {"DSV3_UNSORT_GATHER": "1"},
       "R": {"DSV3_HEADS_BTHD": "1"}, "S": {"DSV3_FP8_WGRAD_BF16": "1"},
       "T": {"DSV3_FP8_SHARED_TILES": "1"}}


@contextlib.contextmanager
def variant_env(key: str):
    """The variant's environment (``ENV``) while inside; the earlier values back after."""
    saved = {k: os.environ.get(k) for k in ENV.get(key, {})}
    os.environ.update(ENV.get(key, {}))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def line(key: str, r: dict) -> list[str]:
    out = [f"{key} {VARIANTS[key][0]}: batch {r['batch']} step {r['step_s'] * 1e3:.1f} ms "
           f"(host {r['host_s'] * 1e3:.1f}) "
           f"MFU {r['mfu']:.1%} tok/s {r['tokens_per_s']:.0f} peak {r['peak_gb']:.1f} GB loss {r['loss']:.4f} "
           f"times {[round(t * 1e3, 1) for t in r['step_times_s']]}"]
    p = r.get("profile") or {}
    if p.get("top"):
        out.append(f"  GPU busy {p['busy_ms']:.1f} ms ({p['busy_fraction']:.0%}), launches {p['launches']}")
        out += [f"   {ms:8.2f} ms {n:5d} {share:6.1%} {name[:80]}" for name, n, ms, share in p["top"][:10]]
    if p.get("ops"):
        out.append("  ops by their kernels' GPU time (eager parts only; the JSON keeps 40):")
        out += [f"   {ms:8.2f} ms {n:5d} {op} {shapes} {where}" for op, shapes, where, n, ms in p["ops"][:15]]
    if p.get("copies"):
        total = sum(r[4] for r in p["copies"])
        out.append(f"  copies and casts ({total:.2f} ms in the JSON's {len(p['copies'])} rows):")
        out += [f"   {ms:8.2f} ms {n:5d} {shapes} {where}" for _, shapes, where, n, ms in p["copies"][:12]]
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    from bench.train_check import measure_step_fitting, reduced_config
    ap = argparse.ArgumentParser(prog="python -m bench.step_variants", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--variants", default="A,C,D,E",
                    help="comma-separated VARIANTS keys, or 'pending': G and every PENDING opt-in, or "
                         "'pending-fp8': H and every PENDING_FP8 opt-in")
    ap.add_argument("--deadline-s", type=float, default=300.0, help="start no variant after this many seconds")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="also cProfile one step per variant and print its N functions with the most own time")
    args = ap.parse_args(argv)
    pending = {"pending": ["G", *PENDING], "pending-fp8": ["H", *PENDING_FP8]}
    keys = pending.get(args.variants) or args.variants.split(",")
    unknown = [k for k in keys if k not in VARIANTS]
    if unknown:
        print(f"error: --variants: {', '.join(unknown)} not in {', '.join(VARIANTS)} (or 'pending')", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: bench.step_variants needs a CUDA device", file=sys.stderr)
        return 2
    cfg, deadline, res = reduced_config("v3_small", args.layers), time.monotonic() + args.deadline_s, {}
    for key in keys:
        label, precision, compile_mode, adamw, batch, moments, graph = VARIANTS[key]
        if time.monotonic() > deadline:
            print(f"{key} {label}: not run (deadline)")
            continue
        try:
            with variant_env(key):
                res[key] = measure_step_fitting(cfg, precision, batch, 2048, "cuda", iters=4 if batch == 4 else 2,
                                                profile=batch == 4, head_loss=HEAD_LOSS.get(key, "fused"),
                                                compile=compile_mode, adamw=adamw, host_profile=args.host_profile,
                                                moments=moments, cuda_graph=graph, master=MASTER.get(key, "fp32"))
            print("\n".join(line(key, res[key])), flush=True)
            if res[key]["host_profile"]:
                print(res[key]["host_profile"], flush=True)
        except Exception as e:   # noqa: BLE001 - report and go on to the next variant
            print(f"{key} {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
