"""Single-device model: structure rules, causality, MTP, YaRN, preset sizes."""
import ast
from pathlib import Path

import pytest
import torch

from configs import model_preset
from models import ModelConfig, build
from models.params import count_params

ROOT = Path(__file__).resolve().parents[1]


def test_models_never_import_torch_distributed():
    offenders = []
    for path in (ROOT / "models").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n == "torch.distributed" or n.startswith("torch.distributed.") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"models/ must stay single-device: {offenders}"


@pytest.mark.parametrize("q_lora", [0, 32])
def test_causal(q_lora):
    cfg = ModelConfig(q_lora_rank=q_lora, n_expert_groups=4, n_limited_groups=2, mtp_depth=1)
    model = build(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 20))
    ids2 = ids.clone()
    ids2[:, 12:] = torch.randint(0, cfg.vocab_size, (2, 8))
    a, b = model(ids), model(ids2)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-6)
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 1e-3


def test_mtp_loss_definition():
    """MTP depth 1 predicts the token two ahead from h_i and Emb(t_{i+1}) with the shared head."""
    cfg = ModelConfig(mtp_depth=2, n_layers=2)
    model = build(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 17))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    out = model.compute_loss(inputs, labels, mtp_weight=0.3)
    h = model.hidden(inputs)
    from models.layers import rope_cos_sin
    ce = []
    T = inputs.shape[1]
    for k, mod in enumerate(model.mtp, start=1):
        h = mod(h[:, :T - k], model.embed(inputs[:, k:]), rope_cos_sin(cfg, T - k, h.device))
        logits = model.head(mod.norm(h))
        ce.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, k + 1:].flatten()))
    torch.testing.assert_close(out.mtp_loss, torch.stack(ce).mean().detach())
    torch.testing.assert_close(out.loss.detach(), out.lm_loss + 0.3 * out.mtp_loss + out.aux_loss)
    # MTP shares embedding and head: no separate copies.
    assert not any("embed" in n or n.endswith("head.weight") for n, _ in model.mtp.named_parameters())
    out.loss.backward()
    assert model.mtp[1].eh_proj.weight.grad.abs().sum() > 0


def test_mtp_reads_the_main_models_embeddings_from_one_lookup():
    """The MTP modules read the embeddings the main model looked up (one lookup, one embedding backward): the
    loss and gradients of a lookup per depth."""
    import copy
    from models.layers import rope_cos_sin
    F = torch.nn.functional
    cfg = ModelConfig(mtp_depth=2, n_layers=2)
    model = build(cfg).train()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    inputs, labels, T = ids[:, :-1], ids[:, 1:], 16
    lookups = []
    model.embed.register_forward_hook(lambda m, i, o: lookups.append(tuple(o.shape)))
    model.compute_loss(inputs, labels, mtp_weight=0.3).loss.backward()
    assert lookups == [(2, T, cfg.dim)]
    h = ref.hidden(inputs)
    loss, ce = F.cross_entropy(ref.head(ref.norm(h)).flatten(0, 1), labels.flatten()), []
    for k, mod in enumerate(ref.mtp, start=1):
        h = mod(h[:, :T - k], ref.embed(inputs[:, k:]), rope_cos_sin(cfg, T - k, h.device))
        ce.append(F.cross_entropy(ref.head(mod.norm(h)).flatten(0, 1), labels[:, k:].flatten()))
    (loss + 0.3 * torch.stack(ce).mean()).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_initial_loss_is_about_ln_vocab():
    cfg = ModelConfig()
    model = build(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (4, 33))
    loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    assert abs(loss.item() - torch.log(torch.tensor(1024.0)).item()) < 0.1


def test_yarn_scales_softmax_and_changes_low_frequencies():
    from models.layers import rope_inv_freq
    base = ModelConfig(qk_rope_head_dim=16, original_max_seq_len=64)
    yarn = ModelConfig(qk_rope_head_dim=16, original_max_seq_len=64, rope_factor=4.0)
    f0, s0 = rope_inv_freq(base)
    f1, s1 = rope_inv_freq(yarn)
    assert s0 == s1 == 1.0  # mscale == mscale_all_dim: cos/sin unscaled, softmax scale carries mscale^2
    assert f1[0] == f0[0]                                    # highest frequency kept (extrapolated)
    torch.testing.assert_close(f1[-1], f0[-1] / 4)           # lowest frequency interpolated by the factor
    from models.attention import MLA
    ratio = MLA(yarn).softmax_scale / MLA(base).softmax_scale
    assert ratio == pytest.approx((0.1 * torch.log(torch.tensor(4.0)).item() + 1) ** 2)


def test_bf16_autocast_forward_backward():
    cfg = ModelConfig(mtp_depth=1, n_expert_groups=4, n_limited_groups=2)
    model = build(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.compute_loss(ids, ids, mtp_weight=0.3, aux_alpha=1e-4)
    out.loss.backward()
    assert torch.isfinite(out.loss) and all(p.grad is not None for p in model.parameters())


def test_v3_671b_size_on_meta():
    model = build(model_preset("v3_671b"), "meta")
    assert all(p.is_meta for p in model.parameters())
    c = count_params(model)
    assert abs(c.total - 671e9) / 671e9 < 0.005
    assert 36.5e9 < c.activated < 38e9        # report: ~37B (counting rule in models/params.py)
    assert 11e9 < c.mtp < 12e9                # report: MTP adds ~11.5B unique parameters


@pytest.mark.parametrize("name,lo,hi", [("tiny", 1e6, 3e6), ("v3_small", 1e9, 3e9), ("v3_16b", 15e9, 17e9)])
def test_presets_build_on_meta(name, lo, hi):
    cfg = model_preset(name)
    c = count_params(build(cfg, "meta"))
    assert lo < c.total < hi
    if name != "tiny":
        assert cfg.n_routed_experts >= 64 and cfg.n_expert_groups == 8 and cfg.n_limited_groups < 8


def test_size_tool_prints_v3_small(capsys):
    from tools.size import main
    assert main(["+exp=v3_small"]) == 0
    out = capsys.readouterr().out
    assert "total (no MTP)" in out and "2,003,142,656" in out and "activated per token" in out


def test_the_heads_laid_out_bthd_are_the_default_heads_values():
    """``query_heads_bthd`` / ``key_value_heads_bthd`` (opt-in, ``parallel.compile.HEADS_ENV``): the default heads'
    values and the inputs' gradients bit for bit, FP32 and BF16, laid out ``[B,T,H,.]`` in memory (each returned
    as its ``[B,H,T,.]`` view), so that ``MLA.core`` flattens an output laid out like them without a copy."""
    from models.attention import key_value_heads, key_value_heads_bthd, query_heads, query_heads_bthd
    g = torch.Generator().manual_seed(0)
    B, T, H, N, R, V = 2, 5, 3, 4, 6, 4
    cos, sin = torch.randn(T, R // 2, generator=g), torch.randn(T, R // 2, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        q_in = torch.randn(B, T, H * (N + R), generator=g).to(dtype)
        kv_in = torch.randn(B, T, H * (N + V), generator=g).to(dtype)
        pe_in = torch.randn(B, T, R, generator=g).to(dtype)
        runs = []
        for qh, kvh in ((query_heads, key_value_heads), (query_heads_bthd, key_value_heads_bthd)):
            a, b, c = (t.clone().requires_grad_() for t in (q_in, kv_in, pe_in))
            q, (k, v) = qh(a, cos, sin, H, N), kvh(b, c, cos, sin, H, N)
            (q.float().square().sum() + (k.float() * 3).sum() + v.float().pow(3).sum()).backward()
            runs.append(((q, k, v), (a.grad, b.grad, c.grad)))
        (outs, grads), (outs2, grads2) = runs
        assert all(torch.equal(x, y) for x, y in zip(outs + grads, outs2 + grads2))
        assert all(t.transpose(1, 2).is_contiguous() and not t.is_contiguous() for t in outs2)
