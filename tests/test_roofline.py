"""The CPU-side roofline of a training step (``tools/roofline.py``): exact counts on a case computed by hand, and
the v3_small step against the H100 measurements it must reproduce."""
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from configs.schema import compose
from models.moe import MoE
from tools import roofline
from tools.roofline import Recorder, as_on_cuda, record_step, totals

M, K, N = 256, 384, 512
F32 = 4


def by_op(rec: Recorder, phase: str) -> dict:
    return {op: s for (ph, _, op), s in rec.stats.items() if ph == phase and s.launches}


def test_linear_cross_entropy_adamw_by_hand():
    """y = x·Wᵀ (x [M,K] without gradient, W [N,K] FP32), cross-entropy over N classes, AdamW (foreach)."""
    rec = Recorder()
    with FakeTensorMode(allow_non_fake_inputs=True):
        w = torch.nn.Parameter(torch.empty(N, K))
        x, y = torch.empty(M, K), torch.randint(0, N, (M,))
        opt = torch.optim.AdamW([w], lr=1e-3)
        with rec, as_on_cuda():
            rec.phase = "forward"
            loss = F.cross_entropy(F.linear(x, w), y)
            rec.phase = "backward"
            loss.backward()
            rec.phase = "optimizer"
            opt.step()
    fwd, bwd, step = by_op(rec, "forward"), by_op(rec, "backward"), by_op(rec, "optimizer")
    # forward: the GEMM, log-softmax, the NLL gather; views (t, detach) launch nothing
    assert set(fwd) == {"aten.mm", "aten._log_softmax", "aten.nll_loss_forward"}
    assert fwd["aten.mm"].flops == 2 * M * K * N
    assert fwd["aten.mm"].bytes == F32 * (M * K + N * K + M * N)                    # read x, W; write y
    assert fwd["aten._log_softmax"].bytes == 2 * F32 * M * N
    assert fwd["aten.nll_loss_forward"].bytes == F32 * M * N + 8 * M + 2 * F32      # log-probs, int64 labels; loss
    # backward: the seed (one scalar written), NLL and log-softmax backward, dW = dYᵀ·x (x needs no gradient)
    assert set(bwd) == {"aten.ones_like", "aten.nll_loss_backward", "aten._log_softmax_backward_data", "aten.mm"}
    assert bwd["aten.ones_like"].bytes == F32
    assert bwd["aten.mm"].flops == 2 * M * K * N and bwd["aten.mm"].bytes == F32 * (M * N + M * K + N * K)
    assert bwd["aten._log_softmax_backward_data"].bytes == 3 * F32 * M * N          # grad, output; grad input
    # AdamW: state created (two zeros), then every foreach op reads and writes whole tensors of W's size; the step
    # counter's increment and read are on the host
    P = F32 * N * K
    assert step["aten.zeros_like"].bytes == 2 * P and step["aten.zeros_like"].launches == 2
    assert step["aten._foreach_mul_"].bytes == 2 * 2 * P       # weight decay on W, β2 on v: read + write each
    assert step["aten._foreach_lerp_"].bytes == 3 * P          # m += (1-β1)(g - m): read m, g; write m
    assert step["aten._foreach_addcmul_"].bytes == 3 * P       # v += (1-β2) g·g: read v, g; write v
    assert step["aten._foreach_addcdiv_"].bytes == 4 * P       # W -= lr m / s: read W, m, s; write W
    assert sum(s.launches for s in step.values()) == 2 + 8     # 2 zeros + mul, mul, lerp, addcmul, sqrt, div, add, addcdiv
    assert all(s.syncs == 0 for s in rec.stats.values())
    assert totals(rec, "phase")["forward"].flops == 2 * M * K * N
    # the prediction: max(FLOPs / rate, bytes / bandwidth) + one launch each
    hw = rec.hw
    mm = fwd["aten.mm"]
    assert mm.seconds == pytest.approx(max(mm.flops / hw.rates["gemm"], mm.bytes / hw.bandwidth["elementwise / other"])
                                       + hw.launch_s)


def test_fused_attention_is_one_kernel_each_way():
    q = torch.empty(2, 4, 64, 96)
    k, v = torch.empty(2, 4, 64, 96), torch.empty(2, 4, 64, 48)
    rec = Recorder()
    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        with rec, roofline.fused_attention(rec):
            rec.phase = "forward"
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            rec.phase = "backward"
            out.sum().backward()
    fwd, bwd = by_op(rec, "forward")["attention forward"], by_op(rec, "backward")["attention backward"]
    flops = 2 * 2 * 4 * 64 * 64 * (96 + 48) / 2
    assert out.shape == (2, 4, 64, 48) and fwd.flops == flops and bwd.flops == 2.5 * flops
    assert fwd.launches == bwd.launches == 1
    assert not [op for (_, _, op) in rec.stats if op in ("aten.bmm", "aten._softmax")]   # not the CPU's decomposition


# Measured on one H100 (../shared/gpu/2026-11-26-h100/: profile_v3small_*_bf16.txt): v3_small, batch 4 x 2048, bf16.
FP32_MOMENTS = "optim.moment_dtype=fp32"   # every measured step below kept FP32 moments
MEASURED_MS = {4: 141.3, 12: 272.0}                                   # 12 layers: 268-276 ms
MEASURED_PHASES_12 = {"forward": 78.0, "backward": 108.5, "optimizer+other": 81.4}


@pytest.mark.parametrize("layers", [4, 12])
def test_v3_small_step_reproduces_the_measured_h100_step(layers, weights_apart):
    """The step as it was measured (AdamW's foreach path, the weights apart; the trainer runs the Triton AdamW on
    CUDA and stacks them since)."""
    rec, _ = record_step(compose(["+exp=v3_small", "train.head_loss=plain", "train.compile=off", FP32_MOMENTS]), layers,
                         fused_adamw=False, adamw_kernel=False)
    phase = {k: s.seconds * 1e3 for k, s in totals(rec, "phase").items()}
    step = sum(phase.values())
    assert abs(step / MEASURED_MS[layers] - 1) < 0.25, (step, phase)
    assert totals(rec, "class")["gemm"].launches == {4: 141, 12: 357}[layers]   # aten::mm calls in the profiles
    if layers == 12:
        got = {"forward": phase["forward"], "backward": phase["backward"],
               "optimizer+other": phase["optimizer"] + phase["other"]}
        for k, want in MEASURED_PHASES_12.items():
            assert abs(got[k] / want - 1) < 0.35, (k, got[k], want)


# The 4-layer step with torch's fused AdamW, per train.head_loss, measured by the GPU suite's step part on an H100
# (one session, docs/benchmarks.md): plain 118.1 ms, fused 88.0 ms, chunked 168.7 ms.
MEASURED_HEAD_MS = {"plain": 118.1, "fused": 88.0, "chunked": 168.7}


@pytest.mark.parametrize("head_loss", sorted(MEASURED_HEAD_MS))
def test_each_head_loss_reproduces_its_measured_step(head_loss, weights_apart):
    rec, _ = record_step(compose(["+exp=v3_small", f"train.head_loss={head_loss}", "train.compile=off",
                                  FP32_MOMENTS]), 4,
                         adamw_kernel=False)
    step = sum(s.seconds for s in totals(rec, "phase").values()) * 1e3
    assert abs(step / MEASURED_HEAD_MS[head_loss] - 1) < 0.25, (head_loss, step)
    loss_ops = totals(rec, "op")
    fused = [k for k in loss_ops if k.startswith("cross-entropy")]
    assert bool(fused and sum(loss_ops[k].calls for k in fused) == 4) == (head_loss == "fused"), fused  # 2 heads, fwd+bwd


def test_compiled_regions_are_one_kernel_each_way():
    """``train.compile``: each norm, SwiGLU product, MoE combine and rotation is one fused kernel each way (plus
    the reductions its weights need), reading inputs and writing its output once; each router's selection and
    balance terms too (the selection's top-k's are ranks, ``models.moe.ranks``: no torch kernel splits the region;
    a top-k would, followed by one more generated kernel); nothing else changes."""
    eager, _ = record_step(compose(["+exp=tiny", "train.precision=bf16", "train.compile=off"]))
    comp, mcfg = record_step(compose(["+exp=tiny", "train.precision=bf16"]))
    ops = totals(comp, "op")
    norms = 4 * mcfg.n_layers + 1 + 7 * mcfg.mtp_depth   # attn/ffn/q/kv per block, final; MTP: its block's 4 + 3
    moes = mcfg.n_layers - mcfg.first_k_dense + mcfg.mtp_depth
    swiglus = mcfg.first_k_dense + 2 * moes                                  # dense MLPs; shared + routed experts
    attns = mcfg.n_layers + mcfg.mtp_depth
    assert ops["compiled region forward"].calls == norms + swiglus + moes + 2 * attns + 2 * moes
    assert "aten.topk" not in ops and "aten.topk" not in totals(eager, "op")
    # + dweight, dgate, dk; each router's dlogits and dscores
    assert ops["compiled region backward"].calls == 2 * norms + swiglus + 2 * moes + 3 * attns + 2 * moes
    assert "compiled region forward" not in totals(eager, "op")
    for key in ("gemm", "grouped gemm", "attention"):
        assert totals(comp, "class")[key].flops == totals(eager, "class")[key].flops, key
    assert totals(comp, "class")["elementwise / other"].bytes < 0.7 * totals(eager, "class")["elementwise / other"].bytes
    assert sum(s.seconds for s in totals(comp, "phase").values()) < sum(s.seconds for s in totals(eager, "phase").values())


def test_fused_adamw_reads_and_writes_each_tensor_once():
    """AdamW fused (what ``parallel.zero.fused_adamw`` picks on CUDA): parameter, gradient and both moments read once,
    written once (7 x 4 bytes per FP32 parameter), against the foreach path's 20 passes."""
    cfg = compose(["+exp=tiny", "train.precision=bf16", FP32_MOMENTS])   # torch's AdamW keeps FP32 moments
    fused, _ = record_step(cfg, fused_adamw=True, adamw_kernel=False)
    foreach, _ = record_step(cfg, fused_adamw=False, adamw_kernel=False)
    op = totals(fused, "op")["aten._fused_adamw_"]
    params = list(__import__("models").build(cfg.model, "meta").parameters())
    assert op.bytes == 7 * 4 * sum(p.numel() for p in params) + 4 * len(params)   # + each tensor's step counter
    assert totals(fused, "phase")["optimizer"].seconds < 0.6 * totals(foreach, "phase")["optimizer"].seconds


# The full 12-layer v3_small step on one H100 (docs/log/, the lean-step sessions; bench.step_variants): GPU busy
# time (summed kernel time of one profiled step) and wall time, ms. The eager step waits for the host, so its wall
# is longer than the kernels; the roofline predicts the kernels. The compiled step with FP32 moments ran without
# the rope region (parallel/compile.py), which the prediction includes (3.6 ms less).
# These steps ran an earlier model code, which the fixture ``as_measured`` restores: each attention's rotation alone a
# region and the routers eager (the regions then); the values a view of the key/value up-projection's output, not a
# copy; the MTP module looked its embeddings up again; the bias update ran layer by layer; the combine's sum had no
# dtype, so that CUDA's autocast made the residual stream FP32 after the first MoE layer (tools.cuda_autocast). Not
# restored: the gate's GEMM ran in BF16 under the autocast then, with two casts more per layer (0.5 ms); the trainer's
# finiteness check, which bench.step_variants did not run then, shares the gradient norm's pass (one pass then and
# now). The trainer's default of that time (115.8 / 120.7 ms) is superseded by the present default's measurement
# below. With CUDA's autocast rules the roofline prices the eager step's FP32 residual stream 14 % over its measured
# kernels (193 against 170 ms; its casts and index writes), past this test's 10 %: a known gap, held as such.
MEASURED_12_BUSY_WALL = {"eager, torch's AdamW": (170.0, 184.8), "compiled regions, Triton AdamW": (121.7, 156.6)}
EAGER_GAP = pytest.mark.xfail(strict=True, reason="the roofline prices the eager FP32-residual step 14 % over its "
                              "measured kernels (comment above MEASURED_12_BUSY_WALL)")


def _kv_heads_measured(kv_BTC, k_pe_BTR, cos, sin, n_heads, nope, rotate):
    B, T, _ = kv_BTC.shape
    k_nope, v = kv_BTC.view(B, T, n_heads, -1).transpose(1, 2).split([nope, kv_BTC.shape[-1] // n_heads - nope], -1)
    return rotate(k_nope, k_pe_BTR.unsqueeze(1), cos, sin), v


def _apart_swiglu(h1, h3):
    return F.silu(h1) * h3


def _apart(monkeypatch) -> None:
    """The stacked weights apart, as every measured step below ran (``w13`` and ``wqkv_a`` stack them now), each its
    own GEMM and the input's gradient the sum of two: the gate and up projections ``w1`` and ``w3`` (``MLP``,
    ``GroupedExperts``, and the SwiGLU's compiled region of two inputs), the attention's ``wq_a`` and ``wkv_a``; and
    the residual add after attention outside the FFN norm's compiled region (``RMSNorm.residual`` eager, as it is by
    default: ``RESIDUAL_ENV``)."""
    from torch import nn

    from models.attention import MLA
    from models.layers import MLP, SwiGLU
    from models.moe import GroupedExperts
    from parallel import compile as regional
    mla_init = MLA.__init__

    def attention_init(self, cfg):
        mla_init(self, cfg)
        del self.wqkv_a
        self.wq_a = nn.Linear(cfg.dim, self.q_rows, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
    monkeypatch.setattr(regional, "OTHER_METHODS", {})
    monkeypatch.setattr(MLA, "__init__", attention_init)
    monkeypatch.setattr(MLA, "forward", lambda self, x, rope: self.wo(self.core(
        self.wq_a(x), *self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1), rope)))

    def mlp_init(self, dim, inter_dim):
        nn.Module.__init__(self)
        self.w1, self.w2, self.w3 = (nn.Linear(i, o, bias=False) for i, o in
                                     ((dim, inter_dim), (inter_dim, dim), (dim, inter_dim)))
        self.act = SwiGLU()

    def experts_init(self, n_experts, dim, inter_dim, expert_offset=None):
        nn.Module.__init__(self)
        self.expert_offset = expert_offset
        self.w1, self.w3 = (nn.Parameter(torch.empty(n_experts, inter_dim, dim)) for _ in range(2))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, inter_dim))
        self.act = SwiGLU()

    def experts_forward(self, x_RD, tokens_per_expert):
        x_RD, w1, w2, w3 = x_RD, self.w1, self.w2, self.w3
        if torch.is_autocast_enabled(x_RD.device.type):
            dtype = torch.get_autocast_dtype(x_RD.device.type)
            x_RD, w1, w2, w3 = (t.to(dtype) for t in (x_RD, w1, w2, w3))
        offs = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
        h = self.act(*(torch._grouped_mm(x_RD, w.transpose(-2, -1), offs=offs) for w in (w1, w3)))
        return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
    monkeypatch.setattr(MLP, "__init__", mlp_init)
    monkeypatch.setattr(MLP, "forward", lambda self, x: self.w2(self.act(self.w1(x), self.w3(x))))
    monkeypatch.setattr(GroupedExperts, "__init__", experts_init)
    monkeypatch.setattr(GroupedExperts, "forward", experts_forward)
    monkeypatch.setattr(SwiGLU, "forward", lambda self, h1, h3: _apart_swiglu(h1, h3))
    monkeypatch.setitem(regional.FORWARDS, SwiGLU,
                        lambda self, h1, h3: regional.region(_apart_swiglu, self.compile_backend)(h1, h3))


@pytest.fixture
def weights_apart(monkeypatch):
    _apart(monkeypatch)


@pytest.fixture
def as_measured(monkeypatch, weights_apart):
    """The model code and ``apply_compile`` as they were when the steps above were measured (comment above)."""
    from models import moe, transformer
    from models.attention import MLA
    from models.layers import rope_heads
    from models.moe import MoE
    from parallel import compile as regional
    apply_compile = regional.apply_compile

    def regions_then(model, backend="inductor"):   # each attention's rotation alone; the routers eager
        names = apply_compile(model, backend)
        for m in model.modules():
            if isinstance(m, MLA):
                del m.query_heads, m.kv_heads
                m.rope_heads = regional.Region(rope_heads, backend)
            if isinstance(m, MoE):
                del m.gate.select, m.balance_terms
        return names
    monkeypatch.setattr(regional, "apply_compile", regions_then)
    monkeypatch.setattr(MLA, "kv_heads", staticmethod(_kv_heads_measured))
    head_loss_steps = transformer.head_loss_steps
    monkeypatch.setattr(transformer, "head_loss_steps", lambda *a, emb_BTD=None, **kw: head_loss_steps(*a, **kw))

    def update_expert_bias(model, gamma):
        for moe in model.moe_layers():
            load = moe.tokens_per_expert.clone().to(moe.gate.expert_bias)
            moe.gate.expert_bias.add_(gamma * torch.sign(load.mean() - load))
            moe.tokens_per_expert.zero_()
    monkeypatch.setattr(transformer.DeepSeekV3, "update_expert_bias", update_expert_bias)
    monkeypatch.setattr(moe, "gate_weighted_sum", _weighted_sum_then)


def _weighted_sum_then(y_TKD, w_TK):
    """The combine's sum without a dtype, as it was: FP32 under CUDA's autocast, and the residual stream with it."""
    return (y_TKD * w_TK.unsqueeze(-1).to(y_TKD.dtype)).sum(1)


@pytest.mark.parametrize("variant", [pytest.param(v, marks=EAGER_GAP) if v.startswith("eager") else v
                                     for v in sorted(MEASURED_12_BUSY_WALL)])
def test_v3_small_prediction_is_the_measured_gpu_busy_time(variant, as_measured):
    overrides = ["+exp=v3_small", FP32_MOMENTS] + (["train.compile=off"] if variant.startswith("eager") else [])
    rec, _ = record_step(compose(overrides), 12, adamw_kernel=not variant.startswith("eager"))
    step = sum(s.seconds for s in totals(rec, "phase").values()) * 1e3
    busy, wall = MEASURED_12_BUSY_WALL[variant]
    assert abs(step / busy - 1) < 0.10 and step < wall, (variant, step, busy, wall)


# The trainer's default as last measured on an H100 (docs/benchmarks.md, One H100: bench.step_variants --layers 12
# --variants G, batch 4 x 2048, BF16, replayed from a CUDA graph): GPU busy and wall, ms; it ran with the stacked
# weights apart (the fixture ``weights_apart``). The roofline's rates for top-k's, sorts and accumulating index
# writes came from an earlier profile of the default.
MEASURED_DEFAULT_12_BUSY_WALL = (100.6, 104.2)


def test_v3_small_prediction_is_the_default_s_measured_gpu_busy_time(weights_apart):
    rec, _ = record_step(compose(["+exp=v3_small"]), 12)
    assert totals(rec, "op")["aten.sort"].calls == 12 and "aten.topk" not in totals(rec, "op")
    step = sum(s.seconds for s in totals(rec, "phase").values()) * 1e3
    busy, wall = MEASURED_DEFAULT_12_BUSY_WALL
    assert abs(step / busy - 1) < 0.10 and step < wall, (step, busy, wall)


def test_stacked_weights_and_the_residual_region_drop_adds(monkeypatch):
    """``w13``: per MoE layer one grouped GEMM and one input gradient instead of two and an add over the R = T*K
    routed copies, likewise per MLP (the dense layer, the shared experts) over the T tokens: 12 MoE layers (11 and
    MTP's) and 13 MLPs. ``wqkv_a``: the same per attention (13) over the T tokens, less the concatenation of its
    two parts' gradients (the split's backward). ``RMSNorm.residual`` compiled (opt-in, ``parallel.compile.
    RESIDUAL_ENV``): the residual add after each of the
    13 attentions inside the FFN norm's region, forward and backward (there it sums the residual stream's two
    gradients). Unmeasured on a GPU: the roofline prices the adds removed (each read twice, written once), their
    launches, and one input read fewer per GEMM pair."""
    from parallel.compile import RESIDUAL_ENV
    cfg = compose(["+exp=v3_small"])
    with monkeypatch.context() as m:
        m.setenv(RESIDUAL_ENV, "1")   # the fused residual region is opt-in
        now = record_step(cfg, 12)[0]
    with monkeypatch.context() as m:
        _apart(m)
        then = record_step(cfg, 12)[0]
    (gm_now, mm_now), (gm_then, mm_then) = ([totals(r, "op")[k].calls for k in ("aten._grouped_mm", "aten.mm")]
                                            for r in (now, then))
    assert (gm_then - gm_now, mm_then - mm_now) == (3 * 12, 3 * 13 + 3 * 13)   # each: a forward, a Dgrad, a Wgrad
    D, T, T_mtp, K = 1024, 4 * 2048, 4 * 2047, 8
    adds = [by_op(r, "backward")["aten.add"] for r in (now, then)]
    rows = 11 * T * K + T_mtp * K + 3 * (12 * T + T_mtp)   # routed copies; MLPs, attentions, residuals on tokens
    assert adds[1].calls - adds[0].calls == 51 and adds[1].bytes - adds[0].bytes == 3 * 2 * D * rows
    adds = [by_op(r, "forward")["aten.add"] for r in (now, then)]
    assert adds[1].calls - adds[0].calls == 13 and adds[1].bytes - adds[0].bytes == 3 * 2 * D * (12 * T + T_mtp)
    cats = by_op(now, "backward")["aten.cat"]   # wqkv_a's output split in three at once: one concatenation each
    assert cats.calls == 13 and cats.bytes == 2 * 2 * (512 + 256 + 32) * (12 * T + T_mtp)
    saved = sum(s.seconds for s in then.stats.values()) - sum(s.seconds for s in now.stats.values())
    assert saved * 1e3 > 3.0


def test_the_gradient_in_the_forward_reads_the_logits_once():
    """``train.head_loss=inplace`` against ``fused``, two heads (main: T tokens, MTP: T - B) of V BF16 logits: the
    cross-entropy kernel writes the gradient over the logits in the forward (read and written once: the
    backward's read and write of the fused kernel go, and the forward's write comes), and the backward scales
    the GEMMs' small operands instead (two passes over each head's ``[N, D]``). Unmeasured on a GPU."""
    cfg = compose(["+exp=v3_small"])
    fused = record_step(cfg, 1)[0]
    inplace = record_step(compose(["+exp=v3_small", "train.head_loss=inplace"]), 1)[0]
    D, V, rows = 1024, 129280, 4 * 2048 + 4 * 2047
    ce = {name: sum(s.bytes for k, s in r.stats.items() if k[1] == "softmax / loss") for name, r in
          (("fused", fused), ("inplace", inplace))}
    small = 64 * rows   # per row: the label, the loss, the fused kernel's log-sum-exp
    assert abs(ce["fused"] - 3 * 2 * V * rows) < small and abs(ce["inplace"] - 2 * 2 * V * rows) < small
    scale = by_op(inplace, "backward")["aten.mul"].bytes - by_op(fused, "backward")["aten.mul"].bytes
    assert scale == 2 * 2 * 2 * D * rows + 2 * 2 * 4   # dx and x: read and written in BF16; g read twice per head
    saved = sum(s.seconds for s in fused.stats.values()) - sum(s.seconds for s in inplace.stats.values())
    assert saved * 1e3 > 1.2


def test_the_gathered_dispatch_opt_in_drops_the_accumulating_index_writes(monkeypatch):
    """``DSV3_GATHER_COPIES=1`` (``parallel.compile.GATHER_ENV``): each MoE layer's dispatch becomes a compiled
    region, one kernel forward and two backward (the inverse permutation's scatter, then the copies' gradients
    gathered and summed per token), in place of the accumulating index write (12 at the measured rate) and its
    zero fill. Unmeasured on a GPU."""
    from parallel.compile import GATHER_ENV
    cfg = compose(["+exp=v3_small"])
    base = record_step(cfg, 12)[0]
    monkeypatch.setenv(GATHER_ENV, "1")
    gathered = record_step(cfg, 12)[0]
    moes = 12
    assert by_op(base, "backward")["aten.index_put"].calls == moes and "aten.index_put" not in by_op(gathered, "backward")
    (f0, b0), (f1, b1) = ([totals(r, "op")[f"compiled region {w}"].calls for w in ("forward", "backward")]
                          for r in (base, gathered))
    assert (f1 - f0, b1 - b0) == (moes, 2 * moes)
    saved = sum(s.seconds for s in base.stats.values()) - sum(s.seconds for s in gathered.stats.values())
    assert saved * 1e3 > 1.5


def test_the_heads_laid_out_bthd_drop_the_attention_output_s_copy(monkeypatch):
    """``DSV3_HEADS_BTHD=1`` (``parallel.compile.HEADS_ENV``): queries, keys and values laid out ``[B,T,H,.]``; the
    attention's output, laid out like its query (as cuDNN's kernel lays it out: to be confirmed on a GPU), becomes
    wo's input as a view: 13 copies of ``[B,T,H*V]`` fewer in the forward. Unmeasured on a GPU."""
    from parallel.compile import HEADS_ENV
    cfg = compose(["+exp=v3_small"])
    base = record_step(cfg, 12)[0]
    monkeypatch.setenv(HEADS_ENV, "1")
    bthd = record_step(cfg, 12)[0]
    clones = [by_op(r, "forward")["aten.clone"] for r in (base, bthd)]
    rows = 12 * 4 * 2048 + 4 * 2047
    assert clones[0].calls - clones[1].calls == 13 and clones[0].bytes - clones[1].bytes == 2 * 2 * 16 * 64 * rows
    assert sum(s.seconds for s in bthd.stats.values()) < sum(s.seconds for s in base.stats.values())


def test_fp8_linear_by_hand():
    """An FP8 linear (x [M,K], W [N,K], BF16) forward and backward as CUDA's auto backend runs it: each quantiser,
    the weight's transpose and each GEMM one kernel, with its bytes and FLOPs; the Wgrad's FP32 output cast."""
    from parallel.fp8 import fp8_linear
    from tools.roofline_fp8 import fp8_kernels
    rec, bf16 = Recorder(), 2
    with FakeTensorMode(allow_non_fake_inputs=True):
        w = torch.nn.Parameter(torch.empty(N, K, dtype=torch.bfloat16))
        x = torch.empty(M, K, dtype=torch.bfloat16, requires_grad=True)
        with rec, fp8_kernels(rec):
            rec.phase = "forward"
            y = fp8_linear(x, w)
            rec.phase = "backward"
            y.backward(torch.empty_like(y))
    fwd, bwd = by_op(rec, "forward"), by_op(rec, "backward")
    assert set(fwd) == {"fp8 quantise 1x128", "fp8 quantise 128x1", "fp8 quantise 128x128", "fp8 transpose",
                        "fp8 gemm"} and all(s.launches == 1 for s in fwd.values())
    scales = lambda rows, cols: F32 * rows * (cols // 128)          # noqa: E731 - FP32 scales of 128-wide tiles
    assert fwd["fp8 quantise 1x128"].bytes == bf16 * M * K + M * K + scales(M, K)     # read x, write q and s
    assert fwd["fp8 quantise 128x1"].bytes == bf16 * M * K + M * K + scales(K, M)     # xᵀ's tiles for Wgrad
    assert fwd["fp8 quantise 128x128"].bytes == bf16 * N * K + N * K + F32 * (N // 128) * (K // 128)
    assert fwd["fp8 transpose"].bytes == 2 * N * K                                      # Dgrad's K-major copy
    assert fwd["fp8 gemm"].flops == 2 * M * N * K
    assert fwd["fp8 gemm"].bytes == M * K + scales(M, K) + N * K + F32 * (N // 128) * (K // 128) + bf16 * M * N
    # backward: dy quantised both ways, Dgrad (128x128 weight scales), Wgrad (per-row scales), its FP32 out cast
    assert set(bwd) == {"fp8 quantise 1x128", "fp8 quantise 128x1", "fp8 gemm", "fp8 gemm wgrad", "aten._to_copy"}
    assert bwd["fp8 gemm"].flops == bwd["fp8 gemm wgrad"].flops == 2 * M * N * K
    assert bwd["fp8 gemm wgrad"].bytes == N * M + scales(N, M) + K * M + scales(K, M) + F32 * N * K
    assert bwd["aten._to_copy"].bytes == (F32 + bf16) * N * K
    hw = rec.hw
    for name in ("fp8 gemm", "fp8 gemm wgrad"):
        assert bwd[name].seconds == pytest.approx(max(bwd[name].flops / hw.rates[name],
                                                      bwd[name].bytes / hw.bandwidth["elementwise / other"])
                                                  + hw.launch_s)
    q = fwd["fp8 quantise 128x1"]
    assert q.seconds == pytest.approx(q.bytes / hw.bandwidth["fp8 quantise 128x1"] + hw.launch_s)


def test_fp8_grouped_wgrad_contracts_over_the_tile_space():
    """The grouped Wgrad multiplies each expert's tokens padded to whole 128-token tiles: ⌈R/128⌉ + E - 1 of
    them, its FLOPs counted over those columns."""
    from parallel.fp8 import fp8_grouped_linear
    from tools.roofline_fp8 import fp8_kernels
    E, R = 4, 1000
    rec = Recorder()
    with FakeTensorMode(allow_non_fake_inputs=True):
        w = torch.nn.Parameter(torch.empty(E, N, K, dtype=torch.bfloat16))
        x = torch.empty(R, K, dtype=torch.bfloat16, requires_grad=True)
        tpe = torch.empty(E, dtype=torch.int64)
        with rec, fp8_kernels(rec):
            rec.phase = "forward"
            y = fp8_grouped_linear(x, w, tpe)
            rec.phase = "backward"
            y.backward(torch.empty_like(y))
    fwd, bwd = by_op(rec, "forward"), by_op(rec, "backward")
    assert y.shape == (R, N)
    assert fwd["fp8 grouped gemm"].flops == bwd["fp8 grouped gemm"].flops == 2 * R * N * K
    cols = (-(-R // 128) + E - 1) * 128
    assert bwd["fp8 grouped wgrad"].flops == 2 * N * K * cols
    assert bwd["aten._to_copy"].bytes == (F32 + 2) * E * N * K


def test_v3_small_fp8_step_adds_the_measured_fp8_gap():
    """The FP8 step costs what the BF16 one does plus its quantisers, transposes, casts and slower grouped GEMMs:
    an H100 measured 146.9 ms against 112.3 ms for BF16 in one process (docs/log/, the BF16 residual session), with
    code that the roofline cannot run as it was (the weights apart, which FP8 no longer takes, and the residual
    stream in FP32); their difference, 34.6 ms, is the present code's within the 35 % of a phase."""
    preds = {}
    for precision in ("bf16", "fp8"):
        rec, _ = record_step(compose(["+exp=v3_small", f"train.precision={precision}"]))
        preds[precision] = totals(rec, "phase")
    gap = sum(s.seconds for s in preds["fp8"].values()) - sum(s.seconds for s in preds["bf16"].values())
    assert gap * 1e3 == pytest.approx(146.9 - 112.3, rel=0.35)
    assert preds["fp8"]["optimizer"].seconds == pytest.approx(preds["bf16"]["optimizer"].seconds)
    # every model GEMM is still there: FP8 ones carry the BF16 step's FLOPs (the grouped Wgrad's tile padding aside)
    fp8_flops = preds["fp8"]["forward"].flops + preds["fp8"]["backward"].flops
    bf16_flops = preds["bf16"]["forward"].flops + preds["bf16"]["backward"].flops
    assert bf16_flops <= fp8_flops <= 1.02 * bf16_flops


def test_the_wgrad_written_in_bf16_drops_the_casts(monkeypatch):
    """``DSV3_FP8_WGRAD_BF16=1``: no FP32 weight gradient and no cast of it; the GEMMs write half the bytes."""
    from parallel.fp8 import WGRAD_BF16_ENV
    cfg = compose(["+exp=v3_small", "train.precision=fp8"])
    runs = {}
    for env in ("0", "1"):
        monkeypatch.setenv(WGRAD_BF16_ENV, env)
        runs[env] = by_op(record_step(cfg, layers=2)[0], "backward")
    params = sum(p.numel() for p in fake_params(cfg, layers=2, fp8=True))
    casts = runs["0"]["aten._to_copy"].bytes - runs["1"].get("aten._to_copy", roofline.Stat()).bytes
    assert casts == (F32 + 2) * params                      # each FP8 weight's gradient read in FP32, written in BF16
    for op in ("fp8 gemm wgrad", "fp8 grouped wgrad"):
        assert runs["0"][op].flops == runs["1"][op].flops
    written = sum(runs["0"][op].bytes - runs["1"][op].bytes for op in ("fp8 gemm wgrad", "fp8 grouped wgrad"))
    assert written == (F32 - 2) * params


def fake_params(cfg, layers: int, fp8: bool) -> list:
    """The parameters of ``cfg``'s model cut to ``layers`` that FP8 GEMMs multiply (on meta)."""
    import dataclasses

    import models
    from parallel.fp8 import FP8GroupedExperts, FP8Linear, apply_fp8
    model = models.build(dataclasses.replace(cfg.model, n_layers=layers), device="meta")
    if fp8:
        apply_fp8(model)
    return [m.weight for m in model.modules() if isinstance(m, FP8Linear)] + \
        [p for m in model.modules() if isinstance(m, FP8GroupedExperts) for p in m.parameters()]


def test_adamw_kernel_by_hand():
    """``Replicated``'s Triton AdamW with BF16 weights: one norm read of each gradient, then one launch per
    parameter at 2 + 4·4 + 4·3 + 2 = 28 bytes per element; no clip multiply, FP32 gradient copy or cast pass."""
    from types import SimpleNamespace

    from parallel.dims import ParallelDims
    from parallel.zero import Replicated
    rec = Recorder()
    optim = SimpleNamespace(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    with FakeTensorMode(allow_non_fake_inputs=True):
        lin = torch.nn.Linear(K, N)
        with as_on_cuda():
            opt = Replicated(lin, optim, ParallelDims(world_size=1), None, weights="bf16")
        x = torch.empty(M, K, dtype=torch.bfloat16)
        with rec, as_on_cuda(), roofline.adamw_kernel_recorded(rec):
            rec.phase = "forward"
            loss = lin(x).float().sum()
            rec.phase = "backward"
            opt.backward(loss)
            rec.phase = "optimizer"
            opt.step(1.0)
    bwd, step = by_op(rec, "backward"), by_op(rec, "optimizer")
    assert bwd["aten._to_copy"].bytes == (4 + 2) * M * N    # only dY cast to BF16: no FP32 copy of a gradient
    elems = N * K + N
    kernel = step["adamw kernel"]
    assert kernel.launches == kernel.calls == 2 and kernel.bytes == 28 * elems
    assert step["aten._foreach_norm"].bytes == 2 * elems + 2 * 8 and step["aten._foreach_norm"].calls == 1
    assert not [op for op in step if op.startswith(("aten._foreach_mul", "aten._foreach_copy", "aten._fused_adam"))]
    assert totals(rec, "class")["optimizer"].seconds == pytest.approx(
        kernel.bytes / rec.hw.bandwidth["elementwise / other"] + 2 * rec.hw.launch_s)


def test_v3_small_optimizer_is_the_adamw_kernel():
    """v3_small's optimizer phase on the Triton AdamW: one launch and 20 bytes per parameter (BF16 moments; 18
    with a split master), at most 0.7x torch's fused AdamW with its clip, casts and copy."""
    kernel, mcfg = record_step(compose(["+exp=v3_small"]), 4)
    fp32, _ = record_step(compose(["+exp=v3_small", FP32_MOMENTS]), 4)
    fused, _ = record_step(compose(["+exp=v3_small", FP32_MOMENTS]), 4, adamw_kernel=False)
    n = sum(p.numel() for p in __import__("models").build(mcfg, "meta").parameters())
    assert totals(kernel, "op")["adamw kernel"].bytes == (2 + 4 * 2 + 2 * 2 * 2 + 2) * n
    assert totals(fp32, "op")["adamw kernel"].bytes == 28 * n
    assert totals(kernel, "phase")["optimizer"].seconds < 0.7 * totals(fused, "phase")["optimizer"].seconds
    # optim.master=split: the low halves read and written, the BF16 weight (the high halves) read too
    split, _ = record_step(compose(["+exp=v3_small", "optim.master=split"]), 4)
    assert totals(split, "op")["adamw kernel"].bytes == (2 + 2 * 2 + 2 * 2 + 2 * 2 * 2) * n


def test_cli_last_line(capsys):
    assert roofline.main(["+exp=tiny", "train.precision=bf16", "--top", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    last = lines[-1]
    assert last.startswith("predicted step: ") and last.endswith("% MFU)") and " ms on H100 (" in last
    top = lines[lines.index("-- top ops") + 1:][:4]
    assert [r.split(":")[0] in roofline.PHASES for r in top] == [True, True, True, False], top   # 3 ops, then sources


def test_sorts_top_ks_and_accumulating_index_writes_have_their_measured_rates():
    """Priced by their bytes at copy speed they were 1.2 ms of the measured 5.9: their own classes and rates."""
    x, i = torch.zeros(4), [torch.zeros(2, dtype=torch.long)]
    assert roofline.op_class("aten.topk") == roofline.op_class("aten.sort") == "sort / top-k"
    assert roofline.op_class("aten.index_put", (x, i, x[:2], True)) == "accumulating index write"
    assert roofline.op_class("aten.index_put_", (x, i, x[:2]), {"accumulate": True}) == "accumulating index write"
    assert roofline.op_class("aten.index_put", (x, i, x[:2], False)) == "elementwise / other"
    assert roofline.op_class("aten.index_put", (x, i, x[:2])) == "elementwise / other"
    hw = roofline.H100
    assert hw.bandwidth["sort / top-k"] < hw.bandwidth["accumulating index write"] < hw.bandwidth["copy / cast"]
    assert any(src.startswith("sort / top-k") for src in hw.sources)
    assert any(src.startswith("accumulating index write") for src in hw.sources)
