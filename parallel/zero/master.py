"""BF16 weights with an FP32 master copy (``train.precision=bf16|fp8``; Megatron-Core's and DeepSeek-V3's
mixed precision, report §3.3).

The model computes with BF16 parameters; the optimizer holds the FP32 truth of every parameter (its master
copy: all of it without ZeRO, this rank's pieces under ZeRO), updates only that, and casts the result into
the BF16 weights. The optimizer is built on the model while its weights are still FP32 (after
``checkpoint.init_from``): it keeps those values as the master and only then casts the parameters
(``cast_``), so a run starts from exactly the FP32 values it was given, not their BF16 rounding.

Gradients leave autograd in the parameters' dtype, one backward at a time. ``FP32Grads`` adds each into an
FP32 accumulator from a post-accumulate-grad hook and frees the BF16 one, so the micro-batches of a step
(and the pieces of a pipeline backward) are summed in FP32, never in BF16.
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
    """FP32 gradient accumulators of low-precision parameters, keyed by parameter: a post-accumulate-grad
    hook adds ``p.grad`` (this backward's gradient) into ``grads[p]`` and frees it. ``paused`` leaves
    ``p.grad`` alone (ZeRO-2's backward path reduce-scatters each micro-batch's gradient into FP32 itself)."""

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
            self.grads[p] = p.grad.float()
        else:
            acc.add_(p.grad)
        p.grad = None

    def get(self, p: nn.Parameter, fill: bool = False) -> torch.Tensor | None:
        """``p``'s FP32 gradient so far; with ``fill`` zeros (kept) when it has none yet."""
        acc = self.grads.get(p)
        if acc is None and fill:
            acc = self.grads[p] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        return acc

    def pop(self, p: nn.Parameter) -> torch.Tensor | None:
        return self.grads.pop(p, None)

    def clear(self) -> None:
        self.grads.clear()
