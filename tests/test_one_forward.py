"""One forward, written once in ``models/`` as steps cut at the dispatcher's boundaries: ``parallel/`` calls
no model submodule or compute function (read from the source), and recording the steps on the pipeline's
``Tape`` (cut or whole; full backward or B / W) gives the losses and gradients of ``compute_loss``."""
from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch

from models import ModelConfig, build
from models.steps import Cut, LocalLink, carrying, drive
from models.transformer import Tail, span_steps
from parallel.pipeline.overlap import Tape, backward_steps, record, run
from parallel.wgrad import WeightGradQueue, apply_deferred_wgrad

ROOT = Path(__file__).resolve().parents[1]
MODEL_FILES = ("models/layers.py", "models/attention.py", "models/moe.py", "models/transformer.py")
# Functions of models/ that parallel/ may call: building blocks of the seams, not model compute; and the
# functions of the compiled regions, which parallel/compile.py hands to torch.compile as they are written in
# models/ (the modules' own forwards call the same functions), never re-implements.
ALLOWED = {"build", "expert_counts", "inverse_permutation", "gather_copies", "unsort_and_weight",
           "unsort_rows_and_weight", "gate_weighted_sum", "span_steps", "query_heads_bthd", "key_value_heads_bthd",
           "drive", "carrying", "rms_norm", "swiglu", "rope_heads", "query_heads", "key_value_heads", "select_experts",
           "balance_and_load", "add_rms_norm"}


def _submodule_names() -> set[str]:
    """Attribute names of the model's submodules (every kind of layer, MTP included), except names that
    are also tensor methods (``norm``): calling one of these is running the model by hand."""
    names = set()
    for q_lora in (0, 16):
        for n, _ in build(ModelConfig(q_lora_rank=q_lora, mtp_depth=1), "meta").named_modules():
            last = n.rsplit(".", 1)[-1]
            if last and not last.isdigit() and not hasattr(torch.Tensor, last):
                names.add(last)
    return names


def _model_functions() -> tuple[set[str], set[str]]:
    """The module-level functions of the model's files (except ``ALLOWED``) and its classes' compute
    methods between the cuts (called by attribute)."""
    functions, methods = set(), set()
    for rel in MODEL_FILES:
        for node in ast.parse((ROOT / rel).read_text()).body:
            if isinstance(node, ast.FunctionDef):
                functions.add(node.name)
            elif isinstance(node, ast.ClassDef):
                methods.update(f.name for f in node.body if isinstance(f, ast.FunctionDef)
                               and f.name in ("attention", "balance", "post_combine", "q_up", "kv_up", "core"))
    return functions - ALLOWED, methods


SUBMODULES = _submodule_names()
FUNCTIONS, METHODS = _model_functions()


def model_logic(tree: ast.Module) -> list[str]:
    """``line: what`` for every call of a model submodule, compute method or function, and every import of
    such a function. (Importing the model's classes, e.g. for ``isinstance``, is fine.)"""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = node.func
            own = isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) and fn.value.id == "self"
            if isinstance(fn, ast.Attribute) and fn.attr in SUBMODULES | METHODS | FUNCTIONS and not own:
                # a swapped-in module calling its own parts (FP8GroupedExperts' self.act) is its composition;
                # driving the model's modules (blk.attn, moe.gate) is not
                found.append(f"{node.lineno}: calls .{fn.attr}(")
            elif isinstance(fn, ast.Name) and fn.id in FUNCTIONS:
                found.append(f"{node.lineno}: calls {fn.id}(")
            if isinstance(fn, ast.Attribute) and fn.attr in ("cross_entropy", "scaled_dot_product_attention"):
                found.append(f"{node.lineno}: calls {fn.attr}(")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("models"):
            found += [f"{node.lineno}: imports {a.name}" for a in node.names if a.name in FUNCTIONS]
    return found


def test_the_sets_cover_the_model():
    assert {"attn", "attn_norm", "ffn_norm", "gate", "shared_experts", "experts", "head", "embed", "eh_proj",
            "enorm", "hnorm", "wqkv_a"} <= SUBMODULES
    assert {"rope_cos_sin", "apply_rope", "sequence_balance_loss", "_ce", "head_loss_steps"} <= FUNCTIONS
    assert {"attention", "balance", "post_combine"} <= METHODS


def test_parallel_contains_no_model_logic():
    bad = {str(p.relative_to(ROOT)): hits for p in sorted((ROOT / "parallel").rglob("*.py"))
           if (hits := model_logic(ast.parse(p.read_text())))}
    assert bad == {}, f"model logic belongs in models/ (parallel/ drives its steps): {bad}"


def test_the_check_catches_a_copy_of_the_forward():
    """The shapes of the former hand-written copy (parallel/pipeline/overlap.py before the steps)."""
    copy_of_forward = """
from models.layers import rope_cos_sin
from models.moe import sequence_balance_loss
from models.transformer import _ce
def block(blk, x, rope, moe, st, module, h, ids, labels):
    h = x + blk.attn(blk.attn_norm(x), rope)
    u = blk.ffn_norm(h)
    idx, w, scores = moe.gate(u)
    aux = sequence_balance_loss(scores, idx)
    y = moe.experts(u, idx) + moe.shared_experts(u)
    rope = rope_cos_sin(st.cfg, 8, h.device)
    xk = module.eh_proj(torch.cat([module.enorm(st.mtp_embed(ids)), module.hnorm(h)], -1))
    return _ce(st.head(st.norm(h)), labels), F.cross_entropy(y, labels)
"""
    hits = " ".join(model_logic(ast.parse(copy_of_forward)))
    for what in ("imports rope_cos_sin", "imports sequence_balance_loss", "imports _ce", ".attn(",
                 ".attn_norm(", ".ffn_norm(", ".gate(", "sequence_balance_loss(", ".experts(", ".shared_experts(",
                 "rope_cos_sin(", ".eh_proj(", ".enorm(", ".hnorm(", "_ce(", ".head(", "cross_entropy("):
        assert what in hits, (what, hits)


# ---------------------------------------------------------------------------------- piecewise = straight
CFG = dict(vocab_size=64, dim=32, n_layers=3, first_k_dense=1, inter_dim=48, n_heads=2, q_lora_rank=16,
           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, moe_inter_dim=16,
           n_routed_experts=8, n_activated_experts=2, n_expert_groups=2, n_limited_groups=1, mtp_depth=1,
           init_std=0.2)


def _piecewise(model, ids, labels, mode: str, cuts: bool):
    """The whole model as one pipeline stage on a tape; returns (loss, lm, mtp, aux, number of pieces).
    ``mode="input"``: the zero-bubble split with the GEMMs' weight gradients deferred (B, then W)."""
    queue = WeightGradQueue()
    if mode == "input":
        apply_deferred_wgrad(model, queue)
    tail = Tail(model.norm, model.head, model.mtp, model.embed)
    tape = Tape(None, cuts)
    steps = span_steps(model.cfg, ids, labels, embed=model.embed, blocks=model.layers, tail=tail, mtp_weight=0.3)
    loss, (lm, mtp), aux = run(record(steps, tape))
    tape.finish([loss, aux])
    n = len(tape.pieces)
    grads = [torch.ones(()), torch.full((), 0.01)]
    if mode == "full":
        run(backward_steps(tape, grads))
    else:   # B then W, as the zero-bubble schedules split it
        params = [p for p in model.parameters() if p.requires_grad]
        with queue.collect("mb"):
            run(backward_steps(tape, grads, lambda leaves: queue.b_inputs(leaves, params)))
        deferred = queue.deferred
        assert len(deferred) > 10 and all((p.grad is None) == (id(p) in deferred) for p in params), \
            "B must give exactly the non-deferred parameters (norms, gate, embedding) their gradients"
        assert all(not p.inputs and not p.outputs for p in tape.pieces), "B keeps no graph for W"
        queue.run("mb")
        assert queue.pending() == []
    return loss, lm, mtp, aux, n


@pytest.mark.parametrize("cuts", [True, False])
@pytest.mark.parametrize("mode", ["full", "input"])
def test_piecewise_matches_straight_through(mode, cuts):
    model = build(ModelConfig(**CFG), seed=0).train()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(1))
    out = ref.compute_loss(ids[:, :-1], ids[:, 1:], mtp_weight=0.3, aux_alpha=0.01)
    out.loss.backward()
    loss, lm, mtp, aux, n_pieces = _piecewise(model, ids[:, :-1], ids[:, 1:], mode, cuts)
    assert n_pieces == (1 + 2 * 3 if cuts else 1)   # two cuts per MoE block: layers 1 and 2, and the MTP block
    torch.testing.assert_close(lm.detach(), out.lm_loss, rtol=0, atol=0)
    torch.testing.assert_close(mtp.detach(), out.mtp_loss, rtol=0, atol=0)
    torch.testing.assert_close(0.01 * aux.detach(), out.aux_loss, rtol=1e-6, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    for a, b in zip(model.moe_layers(), ref.moe_layers()):
        assert torch.equal(a.tokens_per_expert, b.tokens_per_expert)


def test_a_piece_that_only_passes_tensors_on_makes_no_new_leaves_for_them():
    """Tensors the expert piece only carries on (gate weights, layer input, balance loss, residual) keep the
    dispatch cut's leaves at the combine cut (no gradient copy per cut); only the received rows are new leaves."""
    model = build(ModelConfig(**CFG), seed=0).train()
    ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(1))
    tail = Tail(model.norm, model.head, model.mtp, model.embed)
    tape = Tape(None, True)
    steps = span_steps(model.cfg, ids[:, :-1], ids[:, 1:], embed=model.embed, blocks=model.layers, tail=tail,
                       mtp_weight=0.3)
    run(record(steps, tape))
    after_dispatch, after_combine = tape.pieces[1::2], tape.pieces[2::2]
    assert len(after_dispatch) == len(after_combine) == 3
    for p in after_dispatch:   # carried tensors + the received rows
        assert len(p.inputs) >= 4 and p.n_recv == 1
    for p in after_combine:    # the received rows only
        assert len(p.inputs) == p.n_recv == 1
    leaves = [t for p in tape.pieces for t in p.inputs]
    assert all(t.is_leaf and t.requires_grad for t in leaves)
    assert len({id(t) for t in leaves}) == len(leaves)


def test_carrying_passes_the_callers_tensors_through_every_cut():
    def inner(x):
        (a,), (y,) = yield Cut((x,), [x * 2], LocalLink())
        (a,), (z,) = yield Cut((a,), [y + 1], LocalLink())
        return a + z

    def outer(x, c):
        got, (c,) = yield from carrying(inner(x), (c,))
        return got, c

    cuts, value, steps = [], None, outer(torch.tensor(1.0), torch.tensor(5.0))
    while True:
        try:
            cut = steps.send(value)
        except StopIteration as stop:
            result = stop.value
            break
        cuts.append(cut)
        value = (tuple(t + 100 for t in cut.carry), cut.link(cut.sends))   # a driver may replace the carry
    assert [len(c.carry) for c in cuts] == [2, 2] and float(cuts[1].carry[1]) == 105.0
    assert [float(t) for t in result] == [1 + 100 + 100 + (2 + 1), 205.0]
    assert [float(t) for t in drive(outer(torch.tensor(1.0), torch.tensor(5.0)))] == [1 + 3, 5.0]
