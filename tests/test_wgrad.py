"""Deferred weight-gradient GEMMs (``parallel/wgrad.py``): B then W gives the plain backward's gradients bit for
bit (modules, stages, whole model, BF16 autocast, FP8), while B alone leaves the deferred weights untouched. The
per-expert loop path is held to 1e-6: it applies SiLU per expert, the deferred function to the whole tensor."""
import copy

import pytest
import torch
from torch import nn

from models import ModelConfig, build
from models.moe import GroupedExperts
from models.steps import drive
from parallel.fp8 import FP8GroupedExperts, FP8Linear, apply_fp8
from parallel.pipeline.stages import Stage, layer_split
from parallel.wgrad import DeferredGroupedExperts, DeferredLinear, WeightGradQueue, apply_deferred_wgrad

CFG = dict(vocab_size=128, dim=32, n_layers=3, inter_dim=64, n_heads=2, q_lora_rank=16, kv_lora_rank=16,
           qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, moe_inter_dim=16, n_routed_experts=8,
           n_activated_experts=2, n_expert_groups=2, n_limited_groups=1, mtp_depth=1, init_std=0.2)
AUX, MTP = 0.01, 0.3


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in module.named_parameters()}


def assert_same_grads(got: dict, want: dict, exact: bool = True) -> None:
    assert got.keys() == want.keys()
    for name in want:
        g, w = got[name], want[name]
        assert (g is None) == (w is None), name
        if w is not None:
            assert (torch.equal(g, w) if exact else rel(g, w) < 1e-6), (name, rel(g, w))


# ------------------------------------------------------------------------------------------------ modules
def run_module(module, args, dy, queue=None, autocast=False):
    """Plain backward (``queue`` None) or B then W; returns (y, dx, grads after B, grads after W)."""
    module.zero_grad(set_to_none=True)
    x = args[0].clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = module(x, *args[1:])
    if queue is None:
        y.backward(dy.to(y.dtype))
        return y, x.grad, grads(module), grads(module)
    queue.backward("mb0", [y], [dy.to(y.dtype)], leaves=[x], params=module.parameters())
    after_b = grads(module)
    queue.run("mb0")
    return y, x.grad, after_b, grads(module)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_linear_b_then_w_is_bit_exact(autocast):
    torch.manual_seed(0)
    base = nn.Linear(48, 40, bias=False)
    queue, src = WeightGradQueue(), copy.deepcopy(base)
    deferred = DeferredLinear.from_linear(src, queue)
    assert deferred.weight is src.weight and deferred.state_dict().keys() == base.state_dict().keys()
    x, dy = torch.randn(3, 7, 48), torch.randn(3, 7, 40)
    y0, dx0, _, g0 = run_module(base, (x,), dy, autocast=autocast)
    y1, dx1, _, g1 = run_module(deferred, (x,), dy, autocast=autocast)            # not collecting: at once
    y2, dx2, after_b, g2 = run_module(deferred, (x,), dy, queue, autocast)        # B, then W
    assert y0.dtype == (torch.bfloat16 if autocast else torch.float32) and dx0.dtype == torch.float32
    assert after_b == {"weight": None}
    for y, dx, g in ((y1, dx1, g1), (y2, dx2, g2)):
        assert torch.equal(y, y0) and torch.equal(dx, dx0) and torch.equal(g["weight"], g0["weight"])
    assert queue.pending() == []


@pytest.mark.parametrize("D, F_, autocast", [(32, 16, False), (32, 16, True), (30, 14, False)],
                         ids=["grouped_mm-fp32", "grouped_mm-bf16-autocast", "loop-fp32"])
def test_experts_b_then_w_match_plain(D, F_, autocast):
    """Grouped path bit-exact, loop path (unaligned strides) to 1e-6; experts without tokens get zero gradients."""
    counts = torch.tensor([0, 13, 5, 0, 30, 1])
    torch.manual_seed(0)
    base = GroupedExperts(len(counts), D, F_)
    base.init_weights(0.1)
    dtype = torch.bfloat16 if autocast else torch.float32
    grouped = GroupedExperts._grouped_mm_ok(torch.empty(1, D, dtype=dtype), base.w13.to(dtype))
    assert grouped == (D == 32)
    queue = WeightGradQueue()
    deferred = DeferredGroupedExperts.from_experts(copy.deepcopy(base), queue)
    x, dy = torch.randn(int(counts.sum()), D), torch.randn(int(counts.sum()), D)
    want = run_module(base, (x, counts), dy, autocast=autocast)
    at_once = run_module(deferred, (x, counts), dy, autocast=autocast)
    b_then_w = run_module(deferred, (x, counts), dy, queue, autocast)
    assert b_then_w[2] == {"w13": None, "w2": None}      # B alone left them untouched
    for got in (at_once, b_then_w):
        for g, w in zip(got[:2], want[:2]):
            assert (torch.equal(g, w) if grouped else rel(g, w) < 1e-6), rel(g, w)
        assert_same_grads(got[3], want[3], exact=grouped)
        assert all((got[3][n][0] == 0).all() and (got[3][n][3] == 0).all() for n in ("w13", "w2"))


# ------------------------------------------------------------------------------------------ stages, model
def make_model(fp8: bool = False):
    model = build(ModelConfig(**CFG), seed=0).train()
    if fp8:
        apply_fp8(model, backend="emulation")
    return model


def batch(n_mb: int = 1, seed: int = 1):
    ids = torch.randint(0, CFG["vocab_size"], (n_mb, 2, 17), generator=torch.Generator().manual_seed(seed))
    return [(m[:, :-1], m[:, 1:]) for m in ids]


def stage_targets(stage: Stage, ids, labels, x):
    """What the executor differentiates: the output (with its gradient) or the loss, plus the balance losses."""
    out, _, aux = drive(stage.steps(x, ids, labels, MTP))
    aux = None if aux is None else AUX * aux
    if stage.is_last:
        return [out if aux is None else out + aux], [None]
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    return ([out], [g]) if aux is None else ([out, aux], [g, None])


def run_stage(model, s: int, mbs, queue=None, order="BBWW"):
    """Backward of stage ``s`` (of 3, one layer each) over ``mbs``: plain, or B/W in ``order``.
    Returns (input grads per micro-batch, parameter grads after all Bs, after everything)."""
    stage = Stage(model, s, 3, layer_split(CFG["n_layers"], 3)[s])
    dxs, after_b = [], None
    for i, (ids, labels) in enumerate(mbs):
        x = None if s == 0 else torch.randn(2, 16, CFG["dim"], generator=torch.Generator().manual_seed(i),
                                            requires_grad=True)
        tensors, gs = stage_targets(stage, ids, labels, x)
        if queue is None:
            torch.autograd.backward(tensors, gs)
        else:
            queue.backward(i, tensors, gs, leaves=[x], params=stage.parameters())
            if order == "BWBW":
                queue.run(i)
        dxs.append(None if x is None else x.grad)
    if queue is not None and order == "BBWW":
        after_b = grads(stage)
        for i in range(len(mbs)):
            queue.run(i)
    return dxs, after_b, grads(stage)


def deferred_names(model) -> set[str]:
    return {f"{n}.{p}" for n, m in model.named_modules()
            if isinstance(m, (DeferredLinear, DeferredGroupedExperts, FP8Linear, FP8GroupedExperts))
            for p, _ in m.named_parameters()}


@pytest.mark.parametrize("s", [0, 1, 2], ids=["first", "middle", "last"])
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8-emulation"])
def test_stage_b_then_w_matches_full_backward(s, fp8):
    """BBWW over two micro-batches equals the plain backward bit for bit; after the Bs only the non-GEMM
    parameters (norms, gate, embedding) have gradients."""
    ref = make_model(fp8)
    model = copy.deepcopy(ref)
    queue = WeightGradQueue()
    apply_deferred_wgrad(model, queue)
    mbs = batch(2)
    dx_ref, _, g_ref = run_stage(ref, s, mbs)
    dx, after_b, g = run_stage(model, s, mbs, queue)
    assert (s == 0) == (dx[0] is None)
    for a, b in zip(dx, dx_ref):
        assert (a is None and b is None) or torch.equal(a, b)
    assert_same_grads(g, g_ref)
    deferred = deferred_names(model)               # stage parameters keep the model's names
    assert sum(n in deferred for n in after_b) >= 5 and sum(n not in deferred for n in after_b) >= 2
    for name, grad in after_b.items():
        assert (grad is None) if name in deferred else torch.equal(grad, g_ref[name]), name
    assert queue.pending() == []


def test_whole_model_b_w_per_micro_batch():
    """The whole model as one stage (no input leaf: B differentiates norms, gate and embedding), W right
    after each B (BWBW), the second W inside an autocast region (its GEMMs keep the forward's FP32)."""
    ref = make_model()
    model = copy.deepcopy(ref)
    mbs = batch(2)
    for ids, labels in mbs:
        ref.compute_loss(ids, labels, MTP, AUX).loss.backward()
    want = grads(ref)
    queue = WeightGradQueue()
    names = apply_deferred_wgrad(model, queue)
    assert len(names) == 4 * 4 + 4 * 2 + 3 + 2     # 4 blocks x 4 MLA, 4 MLPs (dense + 3 shared) x 2, experts,
    #                                                eh_proj + head
    for i, (ids, labels) in enumerate(mbs):
        queue.backward(i, [model.compute_loss(ids, labels, MTP, AUX).loss], [None], [], model.parameters())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=i == 1):
            queue.run(i)
    assert_same_grads(grads(model), want)


def test_bf16_autocast_stage():
    """Under BF16 autocast the deferred path casts like ``F.linear`` / ``GroupedExperts``: same bits. W runs
    inside an autocast region here: its GEMMs keep the dtypes the forward chose."""
    ref = make_model()
    model = copy.deepcopy(ref)
    queue = WeightGradQueue()
    apply_deferred_wgrad(model, queue)
    ids, labels = batch(1)[0]
    results = []
    for m, q in ((ref, None), (model, queue)):
        stage = Stage(m, 1, 3, range(1, 2))
        x = torch.randn(2, 16, CFG["dim"], generator=torch.Generator().manual_seed(0), requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = stage(x, ids, labels)
        assert out.dtype == torch.float32             # residual stream stays FP32, branches ran in BF16
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
        if q is None:
            out.backward(g)
        else:
            q.backward("k", [out], [g], [x], stage.parameters())
            with torch.autocast("cpu", dtype=torch.bfloat16):
                q.run("k")
        results.append((x.grad, grads(stage)))
    assert torch.equal(results[0][0], results[1][0])
    assert_same_grads(results[1][1], results[0][1])


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_with_activation_recompute(mode):
    """``parallel/recompute.py`` regions (checkpointed, so B re-runs their forwards, deferred linears
    included) still give the plain backward's gradients; W runs only the queued GEMMs."""
    from parallel.recompute import apply_recompute
    ref = make_model()
    model = copy.deepcopy(ref)
    queue = WeightGradQueue()
    apply_deferred_wgrad(model, queue)
    assert apply_recompute(model, mode)
    ids, labels = batch(1)[0]
    ref.compute_loss(ids, labels, MTP, AUX).loss.backward()
    queue.backward("k", [model.compute_loss(ids, labels, MTP, AUX).loss], [None], [], model.parameters())
    queue.run("k")
    assert_same_grads(grads(model), grads(ref))


# -------------------------------------------------------------------------------------------- hooks, FP8
def test_post_accumulate_hooks_fire_once_per_parameter_per_w():
    """ZeRO-2's bucket trigger: deferred weights fire no hook at B and exactly one per W (the head, used by
    LM and MTP, included)."""
    model = make_model()
    queue = WeightGradQueue()
    apply_deferred_wgrad(model, queue)
    fired = {n: 0 for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: fired.__setitem__(n, fired[n] + 1))
    deferred = deferred_names(model)
    for i, (ids, labels) in enumerate(batch(2)):
        queue.backward(i, [model.compute_loss(ids, labels, MTP, AUX).loss], [None], [], model.parameters())
        assert all(fired[n] == (i if n in deferred else i + 1) for n in fired), fired
        queue.run(i)
        assert all(c == i + 1 for c in fired.values()), fired
    assert "head.weight" in deferred and "layers.1.ffn.experts.w2" in deferred and "embed.weight" not in deferred


class RecordingQueue(WeightGradQueue):
    """Logs ("gemm", param) when a queued dW GEMM runs."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def submit(self, param, compute):
        return super().submit(param, lambda: (self.events.append(("gemm", id(param))), compute())[1])


def test_w_accumulates_each_weight_right_after_its_gemms():
    """W holds one dW at a time: each weight's accumulation (hook) follows its own GEMMs, before the next
    weight's GEMMs run (the head's two GEMMs, LM and MTP, are summed first)."""
    model = make_model()
    events = []
    queue = RecordingQueue(events)
    apply_deferred_wgrad(model, queue)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: events.append(("acc", id(p))))
    ids, labels = batch(1)[0]
    queue.backward("k", [model.compute_loss(ids, labels, MTP, AUX).loss], [None], [], model.parameters())
    del events[:]                                                     # B's accumulations: norms, gate, embedding
    queue.run("k")
    runs, current = [], []
    for kind, pid in events:
        current.append(pid)
        if kind == "acc":
            runs.append(current)
            current = []
    assert current == [] and len(runs) == len(queue.deferred)
    assert all(len(set(run)) == 1 for run in runs)                    # GEMMs of one weight, then its accumulation
    assert max(len(run) for run in runs) == 3                         # the head: 2 GEMMs + 1 accumulation


def test_fp8_modules_keep_class_and_numerics_either_order():
    """apply_fp8 then apply_deferred_wgrad: FP8 modules stay FP8 and get the queue; the other order keeps
    the queue through apply_fp8's swap. B then W is bit-exact vs the non-deferred FP8 backward."""
    ref = make_model(fp8=True)
    a = copy.deepcopy(ref)
    qa = WeightGradQueue()
    names = apply_deferred_wgrad(a, qa)
    assert isinstance(a.layers[1].attn.wo, FP8Linear) and a.layers[1].attn.wo.wgrad_queue is qa
    assert isinstance(a.layers[1].ffn.experts, FP8GroupedExperts) and a.layers[1].ffn.experts.wgrad_queue is qa
    assert type(a.head) is DeferredLinear and "head" in names
    b = make_model()
    qb = WeightGradQueue()
    apply_deferred_wgrad(b, qb)
    apply_fp8(b, backend="emulation")
    shared_w13 = b.layers[2].ffn.shared_experts.w13
    assert isinstance(shared_w13, FP8Linear) and shared_w13.wgrad_queue is qb
    assert isinstance(b.layers[2].ffn.experts, FP8GroupedExperts) and b.layers[2].ffn.experts.wgrad_queue is qb
    ids, labels = batch(1)[0]
    ref.compute_loss(ids, labels, MTP, AUX).loss.backward()
    for m, q in ((a, qa), (b, qb)):
        q.backward("k", [m.compute_loss(ids, labels, MTP, AUX).loss], [None], [], m.parameters())
        assert m.layers[1].attn.wo.weight.grad is None and m.layers[1].ffn.experts.w13.grad is None
        q.run("k")
        assert_same_grads(grads(m), grads(ref))


# ------------------------------------------------------------------------------------- converter, errors
def test_converter_keeps_parameters_and_is_idempotent():
    model = make_model()
    params, keys = dict(model.named_parameters()), set(model.state_dict())
    model.layers[1].ffn.experts.expert_offset = 4                 # the EP shard offset survives
    queue = WeightGradQueue()
    names = apply_deferred_wgrad(model, queue)
    assert model.layers[1].ffn.experts.expert_offset == 4
    assert all(p is params[n] for n, p in model.named_parameters()) and set(model.state_dict()) == keys
    assert not any(type(m) in (nn.Linear, GroupedExperts) for m in model.modules())
    assert isinstance(model.layers[0].ffn.w13, nn.Linear)         # still an nn.Linear (init_weights, apply_fp8)
    q2 = WeightGradQueue()
    assert apply_deferred_wgrad(model, q2) == names and model.head.wgrad_queue is q2
    with pytest.raises(ValueError, match="has a bias"):
        apply_deferred_wgrad(nn.Sequential(nn.Linear(4, 4)), queue)


def test_queue_misuse_is_reported():
    queue = WeightGradQueue()
    lin = DeferredLinear.from_linear(nn.Linear(4, 4, bias=False), queue)
    apply_deferred_wgrad(nn.Sequential(lin), queue)
    with pytest.raises(KeyError, match="no B collected"):
        queue.run("mb3")
    with queue.collect("a"), pytest.raises(RuntimeError, match="still collecting"):
        with queue.collect("b"):
            pass
    with pytest.raises(RuntimeError, match="W has not run"), queue.collect("a"):
        pass
    y = lin(torch.randn(2, 4))                     # input without grad: only the deferred weight to differentiate
    with pytest.raises(ValueError, match="nothing for B"):
        queue.backward("c", [y.sum()], [None], [], lin.parameters())
    assert queue.pending() == ["a"] and not queue.deferring


def test_queue_follows_parameters_materialised_after_the_swap():
    """``to_empty`` after ``apply_deferred_wgrad`` (a meta-built model) makes new Parameters: the queue follows."""
    model = build(ModelConfig(**CFG), device="meta", seed=0).train()
    queue = WeightGradQueue()
    apply_deferred_wgrad(model, queue)
    before = list(queue.deferred.values())          # kept alive: their ids cannot be reused
    model.to_empty(device="cpu")
    model.init_weights()
    now = {id(p) for n, p in model.named_parameters() if n in deferred_names(model)}
    assert now == set(queue.deferred) and not now & {id(p) for p in before} and len(before) == len(now)
    ids, labels = batch(1)[0]
    queue.backward("k", [model.compute_loss(ids, labels, MTP, AUX).loss], [None], [], model.parameters())
    assert all((p.grad is None) == (id(p) in now) for p in model.parameters())
    queue.run("k")
    assert all(p.grad is not None for p in model.parameters())
