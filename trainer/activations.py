"""Activation memory model of ``trainer/memory_plan.py``: bytes saved for backward per token, by ``train.recompute`` mode
(``parallel/recompute.py`` says what each mode recomputes); a = 2 bytes for bf16 activations, 4 for fp32; f = 4:
  none      norm(n)   = n*f + 2*n*a   fp32 copy for the variance, normalised, scaled (the next matmul's input)
            attention = norm(D) + norm(q_lora) + norm(kv_lora) + R*a + core
            core      = (2*H*d_qk + H*(d_nope + d_v) + 2*H*d_v)*a + H*f   (flash: q, k, the kv up-projection
                        output that holds v, the output and its reshaped copy, the log-sum-exp); PyTorch's
                        math SDPA (CPU, ``math_attention``): (2*H*d_qk + 2*H*d_v)*a + H*T*f (probabilities)
            dense FFN = norm(D) + 4*I*a   (gate and up as w13's output, SiLU, product)
            MoE       = norm(D) + route + 2*K*D*a + 4*K*F*a + 4*F_s*a, route = E*f + 2*K*f + 16*K
                        (router scores, gate weights, int64 indices; dispatched and returned token copies,
                        SwiGLU of K experts and of the shared experts)
            head use  = norm(D) + V*f     (fp32 log-softmax of the logits; the fused cross-entropy on CUDA,
                        ``head_loss="fused"``: V*a + f, the logits in their dtype and the log-sum-exp)
            MTP depth = 2*norm(D) + 2*D*a + attention + MoE + head use
  selective a norm keeps its input and the next linear its output: snorm = 2*D*a; ``MLA.core`` (the
            up-projections and the attention) keeps its latents and wo its output: attention = snorm +
            q_lora*a (H*d_qk*a without q_lora) + (kv_lora + R)*a + H*d_v*a;
            a SwiGLU keeps h13 (h1 and h3) and (w2) the product: dense FFN = snorm + 3*I*a, shared experts 3*F_s*a,
            routed experts 2*K*D*a + 3*K*F*a; head use = snorm + V*f (fused: V*a + f); MTP's norms: 3*D*a instead
            of 2*norm(D) + 2*D*a
  full      dense layer = D*a (its input); MoE layer = 3*D*a + route + 2*K*D*a (block input, residual after
            attention, FFN-norm output; the dispatched and returned token copies); head use and MTP's
            projection as none, MTP's block as a layer
Deferred weight gradients (schedules with B/W, ``parallel/wgrad.py``): the routed experts save x, h13 (2*K*F*a
            of SwiGLU in none and selective); their backward holds 5*K*F*a per token (7 under full) and, in a full
            backward, the local experts' three weight gradients at once; a B keeps ``wgrad_held_bytes_per_token``
            (every deferred GEMM's x and dy) until its W (``peak_live``'s ``held``).
Recomputation holds one layer's recomputed tensors at a time in backward, counted once per rank: selective
the bytes a layer drops, full a whole dense layer, or the largest region of a MoE layer (attention, the
routed experts' 4*K*F*a, the shared experts' 4*F_s*a).
FP8 (``train.precision=fp8``, ``parallel/fp8.py``, ``fp8=True``): an FP8 linear or expert GEMM saves its input only
as its own FP8 copy, c(n) = n + n/32 per token (E4M3 and an FP32 scale per 128 tokens of each feature), each
linear separately (the attention's input one copy: ``wqkv_a`` stacks its query and key/value projections; an MLP's
one: ``w13`` stacks gate and up). The
head, the gate and MTP's eh_proj are not FP8: their inputs, and the norms before them, are as above.
  none      attention: norm(D) -> D*f + D*a + c(D), norm(q_lora) -> q_lora*(f + a) + c(q_lora), likewise
            kv_lora; core: the output's reshaped copy (wo's input) c(H*d_v) instead of H*d_v*a
            dense FFN = D*f + D*a + c(D) + 3*I*a + c(I)   (w13's copy, gate and up, SiLU, w2's copy)
            MoE: routed experts K*D*a + K*c(D) + 3*K*F*a + K*c(F) (the returned copy; the dispatched one is kept
            only as w13's copy), shared experts c(D) + 3*F_s*a + c(F_s); the FFN norm keeps D*f + 2*D*a
  selective snorm = D*a + c(D) (attention, dense FFN; the MoE norm's stays 2*D*a); wo keeps
            c(H*d_v); dense FFN = snorm + 2*I*a + c(I); a MoE SwiGLU keeps h13 as FP8 (``FP8CachedSwiGLU``, 1x128
            tiles along its 2n features): s8(n) = 2*n + 4*ceil(2*n/128); routed experts K*D*a + K*c(D) + K*s8(F)
            + K*c(F), shared experts c(D) + s8(F_s) + c(F_s)
  full      the layers keep what they keep without FP8 (region inputs); the regions recompute the FP8 layers
            above: routed experts K*c(D) + 3*K*F*a + K*c(F), shared experts c(D) + 3*F_s*a + c(F_s)
  B/W       FP8 experts keep their class under ``parallel.wgrad`` (no deferred-experts saving);
            ``experts_backward`` keeps the bound above
  Not modelled per token: the FP8 weight copies backward keeps (1 byte per weight element plus 128x128 block
  scales, per weight and shared by the micro-batches in flight, ``WeightFP8``), and the routed experts'
  tile padding: their copies are in 128-row tiles restarting at each of the E_loc local experts,
  (ceil(R_e/128) + E_loc - 1)*128 rows for R_e routed rows, so a MoE layer keeps (2*D + F)*(1 + 4/128) *
  ((ceil(R_e/128) + E_loc - 1)*128 - R_e) bytes more per micro-batch: ~1 % of the experts' copies at V3's
  4 local experts and 32768 rows, but 3.5x them on the tiny model's 128-token micro-batch.
Checked against the bytes autograd saves on CPU (``tests/test_size.py``, ``tests/test_recompute.py``,
``tests/test_size_fp8.py``) and against a DualPipe run's measured peak (``bench/recompute_memory.py``).
"""
from __future__ import annotations

from models.config import ModelConfig

# Planning only (tools.plan's bound for DeepSeek-V3's own recipe), not a train.recompute mode: each layer keeps
# just its input -- the least any recomputation can keep; this trainer's full keeps more in MoE layers.
FLOOR = "floor"
# Planning only: an estimate of what DeepSeek-V3's own recipe keeps (report §3.2.2, §3.3; ``v3_recipe_bytes``).
V3_RECIPE = "v3_recipe"


def v3_recipe_bytes(m: ModelConfig) -> dict:
    """Bytes per token an estimate of DeepSeek-V3's training recipe saves for backward (BF16 activations; the
    report says what is recomputed and what is cached in low precision, not every tensor, so each item is an
    assumption, listed in docs/planner.md):
      attention: the layer input D*a (RMSNorm recomputed from it), the q and kv latents Q*a + (L + R)*a (their
        norms and the up-projections recomputed, so q, k, v are not kept), the attention output as wo's input
        in E5M6 (1.5 bytes + a scale per 128), the flash kernel's log-sum-exp H*f;
      MoE: the residual D*a (the FFN norm recomputed), the router's scores and choices (as this trainer's),
        the dispatched rows once in FP8 for w13 (K*c(D), they travel as FP8 anyway), the SwiGLU inputs in
        FP8 (K*s8(F); the SwiGLU output, w2's input, recomputed), the shared expert likewise; the gate weight
        scales the SwiGLU output before w2, so the combine keeps no expert outputs (with it applied after w2,
        as this trainer does, K*D*a more -- 115 KB per token at V3's size -- and V3's layout would not fit 80 GB);
      dense FFN: the residual, its input in FP8, the SwiGLU inputs in FP8;
      head: its input D*a, the logits recomputed chunk by chunk in backward (a fused cross-entropy; keeping
        V*f, 517 KB per token at V3's vocabulary, for one micro-batch of 4096 tokens is 2.1 GB);
      region: what one layer recomputes at once in backward: two norm outputs, q, k and v, the SwiGLU outputs."""
    a, f = 2, 4
    D, H, R, N, V = m.dim, m.n_heads, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
    Q, L, qk = m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim
    K, F, E, I = m.n_activated_experts, m.moe_inter_dim, m.n_routed_experts, m.inter_dim
    Fs = F * m.n_shared_experts
    c = lambda n: n + n / 32                    # noqa: E731  E4M3 + an FP32 scale per 128
    s8 = lambda n: 2 * (n + n / 32)             # noqa: E731  the SwiGLU's two inputs in FP8
    attn = D * a + (Q or 0) * a + (L + R) * a + 1.5 * H * V + H * V / 32 + H * f
    route = E * f + 2 * K * f + 16 * K
    moe = D * a + route + K * c(D) + K * s8(F) + (c(D) + s8(Fs) if Fs else 0)
    dense = D * a + c(D) + s8(I)
    head = D * a
    qkv = (H * qk + H * (N + V)) * a
    return {"dense_layer": attn + dense, "moe_layer": attn + moe, "head": head,
            "mtp": 2 * D * a + attn + moe + head,
            "dense_region": 2 * D * a + qkv + I * a, "moe_region": 2 * D * a + qkv + (K * F + Fs) * a,
            "experts_backward": 0}


# Bytes per token that one head's cross-entropy keeps for the backward, by what computes it (vocabulary V, the
# activation dtype's a bytes): ``F.cross_entropy`` of the FP32 logits keeps the log-probabilities; the fused kernels
# (``kernels/cross_entropy.py``, ``train.head_loss=fused`` on CUDA) keep the logits in their dtype and one FP32
# log-sum-exp; ``inplace`` the logits' buffer only (their gradient, written over them in the forward).
# ``train.head_loss=chunked`` keeps the head's input and weight gradients instead, counted as plain.
HEAD_KEEPS = {"plain": lambda V, a: V * 4, "fused": lambda V, a: V * a + 4, "inplace": lambda V, a: V * a}


def activation_bytes_per_token(m: ModelConfig, a: int, seq_len: int = 0, math_attention: bool = False,
                               recompute: str = "none", deferred: bool = False, fp8: bool = False,
                               head_loss: str = "plain") -> dict:
    """Saved-for-backward bytes per token under ``recompute``: ``dense_layer``, ``moe_layer``, ``head`` (one
    use), ``mtp`` (one depth, its head use included), and ``dense_region`` / ``moe_region``: the most that
    one layer's recomputation holds at once in backward (0 without recompute). ``math_attention``: the
    attention core of PyTorch's math SDPA (CPU), which keeps the probabilities (H*T*f), instead of a flash
    kernel's. ``deferred``: the routed experts are ``parallel.wgrad``'s (schedules with B/W actions), which save
    x and h13 only (2*K*F*a of SwiGLU in none and selective) and hold s1, da, dh13 and the product
    (5*K*F*a, ``experts_backward``) at once in their backward. ``fp8``: ``train.precision=fp8``'s FP8 linears
    and experts (``parallel/fp8.py``), whose inputs are saved as FP8 copies. ``head_loss``: ``HEAD_KEEPS``. The
    formulas are in the module doc. ``V3_RECIPE``: ``v3_recipe_bytes`` (the other arguments do not apply)."""
    if recompute == V3_RECIPE:
        return v3_recipe_bytes(m)
    f = 4
    D, H, R, N, V = m.dim, m.n_heads, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
    Q, L, qk = m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim
    K, F, E, I = m.n_activated_experts, m.moe_inter_dim, m.n_routed_experts, m.inter_dim
    Fs = F * m.n_shared_experts
    # an input saved by a linear (x1): one copy in the activation dtype, or under fp8 the linear's own FP8 copy c(n);
    # h: a MoE SwiGLU's h13 under selective
    act = lambda n: n * a                       # noqa: E731
    c = lambda n: n + n / 32                    # noqa: E731  E4M3, an FP32 scale per 128 tokens
    x1 = c if fp8 else act
    h = (lambda n: 2 * n - 4 * (-2 * n // 128)) if fp8 and recompute == "selective" else (lambda n: 2 * n * a)
    shared_in = c(D) if fp8 and Fs else 0  # the shared experts' w13 copy (else the gate's input)

    def norm(n: int, saved_by=act) -> int:     # fp32 copy, normalised, the next linear(s)' input
        return n * f + n * a + saved_by(n)

    core = ((2 * H * qk + H * V) * a + x1(H * V) + H * seq_len * f if math_attention
            else (2 * H * qk + H * (N + V) + H * V) * a + x1(H * V) + H * f)
    route, loss = E * f + 2 * K * f + 16 * K, HEAD_KEEPS[head_loss](m.vocab_size, a)   # loss: what one head's keeps
    experts, shared = K * D * a + K * x1(D) + 3 * K * F * a + K * x1(F), shared_in + 3 * Fs * a + x1(Fs)
    attn = norm(D, x1) + (norm(Q, x1) if Q else 0) + norm(L, x1) + R * a + core
    moe, dense, head = norm(D) + route + experts + shared, norm(D, x1) + 3 * I * a + x1(I), norm(D) + loss
    out = {"dense_layer": attn + dense, "moe_layer": attn + moe, "head": head,
           "mtp": 2 * norm(D) + 2 * D * a + attn + moe + head, "dense_region": 0, "moe_region": 0}
    if recompute == "selective":
        snorm = D * a + x1(D)
        s_attn = snorm + (Q or H * qk) * a + (L + R) * a + x1(H * V)   # MLA.core's latents, wo's input
        s_shared = shared_in + h(Fs) + x1(Fs)
        s_moe = 2 * D * a + route + K * D * a + K * x1(D) + K * h(F) + K * x1(F) + s_shared
        s_head = 2 * D * a + loss
        sel = {"dense_layer": s_attn + snorm + 2 * I * a + x1(I), "moe_layer": s_attn + s_moe, "head": s_head,
               "mtp": 3 * D * a + s_attn + s_moe + s_head}
        out.update(sel, dense_region=out["dense_layer"] - sel["dense_layer"],
                   moe_region=out["moe_layer"] - sel["moe_layer"])
    elif recompute == "full":
        f_moe = 3 * D * a + route + 2 * K * D * a
        routed_region = (K * x1(D) if fp8 else 0) + 3 * K * F * a + K * x1(F)   # FP8: x's copy too
        out.update(dense_layer=D * a, moe_layer=f_moe, mtp=2 * norm(D) + 2 * D * a + f_moe + head,
                   dense_region=attn + dense, moe_region=max(attn, routed_region, shared))
    if deferred:
        if recompute != "full" and not fp8:   # FP8 experts keep their class (and what they save)
            fewer = (4 if recompute == "none" else 3) * K * F * a - 2 * K * F * a
            out.update(moe_layer=out["moe_layer"] - fewer, mtp=out["mtp"] - fewer)
        # the experts' backward: s1, da, dh13, the product at once (after recomputing x, h13 under full)
        out["experts_backward"] = (5 + 2 * (recompute == "full")) * K * F * a
    return out


def wgrad_held_bytes_per_token(m: ModelConfig, a: int) -> dict:
    """Bytes per token the deferred weight-gradient queue (``parallel/wgrad.py``) holds from a stage's B to its
    W, whatever the recompute mode: every deferred linear's input x and output gradient dy (the stacked
    wqkv_a and w13 one linear each), and per routed copy the experts' x, dy, SwiGLU product and the gradient of
    h13. ``dense_layer``, ``moe_layer``, ``head`` (one use), ``mtp`` (one depth)."""
    D, H, R, N, V = m.dim, m.n_heads, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
    Q, L, qk = m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim
    K, F, I, Fs = m.n_activated_experts, m.moe_inter_dim, m.inter_dim, m.moe_inter_dim * m.n_shared_experts
    q = (Q + Q + H * qk) if Q else H * qk            # (x of wq_b, dy of wqkv_a's query rows,) dy of wq_b / them
    attn = (D + q + L + (L + R) + H * (N + V) + H * V + D) * a   # x shared, kv a/b, wo's x and dy
    swiglu = lambda inter: (2 * D + 3 * inter) * a   # noqa: E731  x, dy of w13, w2's x, its dy
    moe = attn + (swiglu(Fs) if Fs else 0) + K * (2 * D + 3 * F) * a
    head = (D + m.vocab_size) * a
    return {"dense_layer": attn + swiglu(I), "moe_layer": moe, "head": head,
            "mtp": 3 * D * a + (moe if m.is_moe_layer(m.n_layers) else attn + swiglu(I)) + head}


def stage_wgrad_held(m: ModelConfig, split: list[range], a: int, tokens: int) -> list[float]:
    """Per stage: bytes of one micro-batch the weight-gradient queue holds between its B and W."""
    per_tok = wgrad_held_bytes_per_token(m, a)
    out = []
    for s, layers in enumerate(split):
        held = sum(per_tok["moe_layer" if m.is_moe_layer(i) else "dense_layer"] for i in layers)
        if s == len(split) - 1:
            held += per_tok["head"] + m.mtp_depth * per_tok["mtp"]
        out.append(held * tokens)
    return out


def stage_activations(m: ModelConfig, split: list[range], a: int, tokens: int, recompute: str,
                      seq_len: int = 0, math_attention: bool = False, deferred: bool = False,
                      expert_dw: float = 0.0, fp8: bool = False, head_loss: str = "plain") -> list[tuple[float, float]]:
    """Per stage: (bytes saved per micro-batch, the most one layer's backward holds at once beyond them:
    recomputed tensors, or the deferred experts' backward, whose full backward (BW, F&B) also returns
    the three weight gradients of the local experts together, ``expert_dw`` bytes); ``fp8``: FP8 layers;
    ``head_loss``: ``HEAD_KEEPS``."""
    per_tok = activation_bytes_per_token(m, a, seq_len, math_attention, "none" if recompute == FLOOR else recompute,
                                         deferred, fp8, head_loss)
    out = []
    for s, layers in enumerate(split):
        kinds = ["moe" if m.is_moe_layer(i) else "dense" for i in layers]
        last = s == len(split) - 1
        ends = per_tok["head"] + m.mtp_depth * per_tok["mtp"] if last else 0
        if recompute == FLOOR:   # each layer's input; one layer (or the head and MTP) recomputed at a time
            regions = [per_tok[f"{k}_layer"] for k in kinds] + [ends]
            out.append((len(layers) * m.dim * a * tokens, max(regions) * tokens))
            continue
        if last and m.mtp_depth:
            kinds.append("moe" if m.is_moe_layer(m.n_layers) else "dense")   # the MTP blocks
        saved = sum(per_tok[f"{k}_layer"] for k in kinds[:len(layers)]) + ends
        working = [per_tok[f"{k}_region"] * tokens for k in kinds] + [0]
        if deferred and "moe" in kinds:
            working.append(per_tok["experts_backward"] * tokens + expert_dw)
        out.append((saved * tokens, max(working)))
    return out
