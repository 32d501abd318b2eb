"""The optimizer part of a BF16-weights step on one GPU, the two paths of ``parallel.zero.Replicated``:
``python -m bench.adamw_step [--params 1e9] [--tensors 40]``.

- ``torch``: the FP32 copy of each BF16 gradient, ``clip_grad_norm_`` (norm + foreach multiply),
  ``torch.optim.AdamW(fused=True)``, the master cast into the BF16 weights (``_foreach_copy_``);
- ``kernel``: the norm over the BF16 gradients (FP64 accumulation), the clip coefficient on the device, one
  Triton AdamW launch per tensor writing the BF16 weight (``kernels/adamw.py``).

Prints ms per step (CUDA events, median of 10 after 3 warm-ups) and the bytes each path must move at least.
"""
from __future__ import annotations

import argparse
import statistics

import torch


def _time(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main(argv=None) -> int:
    from kernels import adamw
    ap = argparse.ArgumentParser(prog="python -m bench.adamw_step")
    ap.add_argument("--params", type=float, default=1e9)
    ap.add_argument("--tensors", type=int, default=40)
    ap.add_argument("--block", type=int, default=None)
    a = ap.parse_args(argv)
    n = int(a.params) // a.tensors
    dev = torch.device("cuda")
    master = [torch.randn(n, device=dev) for _ in range(a.tensors)]
    weights = [m.bfloat16() for m in master]
    grads = [torch.randn(n, device=dev, dtype=torch.bfloat16) for _ in range(a.tensors)]
    params = [torch.nn.Parameter(m) for m in master]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    state = [(torch.zeros_like(m), torch.zeros_like(m)) for m in master]

    def torch_path():
        for p, g in zip(params, grads):
            p.grad = g.float()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        torch._foreach_copy_(weights, master)

    def kernel_path():
        norm = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).square().sum().sqrt()
        coef = (1.0 / (norm + 1e-6)).clamp(max=1.0).float()
        for m, g, (e, v), w in zip(master, grads, state, weights):
            adamw.triton_adamw_(m, g, e, v, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=5,
                                coef=coef, out=w, block=a.block)

    total = n * a.tensors
    print(f"{total / 1e9:.2f}B parameters in {a.tensors} tensors, BF16 gradients and weights, FP32 master and moments")
    print(f"adamw self-check: {'passed' if adamw.usable(dev) else 'FAILED'}")
    k = _time(kernel_path)
    print(f"kernel: {k:.2f} ms (floor at 3 TB/s: {total * (2 + 2 + 8 + 16 + 2) / 3e12 * 1e3:.2f} ms)")
    t = _time(torch_path)
    print(f"torch:  {t:.2f} ms")
    print(f"scaled to 2.16B parameters: kernel {k * 2.16e9 / total:.1f} ms, torch {t * 2.16e9 / total:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
