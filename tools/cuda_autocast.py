"""CUDA's autocast rules where they differ from CPU's, applied to a CPU run: ``CudaAutocastPolicy``.

Under ``torch.autocast("cuda")`` a reduction called without a ``dtype`` (``sum``, ``cumsum``, ``softmax``, ...)
returns FP32, and the ops of CUDA's FP32 list (``pow``, ``rsqrt``, ``exp``, ...) upcast their BF16/FP16 inputs;
CPU's autocast does neither. A CPU run therefore shows BF16 where a GPU run has FP32: a ``sum`` without a dtype in
the MoE combine once made the GPU's residual stream FP32 from the first MoE layer on, which no CPU test saw and
the roofline did not predict. Entered inside a CPU autocast (a ``TorchFunctionMode``: it sees the calls made from
Python, not those inside an op), it gives a CPU run the dtypes a GPU run has: ``tools.roofline`` records the step
under it, and ``tests/test_autocast_dtypes.py`` holds the model's activations to BF16 under it.
Lists: ``aten/src/ATen/autocast_mode.h`` (``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``), the ops among them
that the model, loss and optimizer call.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

SET_OPT_DTYPE = frozenset({"sum", "prod", "cumsum", "cumprod", "softmax", "log_softmax"})   # FP32 unless given a dtype
TO_FP32 = frozenset({"pow", "rsqrt", "exp", "log", "log1p", "expm1", "reciprocal", "logsumexp"})   # inputs upcast
LOW = (torch.bfloat16, torch.float16)


class CudaAutocastPolicy(TorchFunctionMode):
    """``SET_OPT_DTYPE`` and ``TO_FP32`` as CUDA's autocast runs them, for BF16/FP16 tensors on any device, while
    an autocast is enabled on the CPU (outside one, or inside ``autocast(enabled=False)``, nothing changes)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if torch.is_autocast_enabled("cpu"):
            name = getattr(func, "__name__", "")
            if any(isinstance(a, torch.Tensor) and a.dtype in LOW for a in args):
                if name in SET_OPT_DTYPE and kwargs.get("dtype") is None:
                    kwargs["dtype"] = torch.float32
                elif name in TO_FP32:
                    args = tuple(a.float() if isinstance(a, torch.Tensor) and a.dtype in LOW else a for a in args)
        return func(*args, **kwargs)
