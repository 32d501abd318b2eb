"""FP8 (E4M3) kernels for DeepSeek-V3-style training: blockwise quantisation and blockwise-scaled GEMMs.

Backends expose the same functions (see ``reference.py`` for the API):

- ``triton``: the Triton kernels in ``quant.py``, ``gemm.py`` and ``grouped_gemm.py``. On a machine
  without CUDA they run under the Triton interpreter (``TRITON_INTERPRET=1``, set by ``configure()``, which
  must run before those modules are imported: Triton reads the variable when it decorates a kernel) —
  slow, only for tests. Every default launch variant is self-checked on its device (``selfcheck.py``).
- ``torch``: cuBLASLt's blockwise ``scaled_mm`` for dense GEMMs (``torch_gemm.py``, sm_90) and the reference
  quantisers; the grouped ops raise (torch has no blockwise-scaled grouped GEMM).
- ``emulation``: ``reference.py`` in plain torch: quantise exactly like the kernels (bit-identical
  FP8 bytes and scales), dequantise, matmul in FP32. Fast enough to train small models on CPU.
- ``auto``: on CUDA, per op the fastest engine that passed its self-check on the device (``auto.py``); elsewhere
  ``emulation``.

Importing this package neither imports triton nor changes the environment; the triton, torch and auto
namespaces call ``configure()`` and import the kernels. ``hopper_gate.py`` checks what the kernels compile to on
Hopper, without a GPU.
"""
from __future__ import annotations

import functools
import os
import types

import torch

BACKENDS = ("auto", "triton", "torch", "emulation")
# "1": the Wgrad GEMMs write a BF16 weight's gradient themselves (parallel/fp8.py), instead of FP32 and a cast after
# them; the same bits. Opt-in until a GPU has timed it; the grouped Wgrad's self-check covers BF16 out only then.
WGRAD_BF16_ENV = "DSV3_FP8_WGRAD_BF16"


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
    """``auto`` -> ``auto`` on CUDA, ``emulation`` otherwise; other names are checked and returned."""
    if backend not in BACKENDS:
        raise ValueError(f"fp8 backend {backend!r}: must be one of {BACKENDS}")
    if backend == "auto" and torch.device(device).type != "cuda":
        return "emulation"
    return backend


def get_ops(backend: str, device: torch.device | str = "cpu"):
    """The op namespace of ``backend`` on ``device``: ``quant_act``, ``quant_act_t``, ``quant_act_both``,
    ``quant_weight``, ``gemm``, ``grouped_gemm``, ``grouped_wgrad`` (signatures in ``reference.py``)."""
    name = resolve_backend(backend, device)
    if name == "emulation":
        from . import reference
        return reference
    if name == "triton":
        return triton_ops()
    if name == "torch":
        return _torch_ops()
    return _auto_ops(_device_key(device))


def _device_key(device: torch.device | str) -> torch.device:
    dev = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" and dev.index is None else dev


@functools.cache
def triton_ops() -> types.SimpleNamespace:
    """The Triton kernels; a quantiser that is not bit-exact vs the reference on a device gives way there (one
    warning) to the next that is (``quant_act_t``: its transposed composition; ``quant_act_both``: this
    namespace's two separate quantisers), else to the reference's; GEMMs run their self-checked default launch
    variant."""
    configure()
    from . import auto, gemm, grouped_gemm, quant, reference

    def checked(op):
        chain = [("triton", getattr(quant, op))]
        if op == "quant_act_t":
            chain.append(("transposed", quant.quant_act_t_transposed))
        fallback = getattr(reference, op)

        @functools.wraps(chain[0][1])
        def run(x, *args, **kwargs):
            if x.device.type == "meta":
                return chain[0][1](x, *args, **kwargs)
            fn = next((f for v, f in chain if auto.triton_quant_exact(op, x.device, f, v)), fallback)
            return fn(x, *args, **kwargs)
        return run

    quant_act, quant_act_t = checked("quant_act"), checked("quant_act_t")

    @functools.wraps(quant.quant_act_both)
    def quant_act_both(x, tokens_per_expert=None, pow2=False):
        if x.device.type == "meta" or (quant.fused_enabled(x.device)
                                       and auto.triton_quant_exact("quant_act_both", x.device)):
            return quant.quant_act_both(x, tokens_per_expert, pow2)
        return (*quant_act(x, pow2), *quant_act_t(x, tokens_per_expert, pow2))

    return types.SimpleNamespace(
        quant_act=quant_act, quant_act_t=quant_act_t, quant_act_both=quant_act_both,
        quant_weight=checked("quant_weight"), gemm=gemm.gemm, grouped_gemm=grouped_gemm.grouped_gemm,
        grouped_wgrad=grouped_gemm.grouped_wgrad)


@functools.cache
def _torch_ops() -> types.SimpleNamespace:
    from . import reference, torch_gemm

    def grouped(*args, **kwargs):
        raise NotImplementedError(
            f"fp8 backend 'torch': torch {torch.__version__} has no blockwise-scaled grouped GEMM; use "
            f"backend 'auto' (Triton grouped kernels) or 'triton'")
    return types.SimpleNamespace(quant_act=reference.quant_act, quant_act_t=reference.quant_act_t,
                                 quant_act_both=reference.quant_act_both,
                                 quant_weight=reference.quant_weight, gemm=torch_gemm.gemm,
                                 grouped_gemm=grouped, grouped_wgrad=grouped)


@functools.cache
def _auto_ops(device: torch.device):
    from .auto import AutoOps, cuda_engines
    return AutoOps(device, cuda_engines())
