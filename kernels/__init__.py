"""FP8 (E4M3) kernels for DeepSeek-V3-style training: blockwise quantisation and blockwise-scaled GEMMs.

Two interchangeable backends expose the same functions (see ``reference.py`` for the API):

- ``triton``: the Triton kernels in ``quant.py``, ``gemm.py`` and ``grouped_gemm.py``. On a machine
  without CUDA they run under the Triton interpreter (``TRITON_INTERPRET=1``, set by ``configure()``, which
  must run before those modules are imported: Triton reads the variable when it decorates a kernel) —
  slow, only for tests.
- ``emulation``: ``reference.py`` in plain torch: quantise exactly like the kernels (bit-identical
  FP8 bytes and scales), dequantise, matmul in FP32. Fast enough to train small models on CPU.

``get_ops("auto", device)`` picks ``triton`` on CUDA and ``emulation`` elsewhere. Importing this
package neither imports triton nor changes the environment; ``get_ops("triton")`` calls ``configure()``
and imports the kernels.

``hopper_gate.py`` compiles every kernel for Hopper (sm_90a) without a GPU, at the specialisations of its
production launches, and checks registers, spills, shared memory, wgmma and pipelined (TMA) loads:
``python -m kernels.hopper_gate`` prints the table; ``tests/test_hopper_gate.py`` asserts it.
"""
from __future__ import annotations

import functools
import os
import types

import torch

BACKENDS = ("auto", "triton", "emulation")


def configure(interpret: bool | None = None) -> bool:
    """Choose how the Triton kernels run; call it before importing ``quant``/``gemm``/``grouped_gemm``
    (importing triton itself first is fine). ``None``: keep a ``TRITON_INTERPRET`` the user set, else the
    interpreter exactly when CUDA is absent. Returns whether the kernels will be interpreted."""
    if interpret is not None:
        os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    elif "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    return interpreting()


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """``auto`` -> ``triton`` on CUDA, ``emulation`` otherwise; other names are checked and returned."""
    if backend not in BACKENDS:
        raise ValueError(f"fp8 backend {backend!r}: must be one of {BACKENDS}")
    if backend == "auto":
        return "triton" if torch.device(device).type == "cuda" else "emulation"
    return backend


def get_ops(backend: str, device: torch.device | str = "cpu"):
    """The op namespace of ``backend``: ``quant_act``, ``quant_act_t``, ``quant_weight``, ``gemm``,
    ``grouped_gemm``, ``grouped_wgrad`` (signatures in ``reference.py``)."""
    if resolve_backend(backend, device) == "emulation":
        from . import reference
        return reference
    return _triton_ops()


@functools.cache
def _triton_ops() -> types.SimpleNamespace:
    configure()
    from . import gemm, grouped_gemm, quant
    return types.SimpleNamespace(
        quant_act=quant.quant_act, quant_act_t=quant.quant_act_t, quant_weight=quant.quant_weight,
        gemm=gemm.gemm, grouped_gemm=grouped_gemm.grouped_gemm, grouped_wgrad=grouped_gemm.grouped_wgrad)
