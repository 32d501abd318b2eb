"""FP8 weight copies made once per step (``parallel.fp8.WeightFP8`` inside ``reuse_fp8_weights``): micro-batches
share one copy, the results are bit-identical to quantising at every forward, a change of the weight inside
the scope makes a fresh copy, and outside it nothing is cached (ZeRO writes weights through ``.data``)."""
import copy

import pytest
import torch

import kernels.reference as reference
from models.moe import GroupedExperts
from parallel.fp8 import FP8GroupedExperts, FP8Linear, reuse_fp8_weights

from .dist_utils import rel_err as rel


@pytest.fixture
def count_quant(monkeypatch):
    calls = []
    real = reference.quant_weight

    def counting(w, pow2=False, transpose=False):
        calls.append(transpose)
        return real(w, pow2, transpose=transpose)
    monkeypatch.setattr(reference, "quant_weight", counting)
    return calls


def _linear():
    torch.manual_seed(0)
    return FP8Linear.from_linear(torch.nn.Linear(256, 384, bias=False), backend="emulation")


def _step(mod, xs):
    outs = [mod(x) for x in xs]
    for y in outs:
        y.square().sum().backward()
    return [y.detach() for y in outs], mod.weight.grad.clone()


def test_micro_batches_share_one_copy_bit_identically(count_quant):
    mod = _linear()
    xs = [torch.randn(64, 256, generator=torch.Generator().manual_seed(i), requires_grad=True) for i in range(3)]
    saved = []
    with reuse_fp8_weights(mod), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        outs, grad = _step(mod, xs)
    assert count_quant == [True]                      # once, with the transposed copy Dgrad reads
    fp8_w = {t.untyped_storage().data_ptr() for t in saved if t.dtype == torch.float8_e4m3fn and t.shape == (256, 384)}
    assert len(fp8_w) == 1                            # the three micro-batches saved the same weight copy
    assert mod.weight_fp8.value is None and not mod.weight_fp8.active   # dropped on exit
    want, want_grad = _step(_linear(), [x.detach().requires_grad_() for x in xs])   # outside: every forward
    assert len(count_quant) == 4
    assert all(torch.equal(a, b) for a, b in zip(outs, want)) and torch.equal(grad, want_grad)


def test_a_change_inside_makes_a_fresh_copy_and_outside_nothing_is_kept(count_quant):
    mod, x = _linear(), torch.randn(32, 256)
    with reuse_fp8_weights(mod):
        mod(x)
        with torch.no_grad():
            mod.weight.add_(0.01)                     # an in-place update: a new version
        y = mod(x)
        assert len(count_quant) == 2
        mod.weight.data = mod.weight.data.to(torch.bfloat16)   # a cast to new storage
        mod(x.bfloat16())
        mod(x.bfloat16())
        assert len(count_quant) == 3
        mod(x.bfloat16().requires_grad_())            # Dgrad wanted now: the transposed copy is added once
        mod(x.bfloat16().requires_grad_())
        assert count_quant[3:] == [True]
    ref = _linear()
    with torch.no_grad():
        ref.weight.add_(0.01)
    assert torch.equal(y, ref(x))
    mod.weight.data[0, 0] += 1.0                      # a write through .data (ZeRO's gather): no version bump
    n = len(count_quant)
    mod(x.bfloat16())
    mod(x.bfloat16())
    assert len(count_quant) == n + 2                  # outside the scope every call quantises


def test_grouped_experts_and_copies(count_quant):
    experts = FP8GroupedExperts.from_experts(GroupedExperts(4, 128, 128), backend="emulation")
    for w in (experts.w13, experts.w2):
        torch.nn.init.normal_(w, std=0.02)
    model = torch.nn.ModuleDict({"lin": _linear(), "experts": experts})
    tpe = torch.tensor([8, 0, 16, 8])
    xs = [torch.randn(32, 128, generator=torch.Generator().manual_seed(i), requires_grad=True) for i in range(2)]
    with reuse_fp8_weights(model):
        ys = [model["experts"](x, tpe) for x in xs]
        assert len(count_quant) == 2 and all(c.value is not None for c in experts.weight_fp8.values())
        twin = copy.deepcopy(model)                   # a copy starts with nothing cached, outside the scope
        assert all(c.value is None and not c.active for c in twin["experts"].weight_fp8.values())
        sum(y.sum() for y in ys).backward()
    assert all(c.value is None for c in experts.weight_fp8.values())
    plain = [twin["experts"](x.detach().requires_grad_(), tpe) for x in xs]
    assert all(torch.equal(a, b) for a, b in zip(ys, plain))


def test_experts_quantise_their_input_once_for_w13(monkeypatch):
    """``FP8GroupedExperts``: gate and up are one weight, ``w13``, so one grouped GEMM reads one FP8 copy of the
    dispatched rows (one Wgrad copy kept); with F a multiple of 128 its weight blocks are those of w1 and w3, and
    its two halves equal the GEMMs of w1 and w3 apart (to FP32 rounding)."""
    from parallel.fp8 import fp8_grouped_linear
    calls = []
    real = reference.quant_act_t
    monkeypatch.setattr(reference, "quant_act_t", lambda x, tpe=None, pow2=False: calls.append(x.shape) or real(x, tpe, pow2))
    experts = FP8GroupedExperts.from_experts(GroupedExperts(4, 128, 256), backend="emulation")
    for w in (experts.w13, experts.w2):
        torch.nn.init.normal_(w, std=0.02)
    tpe = torch.tensor([40, 0, 100, 60])
    x = torch.randn(200, 128, generator=torch.Generator().manual_seed(3), requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = experts(x, tpe)
    assert calls == [(200, 128), (200, 256)]          # x once (w13), the product once (w2)
    x_copies = {t.untyped_storage().data_ptr() for t in saved if t.dtype == torch.float8_e4m3fn and t.shape[0] == 128}
    assert len(x_copies) == 1
    y.square().sum().backward()
    ref_x = x.detach().requires_grad_()
    args = (tpe, "emulation")
    w1, w3 = (w.detach().clone().requires_grad_() for w in experts.w13.chunk(2, dim=1))
    w2 = experts.w2.detach().clone().requires_grad_()
    h = torch.cat([fp8_grouped_linear(ref_x, w1, *args), fp8_grouped_linear(ref_x, w3, *args)], dim=-1)
    want = fp8_grouped_linear(experts.act(h), w2, *args)
    want.square().sum().backward()
    assert rel(y, want) < 1e-6
    for got, ref in ((x.grad, ref_x.grad), (experts.w13.grad, torch.cat([w1.grad, w3.grad], dim=1)),
                     (experts.w2.grad, w2.grad)):
        assert rel(got, ref) < 1e-6