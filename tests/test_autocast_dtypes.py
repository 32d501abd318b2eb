"""The activations' dtypes under CUDA's autocast policy, checked on the CPU.

CUDA's autocast runs some ops in FP32 that CPU's autocast leaves alone: a reduction without an explicit ``dtype``
(``sum``, ``cumsum``, ``softmax``, ...) returns FP32, and the pointwise ops of its FP32 list (``pow``, ``rsqrt``,
``exp``, ...) upcast their inputs. One such ``sum`` in the MoE combine once made the residual stream FP32 from the
first MoE layer on, on the GPU only: every norm, linear input and residual gradient at twice the bytes and a cast
before each GEMM (an H100 profile found it; no CPU run could). ``CudaAutocastPolicy`` applies those rules to a CPU
run (``tools.cuda_autocast``), so the test below sees the dtypes a GPU run has.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import models
from configs import model_preset
from models.layers import RMSNorm
from models.moe import GroupedExperts
from parallel.fp8 import apply_fp8
from parallel.zero.master import cast_
from tools.cuda_autocast import CudaAutocastPolicy


def _dtypes_seen(policy: bool, fp8: bool) -> dict[str, set]:
    """The input dtypes of every norm, linear and routed-experts module of a BF16 (or FP8: ``parallel.fp8``'s
    linears and experts) ``tiny`` model's training forward and loss."""
    torch.manual_seed(0)
    cfg = model_preset("tiny")
    model = models.build(cfg, seed=0)
    if fp8:
        apply_fp8(model)
    cast_(list(model.parameters()), torch.bfloat16)
    model.train()
    seen: dict[str, set] = {"norm": set(), "linear": set(), "experts": set()}
    for m in model.modules():
        kind = "norm" if isinstance(m, RMSNorm) else "linear" if isinstance(m, nn.Linear) else \
            "experts" if isinstance(m, GroupedExperts) else None
        if kind:
            m.register_forward_pre_hook(lambda mod, a, kind=kind: seen[kind].add(a[0].dtype))
    ids = torch.randint(0, cfg.vocab_size, (2, 33))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if policy:
            with CudaAutocastPolicy():
                out = model.compute_loss(ids[:, :-1], ids[:, 1:], mtp_weight=0.3, aux_alpha=1e-4)
        else:
            out = model.compute_loss(ids[:, :-1], ids[:, 1:], mtp_weight=0.3, aux_alpha=1e-4)
    assert torch.isfinite(out.loss)
    return seen


def test_the_policy_upcasts_what_cuda_autocast_upcasts():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), CudaAutocastPolicy():
        assert x.sum(1).dtype == torch.float32
        assert torch.sum(x, 1).dtype == torch.float32
        assert x.sum(1, dtype=torch.bfloat16).dtype == torch.bfloat16
        assert x.pow(2).dtype == torch.float32
        assert torch.softmax(x, -1).dtype == torch.float32
        assert (x * x).dtype == torch.bfloat16
        assert x.float().sum().dtype == torch.float32
        with torch.autocast("cpu", enabled=False):   # autocast off: nothing changes
            assert x.sum(1).dtype == torch.bfloat16
    with CudaAutocastPolicy():
        assert x.sum(1).dtype == torch.bfloat16


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_bf16_activations_stay_bf16_under_cuda_autocast(fp8):
    """Every norm, linear and routed-experts module of a BF16 or FP8 run gets BF16 inputs, under CPU's autocast and
    under CUDA's rules: the residual stream is in the weights' dtype on every device."""
    for policy in (False, True):
        seen = _dtypes_seen(policy, fp8)
        assert seen == {"norm": {torch.bfloat16}, "linear": {torch.bfloat16}, "experts": {torch.bfloat16}}, \
            (policy, seen)
