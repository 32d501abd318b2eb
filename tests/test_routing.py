"""Gate, node-limited routing, balancing bias, sequence-wise aux loss and dropless dispatch."""
import pytest
import torch
import torch.nn.functional as F

from models import ModelConfig, build
from models.moe import Gate, MoE, sequence_balance_loss


def make_gate(seed=0, **kw) -> Gate:
    cfg = ModelConfig(**{"dim": 32, "n_routed_experts": 16, "n_activated_experts": 4, "n_expert_groups": 4,
                         "n_limited_groups": 2, "route_scale": 2.5, **kw}).validate()
    torch.manual_seed(seed)
    gate = Gate(cfg)
    gate.init_weights(std=0.5)
    return gate


@pytest.mark.parametrize("groups,limited,topk", [(4, 2, 4), (8, 4, 8), (4, 1, 2), (2, 1, 4)])
def test_experts_span_at_most_m_groups(groups, limited, topk):
    gate = make_gate(n_routed_experts=32, n_expert_groups=groups, n_limited_groups=limited, n_activated_experts=topk)
    gate.expert_bias.copy_(torch.randn(32) * 0.3)  # biases must not break the node limit either
    x = torch.randn(500, 32)
    idx, w, _ = gate(x)
    groups_per_token = torch.tensor([len(set((row // (32 // groups)).tolist())) for row in idx])
    assert groups_per_token.max() <= limited
    assert (idx.sort(-1)[0].diff(dim=-1) > 0).all(), "a token must not pick the same expert twice"
    # The limit is binding: without it some tokens would use more groups.
    free = make_gate(n_routed_experts=32, n_expert_groups=groups, n_limited_groups=groups, n_activated_experts=topk,
                     group_topk=1)
    free.load_state_dict(gate.state_dict())
    free_idx = free(x)[0]
    free_groups = torch.tensor([len(set((row // (32 // groups)).tolist())) for row in free_idx])
    assert free_groups.max() > limited


def test_group_choice_uses_sum_of_top_k_over_m_biased_scores():
    gate = make_gate(n_routed_experts=8, n_expert_groups=4, n_limited_groups=2, n_activated_experts=4)
    # Hand-set scores via the bias on a zero router: sigmoid(0)=0.5 everywhere, so bias decides.
    gate.weight.data.zero_()
    gate.expert_bias.copy_(torch.tensor([0.9, 0.0, 0.5, 0.5, 1.0, -1.0, 0.0, 0.0]))
    # group scores (top-2 sums of 0.5+b): g0=1.4+0.5=... g0: 1.4,0.5 -> 1.9; g1: 1.0,1.0 -> 2.0; g2: 1.5,-0.5 -> 1.0; g3: 0.5,0.5 -> 1.0
    idx, w, _ = gate(torch.zeros(1, 32))
    assert sorted(idx[0].tolist()) == [0, 1, 2, 3]  # groups 0 and 1, not the single best expert 4 of group 2
    assert torch.allclose(w, torch.full_like(w, 2.5 / 4))  # equal unbiased scores -> equal gates


def test_bias_changes_selection_not_gate_values():
    gate = make_gate()
    x = torch.randn(64, 32)
    idx0, w0, scores = gate(x)
    gate.expert_bias[5] = 10.0  # force expert 5 into every token's selection
    idx1, w1, scores1 = gate(x)
    assert torch.equal(scores, scores1), "bias must not enter the affinities"
    assert (idx1 == 5).any(-1).all() and not (idx0 == 5).any(-1).all()
    expected = scores.gather(1, idx1)
    expected = expected / expected.sum(-1, keepdim=True) * 2.5
    torch.testing.assert_close(w1, expected)  # gate values are unbiased scores of the chosen experts


def test_gates_sum_to_route_scale():
    for scale in (1.0, 2.5):
        gate = make_gate(route_scale=scale)
        _, w, _ = gate(torch.randn(100, 32))
        torch.testing.assert_close(w.sum(-1), torch.full((100,), scale))


def test_gate_is_fp32_under_a_bf16_autocast():
    """The router keeps FP32 (DeepSeek-V3 keeps its gating in higher precision): a BF16 autocast around it changes
    nothing, though it would run a plain ``F.linear`` in BF16."""
    gate = make_gate(n_routed_experts=64, n_expert_groups=8, n_limited_groups=4, n_activated_experts=8)
    x = torch.randn(256, 32).bfloat16()
    want = gate(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gate(x)
        assert F.linear(x.float(), gate.weight.float()).dtype == torch.bfloat16   # what the gate must not do
    assert got[1].dtype == got[2].dtype == torch.float32
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_bias_update_sign_rule():
    moe = MoE(ModelConfig(dim=32, n_routed_experts=4, n_activated_experts=2))
    moe.gate.expert_bias.copy_(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    moe.update_bias(torch.tensor([5.0, 1.0, 3.0, 3.0]), gamma=0.01)  # mean load 3
    torch.testing.assert_close(moe.gate.expert_bias, torch.tensor([0.09, 0.21, 0.3, 0.4]))


def test_bias_update_of_every_layer_at_once_is_each_layers_sign_rule():
    from models.moe import update_biases
    g = torch.Generator().manual_seed(0)
    moes = [MoE(ModelConfig(dim=32, n_routed_experts=8, n_activated_experts=2)) for _ in range(3)]
    for m in moes:
        m.gate.expert_bias.copy_(torch.randn(8, generator=g))
    load = torch.randint(0, 50, (3, 8), generator=g).float()
    want = [m.gate.expert_bias + 1e-3 * torch.sign(row.mean() - row) for m, row in zip(moes, load)]
    update_biases(moes, load, 1e-3)
    for m, w in zip(moes, want):
        assert torch.equal(m.gate.expert_bias, w)


def test_sequence_balance_loss_hand_computed():
    scores = torch.tensor([[[0.8, 0.4, 0.4, 0.4], [0.1, 0.1, 0.6, 0.2]]])
    idx = torch.tensor([[[0, 1], [2, 0]]])
    # s' = [.4 .2 .2 .2], [.1 .1 .6 .2]; P = [.25 .15 .4 .2]; f = E/(K*T) * counts = 1 * [2 1 1 0]
    # L = 2*.25 + 1*.15 + 1*.4 + 0 = 1.05
    torch.testing.assert_close(sequence_balance_loss(scores, idx), torch.tensor(1.05))
    # two sequences: mean of the per-sequence losses
    two = sequence_balance_loss(torch.cat([scores, scores.flip(1)]), torch.cat([idx, idx.flip(1)]))
    torch.testing.assert_close(two, torch.tensor(1.05))


def test_aux_loss_reaches_the_objective():
    cfg = ModelConfig(mtp_depth=0, n_expert_groups=4, n_limited_groups=2)
    model = build(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    out = model.compute_loss(ids[:, :-1], ids[:, 1:], aux_alpha=0.5)
    manual = 0.5 * sum(m.aux_loss for m in model.moe_layers())
    torch.testing.assert_close(out.aux_loss, manual.detach())
    torch.testing.assert_close(out.loss, out.lm_loss + manual.detach())


def dense_reference(moe: MoE, x_TD: torch.Tensor) -> torch.Tensor:
    """Per-token loop over the chosen experts: the definition of the MoE output."""
    idx, w, _ = moe.gate(x_TD)
    e = moe.experts
    w1, w3 = e.w13.chunk(2, dim=1)   # gate and up, stacked per expert
    out = []
    for t in range(x_TD.shape[0]):
        y = sum(w[t, k] * F.linear(F.silu(F.linear(x_TD[t], w1[i])) * F.linear(x_TD[t], w3[i]), e.w2[i])
                for k, i in enumerate(idx[t].tolist()))
        out.append(y + moe.shared_experts(x_TD[t]))
    return torch.stack(out)


@pytest.mark.parametrize("topk,limited,skew", [(2, 2, False), (2, 2, True), (1, 1, True)])
def test_dropless_every_token_processed(topk, limited, skew):
    cfg = ModelConfig(dim=32, n_routed_experts=8, n_activated_experts=topk, n_expert_groups=4,
                      n_limited_groups=limited, moe_inter_dim=16, route_scale=2.5)
    torch.manual_seed(0)
    moe = MoE(cfg)
    moe.init_weights(0.2)
    for m in moe.shared_experts.modules():
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=0.2)
    if skew:  # every token picks expert 3 (and 2 when K=2): all other experts get zero tokens
        moe.gate.expert_bias[3] = 100.0
        moe.gate.expert_bias[2] = 50.0
    moe.train()
    x = torch.randn(2, 24, 32)
    y = moe(x)
    assert moe.tokens_per_expert.sum() == 2 * 24 * topk
    if skew:
        assert moe.tokens_per_expert[3] == 48 and (moe.tokens_per_expert == 0).sum() == 8 - topk
    torch.testing.assert_close(y.view(48, 32), dense_reference(moe, x.view(48, 32)), rtol=1e-5, atol=1e-6)


def test_grouped_mm_matches_loop():
    cfg = ModelConfig(dim=32, n_routed_experts=8, moe_inter_dim=16)
    torch.manual_seed(0)
    moe = MoE(cfg)
    moe.init_weights(0.2)
    x = torch.randn(40, 32, requires_grad=True)
    counts = torch.tensor([10, 0, 5, 5, 0, 12, 8, 0])
    assert moe.experts._grouped_mm_ok(x, moe.experts.w13)
    g = torch.randn(40, 32)
    y1 = moe.experts(x, counts)
    (gx1,) = torch.autograd.grad(y1, x, g)
    y2 = moe.experts.forward_loop(x, counts)
    (gx2,) = torch.autograd.grad(y2, x, g)
    torch.testing.assert_close(y1, y2)
    torch.testing.assert_close(gx1, gx2)
    # Under BF16 autocast the grouped experts compute in BF16 like the dense layers (autocast itself
    # does not cover torch._grouped_mm), and still match the per-expert loop (F.linear under autocast).
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y3 = moe.experts(x, counts)
        y4 = moe.experts.forward_loop(x, counts)
    assert y3.dtype == y4.dtype == torch.bfloat16
    torch.testing.assert_close(y3.float(), y4.float(), rtol=2e-2, atol=2e-2)
    assert (y3.float() - y1).abs().max() > 0   # really computed in BF16, not FP32



def test_the_inverse_permutation_is_argsorts():
    """``unsort_and_weight`` and the expert-parallel dispatchers undo their sorts with ``inverse_permutation``
    (one scatter) where they took ``argsort`` (a sort)."""
    from models.moe import inverse_permutation
    g = torch.Generator().manual_seed(0)
    for n in (1, 21, 4096):
        order = torch.argsort(torch.randint(0, 7, (n,), generator=g), stable=True)
        assert torch.equal(inverse_permutation(order), torch.argsort(order))


def test_the_dispatch_gathers_copies_and_sums_their_gradients_per_token():
    """``gather_copies`` (opt-in, ``parallel.compile.GATHER_ENV``): the rows of ``x[order // K]``; their gradients
    back per token by an un-sort and a sum over each token's K copies instead of autograd's accumulating index
    write (FP64: equal to rounding), and with ``K = 1`` a permutation's, exactly."""
    from models.moe import gather_copies, index_copies
    g = torch.Generator().manual_seed(0)
    for T, K, D in ((1, 1, 3), (37, 1, 8), (64, 6, 16)):
        order = torch.argsort(torch.randint(0, 5, (T * K,), generator=g), stable=True)
        x = torch.randn(T, D, dtype=torch.float64, generator=g, requires_grad=True)
        ref = x.detach().clone().requires_grad_()
        dy = torch.randn(T * K, D, dtype=torch.float64, generator=g)
        y = gather_copies(x, order, K)
        assert torch.equal(y, index_copies(ref, order, K))
        y.backward(dy), index_copies(ref, order, K).backward(dy)
        assert torch.allclose(x.grad, ref.grad, rtol=1e-14, atol=1e-14) and (K > 1 or torch.equal(x.grad, ref.grad))
        assert torch.autograd.gradcheck(lambda a: gather_copies(a, order, K), (x.detach().requires_grad_(),))


def test_the_combine_s_unsort_by_a_gathered_backward_is_bit_for_bit_autograd_s():
    """``unsort_rows`` and ``unsort_rows_and_weight`` (opt-in, ``parallel.compile.UNSORT_ENV``): the forward and
    the gradients (rows and gate weights) equal plain indexing's, bit for bit, FP32 and BF16."""
    from models.moe import inverse_permutation, unsort_and_weight, unsort_rows, unsort_rows_and_weight
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        y = torch.randn(48, 16, generator=g).to(dtype)
        order = torch.randperm(48, generator=g)
        dy = torch.randn(48, 16, generator=g).to(dtype)
        a, b = y.clone().requires_grad_(), y.clone().requires_grad_()
        out_a, out_b = unsort_rows(a, order), b[inverse_permutation(order)]
        assert torch.equal(out_a, out_b)
        out_a.backward(dy)
        out_b.backward(dy)
        assert torch.equal(a.grad, b.grad)
        w = torch.rand(12, 4, generator=g, requires_grad=True)
        runs = []
        for fn in (unsort_and_weight, unsort_rows_and_weight):
            yy, ww = y.clone().requires_grad_(), w.detach().clone().requires_grad_()
            out = fn(yy, order, ww)
            out.backward(torch.ones_like(out))
            runs.append((out, yy.grad, ww.grad))
        assert all(torch.equal(p, q) for p, q in zip(*runs))


def _select_by_top_ks(logits_TE, bias_E, n_groups, group_topk, n_limited, topk, route_scale):
    """Node-limited selection written with a top-k for each stage: what ``select_experts`` must equal."""
    scores_TE = logits_TE.sigmoid()
    biased_TGe = (scores_TE + bias_E).view(len(logits_TE), n_groups, -1)
    group_TG = biased_TGe.topk(group_topk, dim=-1)[0].sum(-1)
    keep_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, group_TG.topk(n_limited, dim=-1)[1], True)
    idx_TK = biased_TGe.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).flatten(1).topk(topk, dim=-1)[1]
    w_TK = scores_TE.gather(1, idx_TK)
    return idx_TK, w_TK / w_TK.sum(-1, keepdim=True) * route_scale


@pytest.mark.parametrize("experts,groups,group_topk,limited,topk", [(64, 8, 2, 4, 8), (32, 4, 2, 2, 4),
                                                                   (32, 8, 1, 2, 2), (16, 4, 4, 1, 4),
                                                                   (256, 8, 2, 4, 8), (64, 8, 2, 8, 6)])
def test_group_selection_by_ranks_equals_top_ks(experts, groups, group_topk, limited, topk):
    """The top-k's as ``ranks`` (pairwise comparisons a compiled region fuses; 256 experts: ``topk`` itself)
    choose what top-k's choose, in the same order and with the same weights, bit for bit; ties go to the lower
    index."""
    from models.moe import ranks, select_experts
    g = torch.Generator().manual_seed(experts + limited)
    logits, bias = torch.randn(512, experts, generator=g), 0.01 * torch.randn(experts, generator=g)
    idx, w, _ = select_experts(logits, bias, groups, group_topk, limited, topk, 2.5)
    want_idx, want_w = _select_by_top_ks(logits, bias, groups, group_topk, limited, topk, 2.5)
    assert torch.equal(idx, want_idx) and torch.equal(w, want_w)
    x = torch.tensor([[3.0, 1.0, 3.0, 2.0], [float("-inf")] * 4])
    assert ranks(x).tolist() == [[0, 3, 1, 2], [0, 1, 2, 3]]
