"""Cluster planner (tools/plan.py, tools/plan_costs.py): the cost model's pieces and DeepSeek-V3's published step."""
import dataclasses
import math

import pytest
import torch

import models
from configs import model_preset
from configs.schema import compose
from models.config import ModelConfig
from models.params import flops_per_token
from parallel.pipeline.schedules import get_schedule
from parallel.pipeline.simulator import Costs, simulate
from tools.plan import V3_PUBLISHED, predict, published_schedule_bubble, v3_check
from tools.plan_costs import StageCost, StageCosts, ep_traffic, expected_distinct, load_hardware, stage_work
from trainer.memory_plan import model_parts, split_layers


@pytest.mark.parametrize("name,n_stages", [("tiny", 2), ("tiny", 4), ("v3_16b", 4)])
def test_stage_flops_sum_to_flops_per_token(name, n_stages):
    m = model_preset(name)
    model = models.build(m, "meta")
    parts, seq = model_parts(model), 256
    split = split_layers(m.n_layers, n_stages, None)
    works = [stage_work(m, parts, split[s], s == 0, s == n_stages - 1, seq) for s in range(n_stages)]
    # training = forward + Dgrad + Wgrad GEMMs (3x forward) + attention (forward + 2x backward)
    total = sum(3 * w.forward for w in works)
    assert total == pytest.approx(flops_per_token(m, seq, model).per_token, rel=1e-12)


def test_expected_distinct_by_hand():
    assert expected_distinct(2, 1, 1) == 1 and expected_distinct(2, 1, 2) == 2
    assert expected_distinct(4, 4, 1) == pytest.approx(1.0)
    # 2 bins of 2, draw 2 of 4: P(both in one bin) = 2 / C(4, 2) = 1/3 -> E = 1/3 * 1 + 2/3 * 2
    assert expected_distinct(2, 2, 2) == pytest.approx(5 / 3)


def test_nodes_per_token_vs_router():
    """The balanced-routing estimate is a lower bound, within 20 %, of the node-limited gate's nodes per token
    (the gate picks nodes by their best experts, spreading a token wider than uniform draws)."""
    torch.manual_seed(0)
    m = ModelConfig(dim=64, n_routed_experts=32, n_activated_experts=4, n_expert_groups=8, n_limited_groups=4)
    gate = models.moe.Gate(m)
    gate.init_weights(1.0)
    idx, _, _ = gate(torch.randn(4096, 64))
    nodes = torch.stack([torch.unique(r // 4).numel() * torch.ones(()) for r in idx]).mean().item()
    traffic = ep_traffic(m, ep=64, ranks_per_node=8, tokens=1, fp8_dispatch=True)
    assert traffic.nodes_per_token <= nodes <= m.n_limited_groups
    assert traffic.nodes_per_token == pytest.approx(nodes, rel=0.20)


def test_ep_bytes_by_hand():
    """Two nodes of one rank, M = 1: a token reaches exactly one node, remote with probability 1/2."""
    m = ModelConfig(dim=128, n_routed_experts=8, n_activated_experts=2, n_expert_groups=2, n_limited_groups=1)
    t = ep_traffic(m, ep=2, ranks_per_node=1, tokens=100, fp8_dispatch=True)
    assert t.nodes_per_token == 1 and t.remote_nodes == 0.5
    assert t.inter_bytes["fwd"] == pytest.approx(100 * 0.5 * ((128 + 4) + 2 * 128))
    assert t.inter_bytes["bwd"] == pytest.approx(100 * 0.5 * 4 * 128)
    assert ep_traffic(m, ep=1, ranks_per_node=1, tokens=100, fp8_dispatch=True).inter_bytes["fwd"] == 0


@pytest.mark.parametrize("name,pp", [("1f1b", 4), ("zb1p", 4), ("dualpipe", 4), ("dualpipev", 2)])
def test_uniform_stage_costs_equal_the_simulator(name, pp):
    """With equal stages and no all-to-all the planner's costs are the simulator's own Costs."""
    sched = get_schedule(name, pp, 8)
    ours = simulate(sched, StageCosts([StageCost(2.0, 2.0, 1.0, 0.0, 0.0)] * sched.n_stages, p2p=0.1, overlap=True))
    ref = simulate(sched, Costs(f=2.0, b=2.0, w=1.0, p2p=0.1))
    assert ours.makespan == pytest.approx(ref.makespan) and ours.bubble == pytest.approx(ref.bubble)


def test_fb_overlap_rule():
    c = StageCosts([StageCost(1.0, 1.0, 0.5, 0.4, 2.0)], p2p=0.0, overlap=True)
    # forward's all-to-all (0.4) hides under bw (1.5); backward's (2.0) only up to f (1.0): 1.0 exposed
    assert c.fb_parts(0, 0) == (2.5, 1.0)
    assert StageCosts(c.stages, 0.0, overlap=False).fb_parts(0, 0) == (2.5, 2.4)


def test_replicated_params_per_pipeline_rank():
    """What ``ReplicaSync`` sums: DualPipe every stage twice, 1F1B with MTP the tied embedding; experts per EP shard."""
    from tools.plan import replicated_params
    for sched, ep in (("dualpipe", 1), ("dualpipe", 2), ("1f1b", 1)):
        cfg = compose(["+exp=tiny", "parallel.pp=2", f"parallel.schedule={sched}", f"parallel.ep={ep}"])
        model = models.build(cfg.model, "meta")
        parts = model_parts(model)
        rep = replicated_params(cfg, 8, model)
        if sched == "dualpipe":   # both ranks hold the whole model
            whole = sum(parts.layer_dense) + parts.embed + parts.head + parts.mtp_dense
            whole += (sum(parts.layer_expert) + parts.mtp_expert) // ep
            assert rep == {0: whole, 1: whole}
        else:
            assert rep == {0: parts.embed, 1: parts.embed}
    assert replicated_params(compose(["+exp=tiny"]), 8, models.build(compose(["+exp=tiny"]).model, "meta")) == {}


def test_gpu_step_end_sums_the_twin_gradients_in_bf16_over_the_inter_node_link():
    """DualPipe's twin stages (on other nodes) sum their gradients every step; V3's rank 0 pays the most."""
    from tools.plan import V3_LAYOUT, V3_WORLD, replicated_params
    from tools.plan_costs import step_end
    from trainer.activations import V3_RECIPE
    from trainer.memory_plan import check_layout, plan_memory
    cfg, hw = compose(V3_LAYOUT), load_hardware("h800")
    model = models.build(cfg.model, "meta")
    dims = check_layout(cfg, V3_WORLD)
    mem = plan_memory(cfg, V3_WORLD, "v3", V3_RECIPE, model=model)
    twins = replicated_params(cfg, 120, model)
    assert twins[0] == twins[15] > twins[7] > 0
    without, with_ = step_end(cfg, hw, mem, dims, {}), step_end(cfg, hw, mem, dims, twins)
    # rank 0 (or 15) is the worst: an all-reduce between 2 ranks moves its BF16 twin gradients once each way
    assert with_ - without == pytest.approx(2 * twins[0] / (hw.ib_gb_s * 1e9) + hw.p2p_latency_us * 1e-6, rel=0.02)


def test_varying_action_times_cost_a_tightly_coupled_pipeline_time():
    """``Hardware.action_cv``: varying action times slow DualPipe pp=2 (ranks wait for late peers), seeded."""
    cfg = compose(["model=v3_16b", "parallel.pp=2", "parallel.schedule=dualpipe", "data.seq_len=4096",
                   "train.micro_batch_size=1", "train.global_batch_size=16"])
    hw = load_hardware("h100")
    even = predict(cfg, hw, 2, "bf16", "none")
    varied = [predict(cfg, dataclasses.replace(hw, action_cv=0.1), 2, "bf16", "none") for _ in range(2)]
    assert varied[0].pipeline_s == varied[1].pipeline_s                      # seeded
    assert even.pipeline_s * 1.01 < varied[0].pipeline_s < even.pipeline_s * 1.3, (even.pipeline_s, varied[0].pipeline_s)
    assert varied[0].bubble_s > even.bubble_s
    assert any("varying by 10%" in n for n in varied[0].notes) and not any("varying" in n for n in even.notes)


def test_all_to_all_latency_is_waiting_that_f_and_b_may_hide():
    """``a2a_latency_us`` adds to each MoE layer's all-to-all time (which F&B may hide), not to its compute."""
    from tools.plan_costs import action_costs
    cfg = compose(["+exp=tiny", "parallel.ep=2"])
    hw = load_hardware("h100")
    parts = model_parts(models.build(cfg.model, "meta"))
    (plain,), works, traffic, _ = action_costs(cfg, hw, parts, "bf16")
    (wait,), *_ = action_costs(cfg, dataclasses.replace(hw, a2a_latency_us=hw.a2a_latency_us + 100.0), parts, "bf16")
    extra = traffic.calls * 1e-4 * works[0].moe_layers
    assert works[0].moe_layers == 4 and traffic.calls == 2   # 3 MoE layers + the MTP block; dispatch + combine
    assert (wait.f, wait.a2a_f - plain.a2a_f, wait.a2a_b - plain.a2a_b) == pytest.approx((plain.f, extra, extra))


def test_v3_recipe_memory_fits_deepseeks_layout_and_not_the_earlier_winners():
    """V3's recipe keeps 164 KB per token in a MoE layer; DeepSeek's layout fits 80 GB with it, pp4 and pp8
    DualPipe ZeRO-2 do not (ZeRO-2 under a pipeline keeps full gradients)."""
    from trainer.activations import v3_recipe_bytes
    from tools.plan import V3_LAYOUT, V3_WORLD
    b = v3_recipe_bytes(compose(["model=v3_671b"]).model)
    assert b["moe_layer"] == pytest.approx(164.3e3, rel=1e-3) and b["dense_layer"] == pytest.approx(103.9e3, rel=1e-3)
    hw = load_hardware("h800")
    model = models.build(compose(V3_LAYOUT).model, "meta")
    assert predict(compose(V3_LAYOUT), hw, V3_WORLD, "fp8", "v3", model=model).fits
    for pp in (4, 8):
        cfg = compose([*V3_LAYOUT, f"parallel.pp={pp}", "parallel.zero=2"])
        assert not predict(cfg, hw, V3_WORLD, "fp8", "v3", model=model).fits, pp


def test_v3_published_step():
    """Acceptance 1: DeepSeek-V3 (2048 H800, PP16 DualPipe, EP64, ZeRO-1) vs ISCA'25 Table 4."""
    pred, rows = v3_check("h800")
    assert pred.step_s == pytest.approx(V3_PUBLISHED["step"], rel=0.15)
    for key in ("F", "B", "W", "F&B"):
        assert pred.phases[key] == pytest.approx(V3_PUBLISHED[key], rel=0.20), key
    assert not math.isnan(pred.mfu) and pred.fits


def test_v3_bubble_vs_the_schedule_of_the_published_rows():
    """Rank 0's bubble vs DualPipe's schedule on the published rows' own chunk costs; the published step's
    excess over that schedule equals its bubble's excess: idle time outside the schedule (docs/planner.md)."""
    pred, _ = v3_check("h800")
    implied = published_schedule_bubble("h800")
    assert implied["counts"] == {"F": 23, "B": 15, "W": 15, "BW": 8, "FB": 97}
    assert pred.bubble_s == pytest.approx(implied["bubble"], rel=0.15)
    excess_bubble = V3_PUBLISHED["bubble"] - implied["bubble"]
    excess_step = V3_PUBLISHED["step"] - implied["step"]
    assert excess_bubble > 0.5 and excess_step == pytest.approx(excess_bubble, abs=0.1)


@pytest.mark.xfail(strict=True, reason="the simulated bubble is ~1.2 s vs the published 2.06 s; the published rows' "
                                       "own chunk costs give the schedule 1.13 s (docs/planner.md)")
def test_v3_published_bubble():
    pred, _ = v3_check("h800")
    assert pred.bubble_s == pytest.approx(V3_PUBLISHED["bubble"], rel=0.15)


def test_versus_reference_sums_to_the_step_difference():
    """--search's comparison with the layout given: the causes add up to the step difference."""
    from tools.plan import _diffs, versus
    hw = load_hardware("h800")
    a = predict(compose(["+exp=tiny", "parallel.pp=2", "parallel.schedule=dualpipe"]), hw, 2)
    b = predict(compose(["+exp=tiny", "parallel.pp=2", "parallel.schedule=1f1b"]), hw, 2)
    assert sum(_diffs(a, b).values()) == pytest.approx(a.step_s - b.step_s, abs=1e-12)
    text = versus(a, b)
    assert f"{100 * (a.tokens_per_s_gpu / b.tokens_per_s_gpu - 1):+.1f}% tokens/s/GPU" in text
    assert "bubble" in text and f"{b.memory_gb:.3g} GB" in text


def _sampled_nodes_hit(m, nodes: int, tokens: int = 20000, seed: int = 0) -> float:
    """Balanced node-limited routing sampled (M of G groups, then K of their experts; experts laid out in order)."""
    g = torch.Generator().manual_seed(seed)
    E, K, G, M = m.n_routed_experts, m.n_activated_experts, m.n_expert_groups, m.n_limited_groups
    per_group = E // G
    groups = torch.rand(tokens, G, generator=g).argsort(-1)[:, :M]
    pool = (groups.unsqueeze(-1) * per_group + torch.arange(per_group)).flatten(1)
    experts = pool.gather(1, torch.rand(tokens, M * per_group, generator=g).argsort(-1)[:, :K])
    node = experts // (E // nodes)
    return float(torch.stack([torch.unique(r).numel() * torch.ones(()) for r in node]).mean())


@pytest.mark.parametrize("G,M,nodes", [(4, 2, 4), (8, 4, 4), (8, 3, 2), (2, 1, 4), (4, 2, 8), (8, 4, 8)])
def test_nodes_hit_matches_sampled_routing_for_any_group_to_node_mapping(G, M, nodes):
    """``plan_costs.nodes_hit`` vs sampled routing for any group/node ratio, never above ``routing_reach``."""
    from parallel.dims import routing_reach
    from tools.plan_costs import nodes_hit
    m = ModelConfig(dim=64, n_routed_experts=64, n_activated_experts=6, n_expert_groups=G, n_limited_groups=M)
    want = _sampled_nodes_hit(m, nodes)
    assert nodes_hit(m, nodes) == pytest.approx(want, rel=0.02)
    assert nodes_hit(m, nodes) <= routing_reach(m, ep=nodes, ranks_per_node=1)[1]
    if G == nodes:        # one group per node: the closed form of the module doc
        assert nodes_hit(m, nodes) == pytest.approx(expected_distinct(M, 64 // G, 6))


def test_search_plans_the_model_as_it_is():
    """The candidates keep the model's routing groups and skip EP layouts the trainer refuses for them."""
    from tools.plan import candidates
    cfg = compose(["model=v3_671b", "data.seq_len=4096"])
    cands = candidates(cfg, 1024, 8)
    assert cands and not any(o.startswith("model.") for c in cands for o in c)
    eps = {int(o.split("=")[1]) for c in cands for o in c if o.startswith("parallel.ep=")}
    assert eps == {8, 16, 32, 64, 128, 256}                # 1..32 nodes: each divides 8 groups or is divided by 8
    cfg.model.n_expert_groups, cfg.model.n_limited_groups = 3, 2
    eps = {int(o.split("=")[1]) for c in candidates(cfg, 1024, 8) for o in c if o.startswith("parallel.ep=")}
    assert eps == {8}                                       # 1 node; 2, 4, ... nodes and 3 groups: neither divides
