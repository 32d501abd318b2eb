"""FP8 linear / grouped experts (``parallel/fp8.py``): gradients vs FP32, backend parity, deferred Wgrad, the
converter, and (slow) 200 tiny-model steps in FP8 vs FP32.

Error bound: E4M3's RMS rounding error is ~0.025 per element, so an FP8 GEMM of two quantised operands carries
~sqrt(2)·0.025 = 0.036 relative error (y, dx and dW alike). We assert 0.01 < error < 0.06 (~1.7x the expected
value; the lower bound proves the path is FP8); BF16 must stay below 0.01."""
import copy
import importlib.util
import math
import types

import pytest
import torch
from torch import nn

import models
from models.moe import GroupedExperts
from parallel.fp8 import FP8GroupedExperts, FP8Linear, apply_fp8

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Triton vs emulation in FP32, one GEMM: the interpreter sums in FP32 (agreement ~1e-6); Hopper's FP8 tensor
# cores add each 128-product tile with fewer bits before the kernel promotes it, measured on an H100 at
# 1.1e-4 (FP32 out) to 6.7e-4 (BF16 out) vs the reference (kernels' self-checks), so 1e-3 there.
FP32_AGREE = 1e-3 if DEV == "cuda" else 1e-5
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def model_preset(name: str):
    """The model preset (configs/ reads YAML through omegaconf; the GPU suite carries it as a wheel). Imported
    here, not at the top, so that the kernel-level tests of this file collect without Hydra."""
    pytest.importorskip("omegaconf", reason="model presets need omegaconf (bench/gpu_wheels.sh carries it)")
    from configs import model_preset as preset
    return preset(name)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run_linear(module, x, dy, autocast=False):
    x = x.clone().requires_grad_()
    module.zero_grad()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        y = module(x)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, module.weight.grad.clone()


def make_linear(backend: str, out_f: int = 256, in_f: int = 384, seed: int = 0):
    torch.manual_seed(seed)
    base = nn.Linear(in_f, out_f, bias=False, device=DEV)
    nn.init.normal_(base.weight, std=0.02)
    return base, FP8Linear.from_linear(copy.deepcopy(base), backend)


def test_fp8_linear_gradients_within_quantisation_error():
    base, fp8 = make_linear("emulation")
    x, dy = torch.randn(512, 384, device=DEV), torch.randn(512, 256, device=DEV)
    want = run_linear(base, x, dy)
    got = run_linear(fp8, x, dy)
    bf16 = run_linear(base, x, dy, autocast=True)
    for name, g, w, b in zip(("y", "dx", "dW"), got, want, bf16):
        err = rel(g, w)
        print(f"{name}: fp8 {err:.4f}  bf16 {rel(b, w):.4f}")       # measured: see docs/fp8.md
        assert 0.01 < err < 0.06, (name, err)
        assert rel(b, w) < 0.01


@needs_triton
@pytest.mark.parametrize("autocast", [False, True])
def test_triton_linear_matches_emulation(autocast):
    """Same quantisation, only the summation differs: agreement to ~1e-6 on the CPU (``FP32_AGREE``)."""
    _, emu = make_linear("emulation", 192, 320)
    tri = FP8Linear.from_linear(copy.deepcopy(emu), "triton")
    x, dy = torch.randn(3, 100, 320, device=DEV), torch.randn(3, 100, 192, device=DEV)
    for g, w in zip(run_linear(tri, x, dy, autocast), run_linear(emu, x, dy, autocast)):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert rel(g, w) < (4e-3 if g.dtype == torch.bfloat16 else FP32_AGREE)
    y, dx, dw = run_linear(tri, x, dy, autocast)
    assert y.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert dx.dtype == torch.float32 and dw.dtype == torch.float32


def make_experts(counts):
    torch.manual_seed(0)
    E, D, F = len(counts), 200, 136
    base = GroupedExperts(E, D, F).to(DEV)
    base.init_weights(0.05)
    tpe = torch.tensor(counts, device=DEV)
    return base, tpe, torch.randn(int(tpe.sum()), D, device=DEV), torch.randn(int(tpe.sum()), D, device=DEV)


def run_experts(module, tpe, x, dy):
    x = x.clone().requires_grad_()
    module.zero_grad()
    fwd = module.forward_loop if type(module) is GroupedExperts else module
    y = fwd(x, tpe)
    y.backward(dy)
    return [y.detach(), x.grad] + [w.grad.clone() for w in (module.w13, module.w2)]


@needs_triton
def test_fp8_grouped_experts_match_fp32_and_triton_matches_emulation():
    base, tpe, x, dy = make_experts([0, 130, 5, 0, 300, 1])
    emu = FP8GroupedExperts.from_experts(copy.deepcopy(base), "emulation")
    tri = FP8GroupedExperts.from_experts(copy.deepcopy(base), "triton")
    want, got_emu, got_tri = (run_experts(m, tpe, x, dy) for m in (base, emu, tri))
    for name, w, e, t in zip(("y", "dx", "dw13", "dw2"), want, got_emu, got_tri):
        print(f"{name}: fp8 vs fp32 {rel(e, w):.4f}, triton vs emulation {rel(t, e):.1e}")
        # Chained GEMMs: an intermediate that differs in its last FP32 bit (summation order) may round to
        # the neighbouring E4M3 value when re-quantised, so agreement here is ~1e-5, not ~1e-7 (on a GPU the
        # first GEMM already differs by up to FP32_AGREE, and the re-quantised chain by a few times that). y sits
        # after the re-quantised SwiGLU product: here 3 of its 59,296 elements flip (an E4M3 step, 2^-3 of the
        # value each), which moves y by 7e-4 while every GEMM alone agrees to 3e-7.
        chained = 2e-3 if name == "y" else 5e-4
        assert rel(t, e) < (chained if DEV == "cpu" else 5 * FP32_AGREE), (name, rel(t, e))
        assert rel(e, w) < 0.09, (name, rel(e, w))    # two chained FP8 GEMMs + SwiGLU: ~0.05
    for grads in (got_emu, got_tri):
        assert all((g[0] == 0).all() and (g[3] == 0).all() for g in grads[2:])   # experts without tokens


@needs_triton
@pytest.mark.parametrize("kind", ["linear", "experts"])
def test_deferred_wgrad_is_bit_exact_on_triton(kind):
    """``parallel/wgrad.py``: B computes dx and queues the FP8 Wgrad GEMM, W runs it on the same FP8
    operands, so every gradient equals the non-deferred triton backward's bit for bit."""
    from parallel.wgrad import WeightGradQueue, apply_deferred_wgrad
    if kind == "linear":
        module = FP8Linear.from_linear(make_linear("emulation", 192, 320)[1], "triton")
        args, dy = (torch.randn(3, 50, 320, device=DEV),), torch.randn(3, 50, 192, device=DEV)
    else:
        base, tpe, x, dy = make_experts([0, 40, 5, 0, 90, 1])
        module, args = FP8GroupedExperts.from_experts(base, "triton"), (x, tpe)
    queue, deferred = WeightGradQueue(), copy.deepcopy(module)
    apply_deferred_wgrad(nn.ModuleList([deferred]), queue)
    assert deferred.wgrad_queue is queue and type(deferred) is type(module)
    results = []
    for m in (module, deferred):
        x = args[0].clone().requires_grad_()
        y = m(x, *args[1:])
        if m is module:
            y.backward(dy)
        else:
            queue.backward("mb", [y], [dy], [x], m.parameters())
            assert all(p.grad is None for p in m.parameters())
            queue.run("mb")
        results.append([y, x.grad] + [p.grad for p in m.parameters()])
    assert all(torch.equal(g, w) for g, w in zip(*results))


@needs_triton
@pytest.mark.parametrize("kind", ["linear", "experts"])
def test_wgrad_written_in_bf16_changes_no_bit(kind, monkeypatch):
    """``DSV3_FP8_WGRAD_BF16=1``: the Triton Wgrad GEMMs write a BF16 weight's gradient themselves (their integer
    round to nearest even of the FP32 accumulator) instead of FP32 and torch's cast: every gradient the same bits."""
    from parallel.fp8 import WGRAD_BF16_ENV
    if kind == "linear":
        module = FP8Linear.from_linear(make_linear("emulation", 192, 320)[1], "triton").to(torch.bfloat16)
        args, dy = (torch.randn(3, 50, 320, device=DEV),), torch.randn(3, 50, 192, device=DEV)
    else:
        base, tpe, x, dy = make_experts([0, 40, 5, 0, 90, 1])
        module, args = FP8GroupedExperts.from_experts(base.to(torch.bfloat16), "triton"), (x, tpe)
    results = []
    for env in ("0", "1"):
        monkeypatch.setenv(WGRAD_BF16_ENV, env)
        module.zero_grad()
        x = args[0].to(torch.bfloat16).requires_grad_()
        module(x, *args[1:]).backward(dy.to(torch.bfloat16))
        results.append([x.grad] + [p.grad for p in module.parameters()])
    assert all(g.dtype == torch.bfloat16 for g in results[1])
    assert all(torch.equal(g, w) for g, w in zip(*results))


# ------------------------------------------------------------------------------------------- converter
def tiny_model():
    return models.build(model_preset("tiny"), device=DEV, seed=0)


@needs_triton
@pytest.mark.parametrize("grouped", [False, True], ids=["linear", "experts"])
def test_one_quantiser_launch_for_both_copies_changes_no_byte(grouped):
    """Where Fprop and Wgrad (forward) or Dgrad and Wgrad (backward) both read a tensor, its two FP8 copies come
    from one ``quant_act_both`` call: y, dx and dW bit for bit what the two separate quantisers give (Triton
    quantisers, reference GEMMs). Where one copy is needed (frozen weight), the single quantiser runs."""
    import kernels
    kernels.configure()
    from kernels import quant
    from kernels import reference as ref
    from parallel.fp8 import _FP8GroupedLinearFn, _FP8LinearFn
    calls = []
    base = dict(quant_act=quant.quant_act, quant_act_t=quant.quant_act_t, quant_weight=ref.quant_weight,
                gemm=ref.gemm, grouped_gemm=ref.grouped_gemm, grouped_wgrad=ref.grouped_wgrad)
    fused = types.SimpleNamespace(**base,
                                  quant_act_both=lambda *a: calls.append(a[0].shape) or quant.quant_act_both(*a))
    separate = types.SimpleNamespace(**base, quant_act_both=lambda x, tpe, pow2: (*quant.quant_act(x, pow2),
                                                                                 *quant.quant_act_t(x, tpe, pow2)))
    g = torch.Generator().manual_seed(5)
    x, tpe = torch.randn(200, 256, generator=g).to(DEV), torch.tensor([70, 0, 130], device=DEV)
    w = (torch.randn(3, 136, 256, generator=g) if grouped else torch.randn(136, 256, generator=g)).to(DEV)
    dy = torch.randn(200, 136, generator=g).to(DEV)

    def run(ops, w_grad=True):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_(w_grad)
        y = (_FP8GroupedLinearFn.apply(xi, wi, tpe, ops, True, torch.float32, True) if grouped else
             _FP8LinearFn.apply(xi, wi, ops, True, torch.float32, True))
        y.backward(dy)
        return y, xi.grad, wi.grad
    want = run(separate)
    assert calls == []
    got = run(fused)
    assert calls == [(200, 256), (200, 136)]                     # x in the forward, dy in the backward
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    calls.clear()
    got = run(fused, w_grad=False)
    assert calls == [] and torch.equal(got[1], want[1]) and got[2] is None


def test_apply_fp8_swaps_by_name_and_keeps_parameters():
    model = tiny_model()
    params = dict(model.named_parameters())
    keys = set(model.state_dict())
    model.layers[2].ffn.experts.expert_offset = 4          # the EP shard offset (apply_ep) survives
    names = apply_fp8(model, backend="emulation")
    assert model.layers[2].ffn.experts.expert_offset == 4
    assert len(names) == 34                          # 5 layers x 4 MLA projections (wqkv_a, wq_b, wkv_b, wo), 1 dense
    #                                                  MLP (w13, w2), 4 x (shared w13, w2 + routed)
    assert "layers.0.ffn.w2" in names and "mtp.0.block.ffn.experts" in names
    assert "layers.1.ffn.shared_experts.w13" in names and "layers.3.attn.wkv_b" in names
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not isinstance(module, FP8Linear):
            assert name in ("head", "mtp.0.eh_proj"), name
        if name.endswith("ffn.gate"):
            assert type(module).__name__ == "Gate"
    assert isinstance(model.embed, nn.Embedding) and not isinstance(model.head, FP8Linear)
    assert all(p is params[n] for n, p in model.named_parameters())   # same Parameter objects
    assert set(model.state_dict()) == keys
    assert apply_fp8(model, backend="emulation", pow2_scales=True) == names   # idempotent
    assert model.layers[1].ffn.experts.pow2_scales
    with pytest.raises(ValueError, match="fp8 backend"):
        apply_fp8(model, backend="fp4")


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("pow2", [False, True], ids=["amax-scales", "pow2-scales"])
def test_fp8_model_forward_backward(autocast, pow2):
    base = tiny_model()
    model = copy.deepcopy(base)
    apply_fp8(model, backend="emulation", pow2_scales=pow2)
    g = torch.Generator().manual_seed(0)
    ids, lab = (torch.randint(0, 1024, (2, 64), generator=g).to(DEV) for _ in range(2))
    losses = []
    for m in (base, model):
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=autocast):
            out = m.compute_loss(ids, lab, mtp_weight=0.3, aux_alpha=1e-4)
            logits = m(ids)
        out.loss.backward()
        losses.append(out.loss.item())
        assert logits.dtype == (torch.bfloat16 if autocast else torch.float32)
        with torch.no_grad(), torch.autocast(DEV, dtype=torch.bfloat16, enabled=autocast):
            assert torch.equal(m(ids), logits)            # inference path (no FP8 cache) gives the same
    assert abs(losses[1] - losses[0]) / losses[0] < 2e-3, losses    # at init: ln(1024) ± FP8 noise
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.dtype == p.dtype == torch.float32


# ---------------------------------------------------------------------------- 200 steps, fp8 vs fp32
def train_curve(fp8: bool, steps: int, corpus, seq_len=32, batch=4, seed=0) -> tuple[list[float], float]:
    """Train the tiny preset in FP32 (the trainer's CPU recipe, minus logging; with ``fp8`` the linears' and
    experts' GEMMs in FP8 emulation); returns the per-step LM losses and the final validation loss (16 held-out
    sequences)."""
    from data import PackedBatches, val_batches
    model = models.build(model_preset("tiny"), seed=seed)
    model.train()
    if fp8:
        apply_fp8(model, backend="emulation")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95))
    warmup = 20
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warmup if s < warmup else
                                              0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup))))
    batches = PackedBatches(corpus.train_tokens, seq_len, batch, seed)
    losses = []
    for _ in range(steps):
        ids, lab = batches.next_batch()
        out = model.compute_loss(ids, lab, mtp_weight=0.3, aux_alpha=1e-4)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for moe in model.moe_layers():
                moe.update_bias(moe.tokens_per_expert.clone(), 1e-3)
                moe.tokens_per_expert.zero_()
        losses.append(out.lm_loss.item())
    model.eval()
    with torch.no_grad():
        val = [torch.nn.functional.cross_entropy(model(ids).float().flatten(0, 1), lab.flatten()).item()
               for ids, lab in val_batches(corpus.val_tokens, seq_len, 8, 2)]
    return losses, sum(val) / len(val)


@pytest.mark.slow
def test_fp8_emulation_tracks_fp32_over_200_steps(tmp_path):
    """FP8 vs FP32, means over three seeds (one seed's gap is within the seed-to-seed spread); measured -0.38 %
    validation, -0.20 % training loss of steps 181-200 (docs/fp8.md)."""
    from data import load_corpus
    cfg = types.SimpleNamespace(path=None, tokenizer=None, text_field="text", val_fraction=0.05,
                                cache_dir=str(tmp_path))
    corpus = load_corpus(cfg, 1024)
    mean = lambda xs: sum(xs) / len(xs)                             # noqa: E731
    runs = {(fp8, seed): train_curve(fp8, 200, corpus, seed=seed) for fp8 in (False, True) for seed in (0, 1, 2)}
    tail = {k: mean(losses[-20:]) for k, (losses, _) in runs.items()}
    val = {k: v for k, (_, v) in runs.items()}
    for seed in (0, 1, 2):
        print(f"seed {seed}: train loss, mean of steps 181-200: fp32 {tail[False, seed]:.4f} fp8 {tail[True, seed]:.4f}; "
              f"val loss: fp32 {val[False, seed]:.4f} fp8 {val[True, seed]:.4f}")
    val_ref, val_fp8 = (mean([val[f, s] for s in (0, 1, 2)]) for f in (False, True))
    tail_ref, tail_fp8 = (mean([tail[f, s] for s in (0, 1, 2)]) for f in (False, True))
    print(f"means: val {val_ref:.4f} vs {val_fp8:.4f} ({(val_fp8 - val_ref) / val_ref:+.3%}), "
          f"train {tail_ref:.4f} vs {tail_fp8:.4f} ({(tail_fp8 - tail_ref) / tail_ref:+.3%})")
    assert all(runs[False, s][0][0] > 6.5 for s in (0, 1, 2)) and val_ref < 6.0   # it learned (ln 1024 = 6.93)
    assert abs(val_fp8 - val_ref) / val_ref < 0.01
    assert abs(tail_fp8 - tail_ref) / tail_ref < 0.01
