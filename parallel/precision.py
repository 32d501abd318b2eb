"""``train.precision``, decoded once: what each of ``fp32``, ``bf16`` and ``fp8`` means for the model's weights,
the autocast dtype, the FP8 layers and the activations. The trainer, ``parallelize``, the optimizer and the
memory plan read a ``Precision``; nothing else decodes the string.

- ``fp32``: FP32 weights that are their own master, no autocast;
- ``bf16``: BF16 weights beside an FP32 master in the optimizer (``parallel/zero/master.py``), BF16 autocast;
- ``fp8``: as ``bf16``, plus FP8 GEMMs for the linears and routed experts (``parallel/fp8.py``), whose inputs
  are kept for the backward in FP8.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PRECISIONS = ("fp32", "bf16", "fp8")
WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}   # the model parameters' dtype, by name


@dataclass(frozen=True)
class Precision:
    name: str                          # one of PRECISIONS

    def __post_init__(self):
        if self.name not in PRECISIONS:
            raise ValueError(f"train.precision {self.name!r}: must be one of {', '.join(PRECISIONS)}")

    @property
    def weights(self) -> str:
        """The weights' dtype by name (``build_optimizer``'s ``weights``): FP32 weights are their own master;
        bf16 and fp8 (whose GEMMs quantise BF16 weights on the fly) keep BF16 weights and an FP32 master."""
        return "fp32" if self.name == "fp32" else "bf16"

    @property
    def weight_dtype(self) -> torch.dtype:
        return WEIGHT_DTYPES[self.weights]

    @property
    def autocast(self) -> torch.dtype | None:
        """The autocast dtype of forward and backward (None: no autocast)."""
        return None if self.name == "fp32" else torch.bfloat16

    @property
    def fp8(self) -> bool:
        """FP8 GEMMs for the linears and the routed experts (``parallel.fp8.apply_fp8``)."""
        return self.name == "fp8"

    @property
    def activation_bytes(self) -> int:
        """Bytes per saved activation element (before FP8 caches)."""
        return 4 if self.name == "fp32" else 2
