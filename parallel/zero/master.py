"""BF16 weights with an FP32 master copy (``train.precision=bf16|fp8``; Megatron-Core's and DeepSeek-V3's
mixed precision, report §3.3).

The model computes with BF16 parameters; the optimizer holds the FP32 truth of every parameter (its master
copy: all of it without ZeRO, this rank's pieces under ZeRO), updates only that, and casts the result into
the BF16 weights. The optimizer is built on the model while its weights are still FP32 (after
``checkpoint.init_from``): it keeps those values as the master and only then casts the parameters
(``cast_``), so a run starts from exactly the FP32 values it was given, not their BF16 rounding.

Gradients leave autograd in the parameters' dtype, one backward at a time. ``FP32Grads`` takes each from a
post-accumulate-grad hook: the first as it is (a step of one micro-batch needs no FP32 copy: the optimizer reads
the BF16 gradient, ``kernels/adamw.py``), and from the second on it adds them into an FP32 accumulator, so the
micro-batches of a step (and the pieces of a pipeline backward) are summed in FP32, never in BF16.
"""
from __future__ import annotations

import torch
from torch import nn

from ..precision import WEIGHT_DTYPES   # build_optimizer's ``weights``: the dtype names Precision.weights gives


@torch.no_grad()
def cast_(params: list[nn.Parameter], dtype: torch.dtype) -> None:
    """Cast parameters in place (same ``Parameter`` objects, new storage); their old FP32 storage lives on
    only where the caller kept a reference (the master)."""
    for p in params:
        p.data = p.data.to(dtype)


class FP32Grads:
    """Gradients of low-precision parameters, keyed by parameter: a post-accumulate-grad hook takes ``p.grad``
    (this backward's gradient) into ``grads[p]`` and frees it. The first is kept in the parameter's dtype; a
    second turns the entry into an FP32 accumulator (the first converted exactly) and adds into it. ``get``
    hands out FP32 (converting a kept one in place); ``pop`` hands over what is held. ``paused`` leaves ``p.grad``
    alone (ZeRO-2's backward path reduce-scatters each micro-batch's gradient into FP32 itself)."""

    def __init__(self, params: list[nn.Parameter]):
        self.grads: dict[nn.Parameter, torch.Tensor] = {}
        self.paused = False
        for p in params:
            p.register_post_accumulate_grad_hook(self._add)

    @torch.no_grad()
    def _add(self, p: nn.Parameter) -> None:
        if self.paused or p.grad is None:
            return
        acc = self.grads.get(p)
        if acc is None:
            self.grads[p] = p.grad
        else:
            if acc.dtype != torch.float32:
                acc = self.grads[p] = acc.float()
            acc.add_(p.grad)
        p.grad = None

    def get(self, p: nn.Parameter, fill: bool = False) -> torch.Tensor | None:
        """``p``'s gradient so far in FP32 (what the pipeline's replica sums add into); with ``fill`` zeros (kept)
        when it has none yet."""
        acc = self.grads.get(p)
        if acc is None and fill:
            acc = self.grads[p] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        elif acc is not None and acc.dtype != torch.float32:
            acc = self.grads[p] = acc.float()
        return acc

    def pop(self, p: nn.Parameter) -> torch.Tensor | None:
        """``p``'s gradient so far, removed: in the parameter's dtype after one backward, else FP32."""
        return self.grads.pop(p, None)

    def clear(self) -> None:
        self.grads.clear()
