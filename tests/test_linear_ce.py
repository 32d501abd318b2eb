"""The chunked linear + cross-entropy (models/loss.py) against the plain head + ``F.cross_entropy`` path: loss
and gradients equal to FP32 rounding (BF16 autocast: to BF16 rounding), ignored labels, several chunks, no
grad; and the model's training step no longer keeps an ``N x V`` tensor for the backward."""
import pytest
import torch
import torch.nn.functional as F

import models.loss as loss_mod
from models import ModelConfig, build
from models.loss import IGNORE, linear_cross_entropy
from models.transformer import _ce


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
def test_fp32_equals_the_plain_path(monkeypatch, chunk_rows):
    if chunk_rows:
        monkeypatch.setattr(loss_mod, "CHUNK_BYTES", chunk_rows * 4 * 200)
    x, w, labels = _case(ignore=5)
    (l0, dx0, dw0), (l1, dx1, dw1) = _both(x, w, labels)
    assert l1.dtype == torch.float32 and torch.allclose(l1, l0, rtol=1e-6, atol=0)
    assert torch.allclose(dx1, dx0, rtol=1e-5, atol=1e-7) and torch.allclose(dw1, dw0, rtol=1e-5, atol=1e-7)
    assert dx1[:5].abs().max() == 0   # ignored tokens get no gradient


def test_bf16_autocast_matches_to_bf16_rounding(monkeypatch):
    monkeypatch.setattr(loss_mod, "CHUNK_BYTES", 16 * 4 * 200)
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


def test_the_model_step_keeps_no_logits_for_the_backward():
    """compute_loss of a model with MTP saves nothing of N x V elements (the plain path keeps two per head) and
    its loss and gradients equal the plain path's."""
    cfg = ModelConfig(vocab_size=512, dim=32, n_layers=2, first_k_dense=1, inter_dim=48, n_heads=2, q_lora_rank=16,
                      kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, moe_inter_dim=16,
                      n_routed_experts=4, n_activated_experts=2, n_expert_groups=1, n_limited_groups=1, mtp_depth=1)
    model = build(cfg, seed=0)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(ids, -1, 1)
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model.compute_loss(ids, labels, mtp_weight=0.3)
    assert shapes and not [s for s in shapes if s and s[-1] == 512], shapes   # no [..., V] logits: only W, dW are V x D
    out.loss.backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    import models.transformer as tr
    model.zero_grad()
    plain = tr.head_ce

    def unfused(head, x, lab):
        return tr._ce(head(x), lab)
    tr.head_ce = unfused
    try:
        ref = model.compute_loss(ids, labels, mtp_weight=0.3)
        ref.loss.backward()
    finally:
        tr.head_ce = plain
    assert torch.allclose(out.loss, ref.loss, rtol=1e-6) and torch.allclose(out.mtp_loss, ref.mtp_loss, rtol=1e-6)
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert torch.allclose(fused[n], p.grad, rtol=1e-4, atol=1e-7), n
