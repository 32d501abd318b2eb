"""The chunked linear + cross-entropy (models/loss.py) vs the plain head: loss and gradients to FP32 (BF16) rounding;
with ``train.head_loss=chunked`` the training step keeps no ``N x V`` tensor for the backward."""
import pytest
import torch
import torch.nn.functional as F

import models.loss as loss_mod
from models import ModelConfig, build
from models.loss import IGNORE, ChunkedLossHead, linear_cross_entropy
from parallel.head_loss import HEAD_LOSSES, FusedLossHead, apply_head_loss
from models.transformer import _ce

from .trainer_utils import read_jsonl


def _case(n=96, d=24, v=200, seed=0, ignore=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, requires_grad=True)
    w = (torch.randn(v, d, generator=g) * 0.3).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[:ignore] = IGNORE
    return x, w, labels


def _both(x, w, labels, autocast=False):
    out = []
    for fused in (False, True):
        xi, wi = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = linear_cross_entropy(xi, wi, labels) if fused else _ce((xi @ wi.t()).unsqueeze(0), labels[None])
        (loss * 0.7).backward()   # an upstream gradient other than 1
        out.append((loss.detach(), xi.grad, wi.grad))
    return out


@pytest.mark.parametrize("chunk_rows", [None, 7, 32])
def test_fp32_equals_the_plain_path(monkeypatch, chunk_rows):   # vocabulary blocks of chunk_rows words
    if chunk_rows:
        monkeypatch.setattr(loss_mod, "CHUNK_BYTES", chunk_rows * 4 * 96)   # blocks of chunk_rows words
    x, w, labels = _case(ignore=5)
    (l0, dx0, dw0), (l1, dx1, dw1) = _both(x, w, labels)
    assert l1.dtype == torch.float32 and torch.allclose(l1, l0, rtol=1e-6, atol=0)
    assert torch.allclose(dx1, dx0, rtol=1e-5, atol=1e-7) and torch.allclose(dw1, dw0, rtol=1e-5, atol=1e-7)
    assert dx1[:5].abs().max() == 0   # ignored tokens get no gradient


def test_bf16_autocast_matches_to_bf16_rounding(monkeypatch):
    monkeypatch.setattr(loss_mod, "CHUNK_BYTES", 16 * 4 * 96)
    x, w, labels = _case(seed=1)
    (l0, dx0, dw0), (l1, dx1, dw1) = _both(x, w, labels, autocast=True)
    assert dx1.dtype == dx0.dtype == torch.float32 and dw1.dtype == torch.float32
    assert torch.allclose(l1, l0, rtol=1e-5)
    for a, b in ((dx1, dx0), (dw1, dw0)):
        assert (a - b).abs().max() <= 2 ** -7 * b.abs().max(), (a - b).abs().max()


def test_without_grad_only_the_loss():
    x, w, labels = _case(seed=2)
    with torch.no_grad():
        loss = linear_cross_entropy(x, w, labels)
    assert torch.allclose(loss, F.cross_entropy(x @ w.t(), labels), rtol=1e-6)


def test_the_chunked_head_keeps_no_logits_for_the_backward(monkeypatch):
    """compute_loss of a model with MTP and train.head_loss=chunked saves nothing of shape [..., V] (the plain path
    keeps three per head), and its loss and gradients equal the plain head's; train.head_loss=fused (its Triton
    cross-entropy forced onto the interpreter: on a CPU it runs F.cross_entropy) keeps the logits only."""
    pytest.importorskip("triton")
    import kernels
    kernels.configure()
    from kernels.cross_entropy import triton_cross_entropy
    monkeypatch.setattr("parallel.head_loss.cross_entropy", triton_cross_entropy)
    cfg = ModelConfig(vocab_size=512, dim=32, n_layers=2, first_k_dense=1, inter_dim=48, n_heads=2, q_lora_rank=16,
                      kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, moe_inter_dim=16,
                      n_routed_experts=4, n_activated_experts=2, n_expert_groups=1, n_limited_groups=1, mtp_depth=1)
    ids = torch.randint(0, 512, (2, 15), generator=torch.Generator().manual_seed(3))   # 30 tokens: not the dim
    labels = torch.roll(ids, -1, 1)
    runs = {}
    for kind in HEAD_LOSSES:
        model = build(cfg, seed=0)
        apply_head_loss(model, kind)
        assert isinstance(model.head, ChunkedLossHead) == (kind == "chunked")
        assert isinstance(model.head, FusedLossHead) == (kind == "fused")
        shapes = []

        def pack(t):
            shapes.append(tuple(t.shape))
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model.compute_loss(ids, labels, mtp_weight=0.3)
        out.loss.backward()
        runs[kind] = (out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                      [s for s in shapes if s and s[-1] == 512 and s != (32, 512)])     # not the head's Wᵀ
    (ref, g_ref, kept_ref), (out, g, kept) = runs["plain"], runs["chunked"]
    assert len(kept_ref) >= 4 and kept == [], (kept_ref, kept)
    assert len(runs["fused"][2]) == 2, runs["fused"][2]         # one [B, T, V] logits tensor per head
    for kind in ("chunked", "fused"):
        (out, g, _) = runs[kind]
        assert torch.allclose(out.loss, ref.loss, rtol=1e-6) and torch.allclose(out.mtp_loss, ref.mtp_loss, rtol=1e-6)
        assert g.keys() == g_ref.keys()
        for n in g:
            assert torch.allclose(g[n], g_ref[n], rtol=1e-4, atol=1e-7), (kind, n)


def test_a_chunked_run_trains_like_a_plain_one(tmp_path):
    from .trainer_utils import run_inprocess
    losses = {}
    for kind in HEAD_LOSSES:
        run_inprocess(tmp_path / kind, "logging.wandb.mode=disabled", "logging.progress=false", "train.max_steps=4",
                      "train.eval_every=0", f"data.cache_dir={tmp_path}/cache", f"train.head_loss={kind}",
                      "checkpoint.save_final=false")
        losses[kind] = [r["loss"] for r in read_jsonl(tmp_path / kind / "metrics.jsonl")]
    assert len(losses["plain"]) == 4
    assert losses["chunked"] == pytest.approx(losses["plain"], rel=1e-5)
    assert losses["fused"] == losses["plain"]          # on a CPU the fused head runs F.cross_entropy
