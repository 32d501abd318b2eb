"""The planner's per-action cost model (``tools.plan``): hardware profiles, the work of a pipeline stage, the
expert all-to-all traffic, the F / B / W costs of one micro-batch and the step end.

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
token's K experts are uniform among the experts of its M chosen groups (``nodes_hit``; with one group per EP
node the expected number of distinct nodes it reaches is M (1 - C(n_M - n_g, K) / C(n_M, K)), n_M = experts
of M groups, n_g = of one; several groups per node or a group over several nodes map the groups hit onto
nodes); of them a fraction (N - 1) / N of the N EP nodes are remote (over the inter-node link, once per node,
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
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

from parallel.pipeline.schedules import Kind, get_schedule
from parallel.pipeline.simulator import Simulation, simulate
from trainer.activations import activation_bytes_per_token
from trainer.memory_plan import GB, n_stages, split_layers

HARDWARE_DIR = Path(__file__).resolve().parents[1] / "configs" / "hardware"


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
    a2a_latency_us: float = 0.0         # per all-to-all call, waiting: F&B overlap can hide it
    p2p_latency_us: float = 0.0
    action_cv: float = 0.0              # an action's time from one micro-batch to the next: coefficient of
                                        # variation (0: constant)
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
    act_bytes: float       # saved-for-backward bytes (trainer.activations.activation_bytes_per_token, bf16)

    @property
    def forward(self) -> float:
        return self.gemm + self.gemm_bf16 + self.attention


def stage_work(m, parts, layers, first: bool, last: bool, seq_len: int) -> StageWork:
    """``parts``: ``trainer.memory_plan.model_parts`` of the model. Formulas in the module doc."""
    frac = m.n_activated_experts / m.n_routed_experts
    act = activation_bytes_per_token(m, 2)
    attn_layer = m.n_heads * (m.qk_head_dim + m.v_head_dim) * seq_len
    up_proj = (m.q_lora_rank or m.dim) * m.n_heads * m.qk_head_dim + m.kv_lora_rank * m.n_heads * (
        m.qk_nope_head_dim + m.v_head_dim)
    gemm = sum(2 * (parts.layer_dense[i] + parts.layer_expert[i] * frac) for i in layers)
    acts = sum(act["moe_layer" if m.is_moe_layer(i) else "dense_layer"] for i in layers)
    w = StageWork(list(layers), gemm, 0.0, attn_layer * len(layers), 2 * up_proj * len(layers),
                  sum(m.is_moe_layer(i) for i in layers), acts)
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


def nodes_hit(m, nodes: int) -> float:
    """Expected distinct EP nodes one token's K experts live on, under balanced node-limited routing: M of the
    G groups chosen uniformly, then K experts uniformly among theirs (module doc). G = nodes: the K experts
    among M nodes. G > nodes (G / nodes groups per node): the groups hit, then the nodes holding them. G <
    nodes (a group over nodes / G nodes): the K experts among the M groups' M * nodes / G nodes."""
    E, K, G = m.n_routed_experts, m.n_activated_experts, m.n_expert_groups
    M = min(m.n_limited_groups, G)
    if G <= nodes:
        return expected_distinct(M * (nodes // G), E // nodes, K)
    groups = expected_distinct(M, E // G, K)                 # distinct groups hit
    lo = math.floor(groups)                                  # groups drawn uniformly: nodes among G // nodes each
    at = lambda h: expected_distinct(nodes, G // nodes, h) if h else 0.0   # noqa: E731
    return at(lo) + (groups - lo) * (at(lo + 1) - at(lo)) if lo < G else float(nodes)


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
    E, K = m.n_routed_experts, m.n_activated_experts
    per_node = E // nodes
    hit_nodes = nodes_hit(m, nodes)
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


def a2a_seconds(traffic: EPTraffic, hw: Hardware, direction: str) -> float:
    """One MoE layer's all-to-alls in ``direction`` (``fwd`` / ``bwd``): the slower link, plus latency per call."""
    if traffic.calls == 0:
        return 0.0
    wire = max(traffic.inter_bytes[direction] / (hw.ib_gb_s * GB),
               traffic.intra_bytes[direction] / (hw.nvlink_gb_s * GB))
    per_call = wire / traffic.calls + hw.a2a_latency_us * 1e-6
    return traffic.calls * per_call


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
    ``p2p``); the overlap rules of the module doc. ``scale`` varies compute per action (``id(action)`` -> factor;
    ``Hardware.action_cv``)."""

    def __init__(self, stages: list[StageCost], p2p: float, overlap: bool, scale: dict[int, float] | None = None):
        self.stages, self.p2p, self.overlap, self.scale = stages, p2p, overlap, scale or {}

    def parts(self, kind: Kind, s: int, k: float = 1.0) -> tuple[float, float]:
        """(compute, exposed all-to-all) of a plain action, its compute slowed ``k`` times."""
        c = self.stages[s]
        return {Kind.F: (k * c.f, c.a2a_f), Kind.B: (k * c.b, c.a2a_b), Kind.W: (k * c.w, 0.0),
                Kind.BW: (k * (c.b + c.w), c.a2a_b)}[kind]

    def fb_parts(self, sf: int, sb: int, k: float = 1.0) -> tuple[float, float]:
        f, af = self.parts(Kind.F, sf, k)
        bw, ab = self.parts(Kind.BW, sb, k)
        if not self.overlap:
            return f + bw, af + ab
        exposed = max(max(0.0, af - bw) + max(0.0, ab - f), af + ab - (f + bw))
        return f + bw, exposed

    def split(self, a) -> tuple[float, float]:
        k = self.scale.get(id(a), 1.0)
        if a.kind is Kind.FB:
            return self.fb_parts(a.stage, a.bwd.stage, k)
        if a.kind in (Kind.F, Kind.B, Kind.W, Kind.BW):
            return self.parts(a.kind, a.stage, k)
        return 0.0, 0.0

    def of(self, a) -> float:
        return sum(self.split(a))


def gpu_seconds(w: StageWork, T: int, hw: Hardware, precision: str, recompute: str, reserve_sms: bool
                ) -> tuple[float, float, float]:
    """F, B, W seconds of a micro-batch of ``T`` tokens from the profile's peaks and efficiencies (module doc);
    ``reserve_sms``: the layout has EP communication."""
    sm = 1 - hw.reserved_sms / hw.sms if reserve_sms else 1.0
    low = hw.peak_fp8_tflops * 1e12 * sm if precision == "fp8" else hw.peak_bf16_tflops * 1e12 * sm
    bf16 = hw.peak_bf16_tflops * 1e12 * sm
    eff_main = hw.gemm_efficiency if precision == "fp8" else hw.bf16_efficiency
    eff_w = hw.wgrad_efficiency if precision == "fp8" else hw.bf16_efficiency
    hbm = hw.hbm_tb_s * 1e12
    pf, pb, pw = hw.elementwise_passes
    f = T * (w.gemm / (low * eff_main) + w.gemm_bf16 / (bf16 * hw.bf16_efficiency)
             + w.attention / (bf16 * hw.attention_efficiency) + pf * w.act_bytes / hbm)
    b = T * (w.gemm / (low * eff_main) + w.gemm_bf16 / (bf16 * hw.bf16_efficiency)
             + 2 * w.attention / (bf16 * hw.attention_efficiency) + pb * w.act_bytes / hbm
             + (w.recompute / (low * eff_main) if recompute == "v3" else 0.0))
    if recompute == "full":
        b += f
    wg = T * (w.gemm / (low * eff_w) + w.gemm_bf16 / (bf16 * hw.bf16_efficiency) + pw * w.act_bytes / hbm)
    return f, b, wg


def action_costs(cfg, hw: Hardware, parts, precision: str = "fp8", recompute: str = "none"
                 ) -> tuple[list[StageCost], list[StageWork], EPTraffic, float]:
    """Per-stage costs of one micro-batch, the works behind them, the EP traffic and the p2p time."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    n_st = n_stages(p.schedule, p.pp)
    split = split_layers(m.n_layers, n_st, p.pp_layout)
    T = t.micro_batch_size * cfg.data.seq_len
    works = [stage_work(m, parts, split[s], s == 0, s == n_st - 1, cfg.data.seq_len) for s in range(n_st)]
    traffic = ep_traffic(m, p.ep, p.ranks_per_node, T, p.fp8_dispatch or precision == "fp8")
    a2a_f, a2a_b = a2a_seconds(traffic, hw, "fwd"), a2a_seconds(traffic, hw, "bwd")
    costs = []
    for w in works:
        f, b, wg = gpu_seconds(w, T, hw, precision, recompute, p.ep > 1)
        costs.append(StageCost(f, b, wg, a2a_f * w.moe_layers, a2a_b * w.moe_layers))
    p2p = hw.p2p_latency_us * 1e-6 + T * m.dim * 2 / (hw.ib_gb_s * GB)
    return costs, works, traffic, p2p


def step_end(cfg, hw: Hardware, mem_plan, dims, replicated: dict[int, int] | None = None) -> float:
    """ZeRO reduce-scatter + all-gather (or all-reduce) over dp/edp on the worst rank, plus the all-reduce that
    sums the gradients of the parameters two pipeline ranks hold (``replicated``: per pp rank; DualPipe's twin
    stages, a tied embedding: the twin is another pipeline rank, so another node), plus AdamW. Gradients travel
    in BF16 (DeepSeek's recipe)."""
    worst = 0.0
    for r in mem_plan.ranks:
        dense, expert = r.params_dense, r.params_expert
        ring = lambda n, nbytes: 0.0 if n == 1 else (n - 1) / n * nbytes / (hw.ib_gb_s * GB)  # noqa: E731
        grad_bytes = 2
        comm = 2 * (ring(dims.dp, grad_bytes * dense) + ring(dims.edp, grad_bytes * expert))   # RS + AG, or one AR
        owned = (dense / dims.dp + expert / dims.edp) if cfg.parallel.zero >= 1 else dense + expert
        twins = (replicated or {}).get(r.pp_rank, 0)
        sync = 2 * ring(2, grad_bytes * twins) + hw.p2p_latency_us * 1e-6 if twins else 0.0
        update = 24 * owned / (hw.hbm_tb_s * 1e12) + sync
        worst = max(worst, comm + update)
    return worst


# ---- the schedule on these costs, with varying actions -----------------------------------------------------
VARIATION_SAMPLES = 16   # simulations with random action times (``Hardware.action_cv``) whose median step is taken


def simulate_layout(cfg, hw: Hardware, world_size: int, n_micro: int, costs: StageCosts
                       ) -> tuple[Simulation, StageCosts, list[str]]:
    """The schedule simulated with ``costs``. With ``hw.action_cv``, each action's time varies at random around its
    cost and the simulation with the median makespan of ``VARIATION_SAMPLES`` (seeded: the prediction is
    reproducible) is the one returned: a rank that waits for a late peer loses time an even schedule does not
    show. The costs returned carry the variation."""
    p = cfg.parallel
    schedule = get_schedule(p.schedule, p.pp, n_micro)
    sim = simulate(schedule, costs)
    notes = []
    if hw.action_cv > 0:
        even = sim.makespan
        runs = []
        for seed in range(VARIATION_SAMPLES):
            rng = random.Random(seed)
            scale = {id(a): costs.scale.get(id(a), 1.0) * max(0.5, rng.gauss(1.0, hw.action_cv))
                     for actions in schedule for a in actions if a.is_compute}
            varied = StageCosts(costs.stages, costs.p2p, costs.overlap, scale)
            runs.append((simulate(schedule, varied), varied))
        runs.sort(key=lambda r: r[0].makespan)
        sim, costs = runs[len(runs) // 2]
        notes.append(f"action times varying by {hw.action_cv:.0%} (coefficient of variation): pipeline "
                     f"{1e3 * even:.1f} -> {1e3 * sim.makespan:.1f} ms (median of {VARIATION_SAMPLES})")
    return sim, costs, notes
