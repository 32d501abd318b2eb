"""FP8-cached SwiGLU (``parallel.fp8.FP8CachedSwiGLU``, set by ``train.recompute=selective`` on FP8 MoE layers):
the forward is the plain SwiGLU's bit for bit; the backward equals autograd's through the FP8 round trip of
``h13 = [h1 | h3]`` (1×128 tiles); what it keeps for backward is that FP8 copy and its scales, nothing else."""
import copy
import math

import pytest
import torch

import models
from configs import model_preset
from kernels.reference import dequant, quant_act
from models.layers import SwiGLU
from parallel.fp8 import FP8CachedSwiGLU, apply_fp8
from parallel.recompute import apply_recompute, regions

from .dist_utils import rel_err


def _inputs(rows: int, cols: int, dtype=torch.float32):
    """``h13 [rows, 2*cols]`` (h1 and h3 of ``cols`` each) and ``dy [rows, cols]``."""
    g = torch.Generator().manual_seed(0)
    h13, dy = (torch.randn(rows, n, generator=g).mul(3).to(dtype) for n in (2 * cols, cols))
    return h13.requires_grad_(), dy


def _cached(backend="emulation", pow2=False) -> FP8CachedSwiGLU:
    act = FP8CachedSwiGLU()
    act.backend, act.pow2_scales = backend, pow2
    return act


def _qdq(h: torch.Tensor, pow2: bool) -> torch.Tensor:
    q, s = quant_act(h.detach().reshape(-1, h.shape[-1]), pow2)
    return dequant(q, s).view(h.shape)


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [128, 100])   # whole 1×128 tiles of h13, and a partial last tile
def test_forward_exact_backward_through_the_fp8_round_trip(cols, dtype, pow2):
    h13, dy = _inputs(96, cols, dtype)
    y = _cached(pow2=pow2)(h13)
    assert torch.equal(y, SwiGLU()(h13))                 # forward: the exact input
    (d13,) = torch.autograd.grad(y, h13, dy)
    # reference: autograd of silu(a) * b in FP32 at the FP8 round trip [a | b] of h13
    ab = _qdq(h13, pow2).requires_grad_()
    a, b = ab.chunk(2, dim=-1)
    (r13,) = torch.autograd.grad(torch.nn.functional.silu(a) * b, ab, dy.float())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(d13, r13.to(dtype), **tol)
    assert d13.dtype == dtype
    # and close to the exact gradients: E4M3 keeps 3 mantissa bits (relative rounding <= 2^-4 per element)
    (e13,) = torch.autograd.grad(SwiGLU()(h13), h13, dy)
    for d, e in zip(d13.chunk(2, dim=-1), e13.chunk(2, dim=-1)):
        assert 0 < rel_err(d, e) < 0.08


def test_keeps_only_fp8_copies_and_scales():
    rows, cols = 64, 200
    h13, dy = _inputs(rows, cols)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = _cached()(h13 * 1)   # a non-leaf input, as in a model
    assert sorted((str(t.dtype), tuple(t.shape)) for t in saved) == sorted(
        [("torch.float8_e4m3fn", (rows, 2 * cols)), ("torch.float32", (rows, math.ceil(2 * cols / 128)))])
    fp8_bytes = sum(t.numel() * t.element_size() for t in saved)
    assert fp8_bytes == 2 * rows * cols + rows * 4 * 4      # vs 2 * rows * cols * 4 in fp32
    y.backward(dy)
    assert h13.grad is not None


def test_no_grad_and_frozen_inputs_save_nothing():
    h13, _ = _inputs(8, 128)
    with torch.no_grad():
        assert torch.equal(_cached()(h13), SwiGLU()(h13))
    y = _cached()(h13.detach())
    assert y.grad_fn is None


def test_selective_sets_it_on_fp8_moe_layers_only():
    """Only MoE SwiGLUs (routed and shared experts) whose GEMMs are FP8 get it; a dense FP8 MLP's SwiGLU stays a
    checkpointed region (V3 caches the SwiGLU inputs of MoE); without FP8 none; full mode none."""
    base = models.build(model_preset("tiny"), seed=0).train()
    plain = copy.deepcopy(base)
    apply_recompute(plain, "selective")
    assert not any(isinstance(m, FP8CachedSwiGLU) for m in plain.modules())
    fp8 = copy.deepcopy(base)
    apply_fp8(fp8, backend="emulation", pow2_scales=True)
    full = copy.deepcopy(fp8)
    assert set(apply_recompute(fp8, "selective")) == set(regions(plain))    # the same regions, reported alike
    cached = {n: m for n, m in fp8.named_modules() if isinstance(m, FP8CachedSwiGLU)}
    assert cached and all(".ffn." in n or n.startswith("mtp.") for n in cached)
    assert all(m.backend == "emulation" and m.pow2_scales for m in cached.values())
    dense = [blk.ffn.act for blk in fp8.layers if not hasattr(blk.ffn, "gate")]
    assert dense and not any(isinstance(a, FP8CachedSwiGLU) for a in dense)
    apply_recompute(fp8, "selective")                                         # idempotent
    apply_recompute(full, "full")
    assert not any(isinstance(m, FP8CachedSwiGLU) for m in full.modules())
