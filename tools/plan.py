"""Cluster planner: predicted step time, bubble, exposed communication, MFU, tokens/s/GPU and memory of a
layout, without running it (docs/planner.md).

    python -m tools.plan model=v3_671b parallel.pp=16 parallel.schedule=dualpipe parallel.ep=64 \\
        parallel.ranks_per_node=8 parallel.zero=1 data.seq_len=4096 train.micro_batch_size=1 \\
        train.global_batch_size=15360 --world-size 2048 --hardware h800 [--out timeline.png]
    python -m tools.plan --v3-check                      # the layout above vs DeepSeek's published step
    python -m tools.plan model=v3_671b data.seq_len=4096 train.global_batch_size=15360 \\
        --world-size 2048 --hardware h800 --search      # rank layouts by tokens/s/GPU

Arguments are Hydra overrides (as for ``tools.size``) plus the options below. Pipeline: the layout's
schedule (``parallel.pipeline.schedules``) run through ``parallel.pipeline.simulator.simulate`` with
per-stage action costs from ``action_costs``; the step is the simulated makespan plus the step end
(ZeRO reduce-scatter / all-gather and the optimizer). Memory is ``tools.size.plan_memory``.

Cost model for one micro-batch of T = micro_batch_size x seq_len tokens on stage s (``stage_work``):
  GEMM FLOPs, forward = 2 x (parameters a token's matmuls touch in the stage's layers, K of E routed
      experts; + the head, and per MTP depth the MTP module and another head pass, on the last stage);
      Dgrad (B) and Wgrad (W) each equal the forward. Precision fp8: the layers' GEMMs run in FP8, the
      head in BF16; bf16: all BF16.
  attention core, forward = H x (d_qk + d_v) x T per token and layer (causal: T/2 keys on average),
      backward twice that, all in B; the same sum over layers as ``models.params.flops_per_token``.
  recompute (``--recompute v3``, report §3.2.2): RMSNorm and the MLA up-projections (q_b, kv_b) run
      again in B: their forward GEMM FLOPs are added to B.
  time = FLOPs / (peak x efficiency x (1 - reserved_sms / sms)) per kind (profile), SMs reserved for
      the all-to-all only when the layout has EP communication.
Expert all-to-all per MoE layer and micro-batch (``ep_traffic``): under balanced node-limited routing a
token's K experts are uniform among the experts of its M chosen groups (groups = EP nodes), so the
expected number of distinct nodes it reaches is M (1 - C(n_M - n_g, K) / C(n_M, K)), n_M = experts of M
groups, n_g = of one; of them a fraction (G - 1) / G are remote (over the inter-node link, once per node,
as DeepEP does), and inside a node it fans out over NVLink to the distinct GPUs hosting its experts.
Dispatch carries D bytes + fp32 scales per 128 (FP8) or 2D bytes (BF16); combine 2D bytes (BF16).
Backward sends the same volumes in BF16 (gradients). Time = max(inter-node bytes / ib, intra-node
bytes / nvlink) + latency, per all-to-all.
Overlap rules (``StageCosts``): a plain F or B waits for its all-to-alls (exposed); an F&B (DualPipe,
DualPipeV) hides the forward's all-to-all under the backward's compute and the backward's under the
forward's, each up to that compute: F&B = f + bw + max(0, a2a_f - bw) + max(0, a2a_b - f), and never
less than the two all-to-alls back to back. Pipeline p2p: T x D x 2 bytes over the inter-node link.
Step end: ZeRO-1/2 reduce-scatter of the gradients (BF16) and all-gather of the weights (BF16) over
dp (dense) and edp (experts), ring cost (n-1)/n x bytes / ib; ZeRO-0 an all-reduce of the same bytes;
the AdamW update reads and writes 24 bytes per owned parameter at HBM bandwidth.
A measured profile (CPU, ``bench/plan_calibrate.py``) replaces FLOPs/peak by seconds per token of each
component (embedding, dense layer, MoE layer, head + MTP) and adds processor sharing: ranks > cores
slow compute by (mean busy ranks / cores), iterated to a fixed point.
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from parallel.pipeline.schedules import SCHEDULES, Kind, get_schedule
from parallel.pipeline.simulator import Simulation, simulate

HARDWARE_DIR = Path(__file__).resolve().parents[1] / "configs" / "hardware"
GB = 1e9


# ---- hardware --------------------------------------------------------------------------------------
@dataclass
class Hardware:
    name: str
    peak_bf16_tflops: float = 0.0
    peak_fp8_tflops: float = 0.0
    gemm_efficiency: float = 0.7        # FP8 (or BF16 with precision bf16) Fprop / Dgrad GEMMs
    wgrad_efficiency: float = 0.55      # Wgrad GEMMs
    bf16_efficiency: float = 0.8        # BF16 GEMMs (head) and all GEMMs under precision bf16
    attention_efficiency: float = 0.45  # attention core, share of the BF16 peak
    elementwise_passes: tuple = (2, 3, 1)  # HBM passes over the saved activations in F, B, W (norms, SwiGLU,
                                        # RoPE, casts, permutes: write + read in F; read, write, read in B)
    hbm_gb: float = 80.0
    hbm_tb_s: float = 3.35
    nvlink_gb_s: float = 160.0
    ib_gb_s: float = 50.0
    gpus_per_node: int = 8
    sms: int = 132
    reserved_sms: int = 0
    a2a_latency_us: float = 0.0
    p2p_latency_us: float = 0.0
    cores: int = 0                      # measured CPU profiles: cores the ranks share (0: one device per rank)
    measured: dict | None = None        # seconds per token of each component: {component: {f, b, w}}
    sources: list[str] = field(default_factory=list)


def load_hardware(name: str) -> Hardware:
    """A profile by name (``configs/hardware/<name>.yaml``) or path."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else HARDWARE_DIR / f"{name.lower()}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))
        raise ValueError(f"--hardware {name!r}: no {path} (known: {', '.join(known)})")
    data = yaml.safe_load(path.read_text())
    allowed = {f.name for f in fields(Hardware)}
    extra = set(data) - allowed
    if extra:
        raise ValueError(f"{path}: unknown keys {sorted(extra)} (allowed: {sorted(allowed)})")
    return Hardware(**data)


# ---- work per stage --------------------------------------------------------------------------------
@dataclass
class StageWork:
    """Per token of one micro-batch, forward FLOPs of one pipeline stage, by kind."""
    layers: list[int]
    gemm: float            # layer GEMMs (FP8 under the V3 recipe)
    gemm_bf16: float       # head and MTP head passes (BF16 in the V3 recipe)
    attention: float       # attention core, forward
    recompute: float       # GEMMs run again in B under --recompute v3
    moe_layers: int        # MoE blocks (MTP's included): expert all-to-alls per direction
    act_bytes: float       # saved-for-backward bytes (tools.size.activation_bytes_per_token, bf16)
    components: dict       # component -> count, for measured profiles (embed, dense_layer, moe_layer, head)

    @property
    def forward(self) -> float:
        return self.gemm + self.gemm_bf16 + self.attention


def stage_work(m, parts, layers, first: bool, last: bool, seq_len: int) -> StageWork:
    """``parts``: ``tools.size.model_parts`` of the model. Formulas in the module doc."""
    from tools.size import activation_bytes_per_token
    frac = m.n_activated_experts / m.n_routed_experts
    act = activation_bytes_per_token(m, 2)
    attn_layer = m.n_heads * (m.qk_head_dim + m.v_head_dim) * seq_len
    up_proj = (m.q_lora_rank or m.dim) * m.n_heads * m.qk_head_dim + m.kv_lora_rank * m.n_heads * (
        m.qk_nope_head_dim + m.v_head_dim)
    gemm = sum(2 * (parts.layer_dense[i] + parts.layer_expert[i] * frac) for i in layers)
    comps = {"embed": int(first), "dense_layer": sum(not m.is_moe_layer(i) for i in layers),
             "moe_layer": sum(m.is_moe_layer(i) for i in layers), "head": int(last)}
    acts = sum(act["moe_layer" if m.is_moe_layer(i) else "dense_layer"] for i in layers)
    w = StageWork(list(layers), gemm, 0.0, attn_layer * len(layers), 2 * up_proj * len(layers),
                  comps["moe_layer"], acts, comps)
    if last:
        head_weight = m.vocab_size * m.dim
        w.gemm_bf16 = 2 * parts.head + 2 * m.mtp_depth * head_weight
        w.gemm += 2 * (parts.mtp_dense + parts.mtp_expert * frac)
        w.attention += attn_layer * m.mtp_depth
        w.recompute += 2 * up_proj * m.mtp_depth
        w.moe_layers += m.mtp_depth
        w.act_bytes += act["head"] + m.mtp_depth * act["mtp"]
    return w


# ---- expert all-to-all -----------------------------------------------------------------------------
def expected_distinct(n_bins: int, per_bin: int, k: int) -> float:
    """Expected bins hit when k of n_bins * per_bin items are drawn uniformly without replacement."""
    n = n_bins * per_bin
    if k > n - per_bin:
        return float(n_bins)
    return n_bins * (1 - math.comb(n - per_bin, k) / math.comb(n, k))


@dataclass
class EPTraffic:
    nodes_per_token: float      # distinct EP nodes a token's experts live on (its own included)
    remote_nodes: float         # of them over the inter-node link
    gpus_per_node_hit: float    # distinct GPUs per reached node (NVLink fan-out)
    inter_bytes: dict           # per micro-batch and MoE layer, bytes one rank sends across nodes
    intra_bytes: dict           # ... inside its node
    calls: int                  # latency-bearing all-to-alls per direction and MoE layer


def ep_traffic(m, ep: int, ranks_per_node: int, tokens: int, fp8_dispatch: bool) -> EPTraffic:
    """Bytes of one MoE layer's dispatch and combine, forward (``fwd``) and backward (``bwd``), for
    ``tokens`` tokens on one rank, under balanced node-limited routing (module doc)."""
    if ep == 1:
        return EPTraffic(1.0, 0.0, 0.0, {"fwd": 0.0, "bwd": 0.0}, {"fwd": 0.0, "bwd": 0.0}, 0)
    rpn = min(ep, ranks_per_node)
    nodes = ep // rpn
    E, K, M = m.n_routed_experts, m.n_activated_experts, min(m.n_limited_groups, nodes)
    per_node = E // nodes
    hit_nodes = expected_distinct(M, per_node, K)           # among the M chosen nodes
    remote = hit_nodes * (nodes - 1) / nodes                # the token's own node is one of the G, uniformly
    per_gpu = E // ep
    k_node = K / hit_nodes                                  # experts per reached node, on average
    gpus_hit = rpn * (1 - (1 - per_gpu / per_node) ** k_node) if rpn > 1 else 1.0
    D = m.dim
    disp = D + 4 * D / 128 if fp8_dispatch else 2 * D
    comb = 2 * D
    inter = {"fwd": tokens * remote * (disp + comb), "bwd": tokens * remote * 2 * comb}
    local_share = (rpn - 1) / rpn if rpn > 1 else 0.0       # NVLink hops inside the destination node
    intra = {"fwd": tokens * hit_nodes * gpus_hit * local_share * (disp + comb),
             "bwd": tokens * hit_nodes * gpus_hit * local_share * 2 * comb}
    return EPTraffic(hit_nodes, remote, gpus_hit, inter, intra, 2)


# ---- action costs ----------------------------------------------------------------------------------
@dataclass
class StageCost:
    f: float      # forward compute
    b: float      # input-gradient compute (+ recompute)
    w: float      # weight-gradient compute
    a2a_f: float  # expert all-to-all time of the forward (dispatch + combine, all MoE layers)
    a2a_b: float  # ... of the backward


class StageCosts:
    """Per-stage costs for ``parallel.pipeline.simulator.simulate`` (which calls ``of(action)`` and reads
    ``p2p``); the overlap rules of the module doc. ``scale`` slows compute (processor sharing on CPU)."""

    def __init__(self, stages: list[StageCost], p2p: float, overlap: bool, scale: float = 1.0):
        self.stages, self.p2p, self.overlap, self.scale = stages, p2p, overlap, scale

    def parts(self, kind: Kind, s: int) -> tuple[float, float]:
        """(compute, exposed all-to-all) of a plain action."""
        c, k = self.stages[s], self.scale
        return {Kind.F: (k * c.f, c.a2a_f), Kind.B: (k * c.b, c.a2a_b), Kind.W: (k * c.w, 0.0),
                Kind.BW: (k * (c.b + c.w), c.a2a_b)}[kind]

    def fb_parts(self, sf: int, sb: int) -> tuple[float, float]:
        f, af = self.parts(Kind.F, sf)
        bw, ab = self.parts(Kind.BW, sb)
        if not self.overlap:
            return f + bw, af + ab
        exposed = max(max(0.0, af - bw) + max(0.0, ab - f), af + ab - (f + bw))
        return f + bw, exposed

    def split(self, a) -> tuple[float, float]:
        if a.kind is Kind.FB:
            return self.fb_parts(a.stage, a.bwd.stage)
        if a.kind in (Kind.F, Kind.B, Kind.W, Kind.BW):
            return self.parts(a.kind, a.stage)
        return 0.0, 0.0

    def of(self, a) -> float:
        return sum(self.split(a))


# ---- the prediction --------------------------------------------------------------------------------
@dataclass
class Prediction:
    layout: str
    world_size: int
    n_microbatches: int
    tokens_per_step: int
    stage_costs: list[StageCost]
    p2p_s: float
    pipeline_s: float        # simulated makespan
    bubble_s: float          # rank 0's idle time inside its span (the schedule's bubble)
    exposed_a2a_s: float     # all-to-all time not hidden, on the busiest rank
    step_end_s: float        # ZeRO collectives + optimizer
    step_s: float
    mfu: float               # against the BF16 peak, like DeepSeek's and trainer.metrics' MFU
    tokens_per_s_gpu: float
    tflops_per_gpu: float
    memory_gb: float         # worst rank, tools.size.plan_memory
    fits: bool
    phases: dict             # rank 0: seconds in F-only, B-only, W-only, F&B actions, bubble, step end
    traffic: EPTraffic
    sim: Simulation | None = None
    notes: list[str] = field(default_factory=list)


def _dims(cfg, world_size):
    from tools.size import check_layout
    return check_layout(cfg, world_size)


def action_costs(cfg, hw: Hardware, world_size: int, parts, precision: str = "fp8", recompute: str = "none"
                 ) -> tuple[list[StageCost], list[StageWork], EPTraffic, float]:
    """Per-stage costs of one micro-batch, the works behind them, the EP traffic and the p2p time."""
    from tools.size import n_stages, split_layers
    m, p, t = cfg.model, cfg.parallel, cfg.train
    dims = _dims(cfg, world_size)
    n_st = n_stages(p.schedule, p.pp)
    split = split_layers(m.n_layers, n_st, p.pp_layout)
    T = t.micro_batch_size * cfg.data.seq_len
    works = [stage_work(m, parts, split[s], s == 0, s == n_st - 1, cfg.data.seq_len) for s in range(n_st)]
    traffic = ep_traffic(m, p.ep, p.ranks_per_node, T, p.fp8_dispatch or precision == "fp8")

    def a2a(direction: str) -> float:
        if p.ep == 1:
            return 0.0
        wire = max(traffic.inter_bytes[direction] / (hw.ib_gb_s * GB),
                   traffic.intra_bytes[direction] / (hw.nvlink_gb_s * GB))
        per_call = wire / traffic.calls + hw.a2a_latency_us * 1e-6
        return traffic.calls * per_call

    a2a_f, a2a_b = a2a("fwd"), a2a("bwd")
    costs = []
    if hw.measured:
        for w in works:
            per = {k: sum(n * hw.measured[c][k] for c, n in w.components.items()) for k in ("f", "b", "w")}
            costs.append(StageCost(per["f"] * T, per["b"] * T, per["w"] * T, a2a_f * w.moe_layers, a2a_b * w.moe_layers))
        p2p = hw.p2p_latency_us * 1e-6 + T * m.dim * 4 / (hw.ib_gb_s * GB)
        return costs, works, traffic, p2p
    sm = 1 - hw.reserved_sms / hw.sms if p.ep > 1 else 1.0
    low = hw.peak_fp8_tflops * 1e12 * sm if precision == "fp8" else hw.peak_bf16_tflops * 1e12 * sm
    bf16 = hw.peak_bf16_tflops * 1e12 * sm
    eff_main = hw.gemm_efficiency if precision == "fp8" else hw.bf16_efficiency
    eff_w = hw.wgrad_efficiency if precision == "fp8" else hw.bf16_efficiency
    hbm = hw.hbm_tb_s * 1e12
    pf, pb, pw = hw.elementwise_passes
    for w in works:
        f = T * (w.gemm / (low * eff_main) + w.gemm_bf16 / (bf16 * hw.bf16_efficiency)
                 + w.attention / (bf16 * hw.attention_efficiency) + pf * w.act_bytes / hbm)
        b = T * (w.gemm / (low * eff_main) + w.gemm_bf16 / (bf16 * hw.bf16_efficiency)
                 + 2 * w.attention / (bf16 * hw.attention_efficiency) + pb * w.act_bytes / hbm
                 + (w.recompute / (low * eff_main) if recompute == "v3" else 0.0))
        if recompute == "full":
            b += f
        wg = T * (w.gemm / (low * eff_w) + w.gemm_bf16 / (bf16 * hw.bf16_efficiency) + pw * w.act_bytes / hbm)
        costs.append(StageCost(f, b, wg, a2a_f * w.moe_layers, a2a_b * w.moe_layers))
    p2p = hw.p2p_latency_us * 1e-6 + T * m.dim * 2 / (hw.ib_gb_s * GB)
    return costs, works, traffic, p2p


def step_end(cfg, hw: Hardware, mem_plan, dims) -> float:
    """ZeRO reduce-scatter + all-gather (or all-reduce) over dp/edp on the worst rank, plus AdamW."""
    worst = 0.0
    for r in mem_plan.ranks:
        dense, expert = r.params_dense, r.params_expert
        ring = lambda n, nbytes: 0.0 if n == 1 else (n - 1) / n * nbytes / (hw.ib_gb_s * GB)  # noqa: E731
        comm = 2 * (ring(dims.dp, 2 * dense) + ring(dims.edp, 2 * expert))   # RS + AG, or one all-reduce
        owned = (dense / dims.dp + expert / dims.edp) if cfg.parallel.zero >= 1 else dense + expert
        update = 24 * owned / (hw.hbm_tb_s * 1e12) if not hw.measured else 0.0
        worst = max(worst, comm + update)
    return worst


def _rank0_phases(sim: Simulation, costs: StageCosts) -> tuple[dict, float]:
    """Seconds rank 0 spends in each action kind, and the busiest rank's exposed all-to-all."""
    phases = {"F": 0.0, "B": 0.0, "W": 0.0, "F&B": 0.0}
    names = {Kind.F: "F", Kind.B: "B", Kind.BW: "B", Kind.W: "W", Kind.FB: "F&B"}
    for s in sim.spans[0]:
        if s.action.is_compute:
            phases[names[s.action.kind]] += s.end - s.start
    exposed = max(sum(costs.split(s.action)[1] for s in spans if s.action.is_compute) for spans in sim.spans)
    return phases, exposed


def predict(cfg, hw: Hardware, world_size: int, precision: str = "fp8", recompute: str = "none",
            model=None) -> Prediction:
    """Predicted step of ``cfg``'s layout on ``world_size`` ranks of ``hw`` (module doc)."""
    import models
    from tools.size import model_parts, plan_memory
    from models.params import flops_per_token

    p, t = cfg.parallel, cfg.train
    dims = _dims(cfg, world_size)
    model = model if model is not None else models.build(cfg.model, "meta")
    parts = model_parts(model)
    stage_costs, works, traffic, p2p = action_costs(cfg, hw, world_size, parts, precision, recompute)
    n_micro = max(1, t.global_batch_size // (t.micro_batch_size * dims.dp))
    overlap = p.overlap or not hw.measured   # GPU plans assume the overlapped F&B; CPU runs follow the config
    notes = []
    sc = StageCosts(stage_costs, p2p, overlap)
    if p.pp > 1:
        schedule = get_schedule(p.schedule, p.pp, n_micro)
        sim = simulate(schedule, sc)
        if hw.cores and world_size > hw.cores:   # processor sharing: iterate the slowdown to a fixed point
            for _ in range(8):
                busy_ranks = sum(sim.busy) / sim.makespan * world_size / p.pp   # mean ranks computing
                sc = StageCosts(stage_costs, p2p, overlap, max(1.0, busy_ranks / hw.cores))
                sim = simulate(schedule, sc)
            notes.append(f"{world_size} ranks on {hw.cores} cores: compute slowed x{sc.scale:.2f}")
        pipeline, bubble = sim.makespan, sim.bubble[0]
        phases, exposed = _rank0_phases(sim, sc)
    else:
        sim = None
        scale = max(1.0, world_size / hw.cores) if hw.cores else 1.0
        sc = StageCosts(stage_costs, p2p, overlap, scale)
        c = stage_costs[0]
        per_mb = scale * (c.f + c.b + c.w) + c.a2a_f + c.a2a_b
        pipeline, bubble, exposed = n_micro * per_mb, 0.0, n_micro * (c.a2a_f + c.a2a_b)
        phases = {"F": n_micro * scale * c.f, "B": n_micro * (scale * c.b + c.a2a_b), "W": n_micro * scale * c.w,
                  "F&B": 0.0}
    # tools.size models no recompute or full recompute; V3's partial recompute with FP8-cached activations is
    # sized as full recompute (a lower bound: the no-recompute estimate of V3's own layout is 231 GB, yet it ran on 80 GB)
    mem = plan_memory(cfg, world_size, "v3" if not hw.measured else "trainer",
                      "none" if recompute == "none" else "full", model=model)
    end = step_end(cfg, hw, mem, dims)
    step = pipeline + end
    tokens = t.global_batch_size * cfg.data.seq_len
    fpt = flops_per_token(cfg.model, cfg.data.seq_len, model).per_token
    tflops = tokens * fpt / step / world_size / 1e12
    mfu = tflops * 1e12 / (hw.peak_bf16_tflops * 1e12) if hw.peak_bf16_tflops else float("nan")
    worst = mem.worst.total / GB
    phases = {**phases, "bubble": bubble, "step end": end}
    layout = (f"pp{p.pp} {p.schedule} ep{p.ep} dp{dims.dp} mbs{t.micro_batch_size} zero{p.zero}"
              + (f" {precision}" if precision != "fp8" else ""))
    return Prediction(layout, world_size, n_micro, tokens, stage_costs, p2p, pipeline, bubble, exposed, end, step,
                      mfu, tokens / step / world_size, tflops, worst, worst <= hw.hbm_gb * 0.9, phases, traffic,
                      sim, notes + mem.notes)


# ---- DeepSeek-V3's published step --------------------------------------------------------------------
V3_LAYOUT = ["model=v3_671b", "parallel.pp=16", "parallel.schedule=dualpipe", "parallel.ep=64",
             "parallel.ranks_per_node=8", "parallel.zero=1", "data.seq_len=4096", "train.micro_batch_size=1",
             "train.global_batch_size=15360"]
V3_WORLD = 2048
# ISCA'25 "Insights into DeepSeek-V3", Table 4 (MPFT column): the step on rank 0's timeline by phase.
V3_PUBLISHED = {"F": 1.13, "B": 1.99, "W": 0.48, "F&B": 13.95, "bubble": 2.06, "step end": 0.29, "step": 19.93,
                "mfu": 0.3894, "tokens/s/GPU": 15360 * 4096 / 19.93 / 2048}


def compose_config(overrides: list[str]):
    from hydra import compose, initialize_config_module
    from configs.schema import register, to_object
    register()
    with initialize_config_module("configs", version_base=None):
        return to_object(compose("config", overrides=overrides))


def v3_check(hw_name: str = "h800", recompute: str = "v3") -> tuple[Prediction, list[tuple[str, float, float]]]:
    """Predict DeepSeek-V3's production step; returns the prediction and (row, predicted, published)."""
    pred = predict(compose_config(V3_LAYOUT), load_hardware(hw_name), V3_WORLD, "fp8", recompute)
    ph = pred.phases
    rows = [("1F   (rank 0, forward-only actions)", ph["F"], V3_PUBLISHED["F"]),
            ("1B   (rank 0, backward-only actions)", ph["B"], V3_PUBLISHED["B"]),
            ("1W   (rank 0, weight-only actions)", ph["W"], V3_PUBLISHED["W"]),
            ("1F1B (rank 0, overlapped F&B actions)", ph["F&B"], V3_PUBLISHED["F&B"]),
            ("bubble (rank 0 idle)", ph["bubble"], V3_PUBLISHED["bubble"]),
            ("optimizer / step end", ph["step end"], V3_PUBLISHED["step end"]),
            ("step", pred.step_s, V3_PUBLISHED["step"]),
            ("MFU (causal, BF16 peak)", pred.mfu, V3_PUBLISHED["mfu"]),
            ("tokens/s/GPU", pred.tokens_per_s_gpu, V3_PUBLISHED["tokens/s/GPU"])]
    return pred, rows


# ---- search ----------------------------------------------------------------------------------------
@dataclass
class Candidate:
    overrides: list[str]
    pred: Prediction | None
    why_not: str = ""


def candidates(cfg, world_size: int, rpn: int) -> list[list[str]]:
    """Layouts to try: pp x schedule x ep x micro-batch size x zero (routing groups follow EP nodes)."""
    m, out = cfg.model, []
    for pp in (4, 8, 16, 32):
        if world_size % pp or m.n_layers < pp:
            continue
        for schedule in SCHEDULES:
            for ep in (8, 16, 32, 64, 128, 256):
                if (world_size // pp) % ep or m.n_routed_experts % ep:
                    continue
                nodes = max(1, ep // rpn)
                for mbs in (1, 2):
                    for zero in (1, 2):
                        out.append([f"parallel.pp={pp}", f"parallel.schedule={schedule}", f"parallel.ep={ep}",
                                    f"parallel.ranks_per_node={rpn}", f"parallel.zero={zero}",
                                    f"train.micro_batch_size={mbs}", f"model.n_expert_groups={nodes}",
                                    f"model.n_limited_groups={min(m.n_limited_groups, nodes)}"])
    return out


def search(base: list[str], hw: Hardware, world_size: int, precision: str = "fp8", recompute: str = "v3",
           top: int = 5) -> list[Candidate]:
    """Every candidate layout, predicted; the fitting ones first, by tokens/s/GPU."""
    import models
    cfg0 = compose_config(base)
    model = models.build(cfg0.model, "meta")
    out = []
    for over in candidates(cfg0, world_size, hw.gpus_per_node):
        cfg = copy.deepcopy(cfg0)
        for o in over:
            key, value = o.split("=")
            group, name = key.split(".")
            node = getattr(cfg, group)
            setattr(node, name, type(getattr(node, name))(value) if not isinstance(getattr(node, name), str) else value)
        try:
            pred = predict(cfg, hw, world_size, precision, recompute, model=model)
        except (ValueError, AssertionError) as e:
            out.append(Candidate(over, None, f"invalid: {str(e)[:90]}"))
            continue
        c = Candidate(over, pred)
        if not pred.fits:
            c.why_not = f"OOM: {pred.memory_gb:.0f} GB > {0.9 * hw.hbm_gb:.0f} GB usable"
        out.append(c)
    ok = sorted((c for c in out if c.pred and c.pred.fits), key=lambda c: -c.pred.tokens_per_s_gpu)
    if ok:
        best = ok[0].pred
        for c in ok[1:]:
            c.why_not = _loses(c.pred, best)
    return ok + [c for c in out if not (c.pred and c.pred.fits)]


def _loses(p: Prediction, best: Prediction) -> str:
    """The biggest of the differences that make ``p`` slower than ``best``."""
    diffs = {"bubble": p.bubble_s - best.bubble_s, "exposed all-to-all": p.exposed_a2a_s - best.exposed_a2a_s,
             "step end (ZeRO + optimizer)": p.step_end_s - best.step_end_s,
             "compute": (p.pipeline_s - p.bubble_s - p.exposed_a2a_s) - (best.pipeline_s - best.bubble_s - best.exposed_a2a_s)}
    worst = max(diffs, key=diffs.get)
    return f"{100 * (1 - p.tokens_per_s_gpu / best.tokens_per_s_gpu):.1f}% slower: +{diffs[worst]:.2f} s {worst}"


# ---- CLI -------------------------------------------------------------------------------------------
def report(pred: Prediction) -> list[str]:
    lines = [f"layout: {pred.layout} on {pred.world_size} ranks; {pred.n_microbatches} micro-batches per step",
             f"per micro-batch and stage (s): " + ", ".join(
                 f"s{i}: F {c.f:.3f} b {c.b:.3f} W {c.w:.3f} a2a {c.a2a_f:.3f}/{c.a2a_b:.3f}"
                 for i, c in enumerate(pred.stage_costs[:3])) + (" ..." if len(pred.stage_costs) > 3 else ""),
             f"EP: {pred.traffic.nodes_per_token:.2f} nodes per token ({pred.traffic.remote_nodes:.2f} remote), "
             f"{pred.traffic.inter_bytes['fwd'] / 1e6:.1f} MB inter-node per MoE layer forward; p2p {1e3 * pred.p2p_s:.2f} ms",
             f"step {pred.step_s:.3f} s = pipeline {pred.pipeline_s:.3f} + step end {pred.step_end_s:.3f}; bubble "
             f"{pred.bubble_s:.3f} s ({100 * pred.bubble_s / pred.step_s:.1f}%); exposed all-to-all {pred.exposed_a2a_s:.3f} s",
             f"MFU {100 * pred.mfu:.1f}% ({pred.tflops_per_gpu:.0f} TFLOP/s/GPU); {pred.tokens_per_s_gpu:,.0f} tokens/s/GPU; "
             f"memory {pred.memory_gb:.1f} GB on the worst rank ({'fits' if pred.fits else 'does NOT fit'})"]
    return lines + [f"note: {n}" for n in pred.notes]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", default="h800", help="profile name in configs/hardware or a YAML path")
    ap.add_argument("--world-size", type=int, default=None)
    ap.add_argument("--precision", choices=("fp8", "bf16"), default="fp8")
    ap.add_argument("--recompute", choices=("none", "v3", "full"), default="v3",
                    help="v3: RMSNorm + MLA up-projections recomputed in B (report §3.2.2)")
    ap.add_argument("--v3-check", action="store_true", help="DeepSeek-V3's layout vs its published step")
    ap.add_argument("--search", action="store_true", help="rank layouts by tokens/s/GPU")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--out", default=None, help="timeline PNG (tools.schedule's renderer)")
    args, overrides = ap.parse_known_args(argv)
    if [o for o in overrides if o.startswith("--")]:
        print(f"error: unknown option {[o for o in overrides if o.startswith('--')][0]}", file=sys.stderr)
        return 2
    hw = load_hardware(args.hardware)
    if args.v3_check:
        pred, rows = v3_check(args.hardware, args.recompute)
        print("\n".join(report(pred)))
        print(f"\n{'DeepSeek-V3, 2048 ' + hw.name:<40} {'predicted':>10} {'published':>10} {'error':>7}")
        for name, got, want in rows:
            print(f"{name:<40} {got:>10.3f} {want:>10.3f} {100 * (got / want - 1):>+6.1f}%")
        return 0
    if args.search:
        world = args.world_size or 2048
        ranked = search(overrides, hw, world, args.precision, args.recompute, args.top)
        print(f"{'#':>3} {'layout':<40} {'step s':>7} {'bubble':>7} {'a2a':>6} {'end':>5} {'MFU':>6} {'tok/s/GPU':>9} "
              f"{'mem GB':>7}  why not first")
        for i, c in enumerate(ranked[:args.top]):
            p = c.pred
            print(f"{i + 1:>3} {p.layout:<40} {p.step_s:>7.2f} {p.bubble_s:>7.2f} {p.exposed_a2a_s:>6.2f} "
                  f"{p.step_end_s:>5.2f} {100 * p.mfu:>5.1f}% {p.tokens_per_s_gpu:>9,.0f} {p.memory_gb:>7.1f}  {c.why_not}")
        losers = ranked[args.top:]
        reasons: dict[str, int] = {}
        for c in losers:
            key = c.why_not.split(":")[0] if not c.why_not[0].isdigit() else "slower"
            reasons[key] = reasons.get(key, 0) + 1
        print(f"{len(losers)} more: " + ", ".join(f"{n} {k}" for k, n in sorted(reasons.items())))
        return 0
    cfg = compose_config(overrides)
    world = args.world_size or cfg.parallel.pp * cfg.parallel.ep
    pred = predict(cfg, hw, world, args.precision, args.recompute)
    print("\n".join(report(pred)))
    if args.out and pred.sim is not None:
        from parallel.pipeline.simulator import Costs
        from tools.schedule import draw
        c = pred.stage_costs[0]
        draw(pred.sim, f"{pred.layout} on {hw.name}: predicted step {pred.step_s:.2f} s", args.out,
             Costs(f=c.f, b=c.b, w=c.w))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
