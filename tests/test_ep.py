"""Expert parallelism (+ data parallelism) against the single-device model, on gloo/CPU processes."""
import copy
import os

import pytest
import torch
import torch.distributed as dist

from models import ModelConfig, build
from parallel.data_parallel import sync_gradients
from parallel.collective_trace import CollectiveTrace
from parallel.dims import ParallelDims
from parallel.ep import HierarchicalDispatcher, apply_ep

from .dist_utils import grads_with_reference, rel_err, spawn

TOL = 1e-6   # norm-wise relative error, fp32


def model_cfg(groups: int, limited: int) -> ModelConfig:
    return ModelConfig(vocab_size=128, dim=32, n_layers=3, first_k_dense=1, inter_dim=64, n_heads=2,
                       q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                       moe_inter_dim=16, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
                       n_expert_groups=groups, n_limited_groups=limited, route_scale=2.5, mtp_depth=1,
                       init_std=0.2)


def check_grads(ep_model, ref_model, dims, tag):
    for name, g, g_ref in grads_with_reference(ep_model, ref_model, dims):
        assert rel_err(g, g_ref) <= TOL, f"{tag}: grad {name} rel err {rel_err(g, g_ref):.2e}"


def distinct_cross_node_pairs(topk_idx, per_node, my_node):
    nodes = topk_idx // per_node
    pairs = {(t, int(n)) for t in range(nodes.shape[0]) for n in nodes[t].tolist() if n != my_node}
    return len(pairs), int(max((len(set(r.tolist())) for r in nodes), default=0))


def inter_node_rows(calls, members, inter_group, rank, dim):
    """Token rows (width ``dim``) of each all-to-all on the inter-node group: (sent to, received from) other
    nodes, as the collective trace saw the split sizes."""
    out = []
    for c in calls:
        if c.op == "all_to_all_single" and c.group == inter_group.group_name and c.tensors[1][1][1:] == (dim,):
            peers = members[c.group]
            out.append(tuple(sum(n for j, n in enumerate(c.splits[i]) if peers[j] != rank) for i in (1, 0)))
    return out


def _worker(rank, world, ep, rpn, dispatcher, skew, groups=None):
    dims = ParallelDims(world_size=world, rank=rank, ep=ep, ranks_per_node=rpn).build_groups()
    if groups is None:   # one routing group per EP node
        groups, limited = dims.ep_nodes, 1 if dims.ep_nodes <= 2 else 2
    else:                # groups and nodes differ: M = 1 (a token stays in one group)
        limited = 1
    cfg = model_cfg(groups, limited)
    dims.check_model(cfg)
    torch.manual_seed(0)
    ref = build(cfg, seed=0).train()
    if skew:   # every token picks experts 0 and 1 (rank 0): the other experts and whole ranks get nothing
        for moe in ref.moe_layers():
            moe.gate.expert_bias[1] = 50.0
            moe.gate.expert_bias[0] = 40.0
    ep_model = apply_ep(copy.deepcopy(ref), dims, dispatcher=dispatcher)
    B_local = 2
    ids = torch.randint(0, cfg.vocab_size, (B_local * dims.dp, 17), generator=torch.Generator().manual_seed(1))
    mine = slice(dims.dp_rank * B_local, (dims.dp_rank + 1) * B_local)

    # --- one MoE layer: outputs and gradients ------------------------------------------------------
    moe_ref, moe_ep = ref.layers[1].ffn, ep_model.layers[1].ffn
    x = torch.randn(B_local * dims.dp, 9, cfg.dim, generator=torch.Generator().manual_seed(2))
    g = torch.randn_like(x)
    y_ref = moe_ref(x)
    (y_ref * g).sum().div(dims.dp).backward()
    with CollectiveTrace() as trace:
        y = moe_ep(x[mine])
    assert rel_err(y, y_ref[mine]) <= TOL, f"moe output rel err {rel_err(y, y_ref[mine]):.2e}"
    (y * g[mine]).sum().backward()   # per-rank loss; sync_gradients averages over dp
    sync_gradients(moe_ep, dims)
    check_grads(moe_ep, moe_ref, dims, "moe layer")

    # --- node limit on the wire ----------------------------------------------------------------------
    disp = moe_ep.dispatcher
    if isinstance(disp, HierarchicalDispatcher):
        idx = moe_ep.gate(x[mine].reshape(-1, cfg.dim))[0]
        want, max_nodes = distinct_cross_node_pairs(idx, disp.per_node, disp.node)
        assert disp.stats.cross_node_copies == want, (disp.stats.cross_node_copies, want)
        # one row per (token, remote node) out, and one back per (token from a remote node, this node)
        (out, received), (back, _) = inter_node_rows(trace.calls, trace.members, dims.group("ep_inter"), rank,
                                                     cfg.dim)
        assert (out, back) == (want, received), (out, back, want, received)
        assert out > 0 or skew   # the route crossed nodes (skewed routing may keep every copy on rank 0)
        groups_bound, nodes_bound = dims.routing_reach(cfg)
        assert disp.stats.max_nodes_per_token == max_nodes <= nodes_bound
        assert nodes_bound == (max(1, dims.ep_nodes // groups) if limited == 1 else min(limited, dims.ep_nodes))

    # --- whole model: loss and every parameter gradient ---------------------------------------------
    for m in (ref, ep_model):
        m.zero_grad(set_to_none=True)
    out_ref = ref.compute_loss(ids[:, :-1], ids[:, 1:], mtp_weight=0.3, aux_alpha=0.01)
    out_ref.loss.backward()
    out = ep_model.compute_loss(ids[mine, :-1], ids[mine, 1:], mtp_weight=0.3, aux_alpha=0.01)
    out.loss.backward()
    sync_gradients(ep_model, dims)
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    assert rel_err(loss / dims.dp, out_ref.loss.detach()) <= TOL
    check_grads(ep_model, ref, dims, "model")
    # Balancing load, all-reduced over dp, equals the single-device count.
    for moe_e, moe_r in zip(ep_model.moe_layers(), ref.moe_layers()):
        load = moe_e.tokens_per_expert.clone()
        dist.all_reduce(load)
        assert torch.equal(load, moe_r.tokens_per_expert)
    if skew:   # the skew really starved experts 2..7 (and the ranks holding them)
        assert (ref.moe_layers()[0].tokens_per_expert[2:] == 0).all()


LAYOUTS = [  # world, ep, ranks_per_node, dispatcher
    (2, 2, 1, "hierarchical"),
    (2, 2, 2, "hierarchical"),   # one node: flat all-to-all inside it
    (4, 4, 1, "hierarchical"),
    (4, 4, 2, "hierarchical"),
    (4, 4, 2, "alltoall"),
    (4, 2, 1, "hierarchical"),   # expert-dp 2: expert grads reduced over replicas
]


@pytest.mark.parametrize("world,ep,rpn,dispatcher", LAYOUTS)
@pytest.mark.parametrize("skew", [False, True])
def test_ep_matches_single_device(tmp_path, world, ep, rpn, dispatcher, skew):
    spawn(_worker, world, tmp_path, ep, rpn, dispatcher, skew)


def _gathered_worker(rank, world, *args):
    from parallel.compile import GATHER_ENV
    assert os.environ.get(GATHER_ENV) == "1"   # the opt-in reached the rank
    _worker(rank, world, *args)


def test_the_opt_in_gathered_dispatch_backward_matches_single_device(tmp_path, monkeypatch):
    """``DSV3_GATHER_COPIES=1``: the flat all-to-all's dispatch backward un-sorts the returned copies' gradients
    and sums them per token (``parallel.compile.GATHER_ENV``) instead of an accumulating index write."""
    from parallel.compile import GATHER_ENV
    monkeypatch.setenv(GATHER_ENV, "1")
    spawn(_gathered_worker, 2, tmp_path, 2, 1, "alltoall", True)


@pytest.mark.parametrize("rpn,groups", [
    (2, 4),   # 2 EP nodes x 2 ranks, 4 groups: 2 groups per node, a token reaches 1 node
    (1, 2),   # 4 EP nodes, 2 groups: a group spans 2 nodes, a token reaches <= 2 of the 4
])
def test_routing_groups_other_than_nodes(tmp_path, rpn, groups):
    """Routing groups are the model's, nodes the cluster's: the hierarchical route still matches the single
    device and sends one row per (token, remote node) over the inter-node link, within the group bound."""
    spawn(_worker, 4, tmp_path, 4, rpn, "hierarchical", False, groups)


@pytest.mark.parametrize("kw,key", [
    (dict(world_size=6, ep=4), "parallel.ep"),
    (dict(world_size=4, pp=3), "parallel.pp"),
    (dict(world_size=8, ep=4, ranks_per_node=3), "parallel.ep"),
])
def test_invalid_layouts(kw, key):
    from errors import ConfigError
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        ParallelDims(**kw)


@pytest.mark.parametrize("cfg_kw,key", [
    (dict(n_routed_experts=6, n_activated_experts=2, n_expert_groups=2, n_limited_groups=1), "model.n_routed_experts"),
    (dict(n_routed_experts=12, n_expert_groups=3, n_limited_groups=1), "model.n_expert_groups"),   # 3 vs 2 nodes
])
def test_invalid_model_for_layout(cfg_kw, key):
    from errors import ConfigError
    dims = ParallelDims(world_size=4, ep=4, ranks_per_node=2)   # 2 EP nodes
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        dims.check_model(ModelConfig(**cfg_kw))


@pytest.mark.parametrize("ep,rpn,groups,limited,K,reach", [
    (4, 2, 2, 2, 2, (2, 2)),    # one group per node
    (4, 2, 4, 3, 3, (3, 2)),    # M = 3 groups > 2 nodes: 2 groups per node, still at most 2 nodes
    (4, 2, 8, 1, 2, (1, 1)),
    (4, 1, 2, 1, 2, (1, 2)),    # a group spans 2 of the 4 nodes
    (8, 1, 2, 1, 4, (1, 4)),    # a group spans 4 of the 8 nodes
    (4, 1, 1, 1, 2, (1, 2)),    # one group over every node: the K = 2 experts bound it
    (2, 2, 4, 2, 2, (2, 1)),    # EP inside one node: any group count
    (8, 8, 8, 4, 8, (4, 1)),    # v3_small on 4 nodes x 8 with ep=8: the EP group is one node
    (8, 1, 8, 4, 8, (4, 4)),    # DeepSeek-V3's 8 groups, top-4, one per node
])
def test_routing_groups_and_nodes_either_divides(ep, rpn, groups, limited, K, reach):
    dims = ParallelDims(world_size=ep, ep=ep, ranks_per_node=rpn)
    cfg = ModelConfig(n_routed_experts=16, n_activated_experts=K, n_expert_groups=groups, n_limited_groups=limited)
    cfg.validate("model")
    dims.check_model(cfg)
    assert dims.routing_reach(cfg) == reach


def test_model_limits_still_apply():
    """M > G is the model's own error, whatever the layout."""
    from models.config import ModelError
    with pytest.raises(ModelError, match=r"model\.n_limited_groups"):
        ModelConfig(n_expert_groups=2, n_limited_groups=3, n_activated_experts=3).validate("model")


def _timeout_worker(rank, world):
    import time
    dims = ParallelDims(world_size=world, rank=rank, ep=2).build_groups()
    model = apply_ep(build(model_cfg(2, 1), seed=0), dims)
    if rank == 1:
        time.sleep(6)   # skips the layer: rank 0's all-to-all must time out, not hang
        return
    with pytest.raises(RuntimeError, match=r"layers\.1\.ffn \(EP group \[0, 1\]\) failed on rank 0"):
        model.layers[1].ffn(torch.randn(1, 4, 32))


def test_collective_timeout_names_rank_and_layer(tmp_path):
    spawn(_timeout_worker, 2, tmp_path, timeout_s=2)


# ---- trainer level: a 4-group model under EP=2 on one node and on two --------------------------------------
GROUPS_COMMON = ["logging.wandb.mode=disabled", "logging.progress=false", "train.eval_every=0", "train.eval_batches=1",
                 "train.memory_check=false", "checkpoint.save_final=false", "data.seq_len=32",
                 "train.micro_batch_size=2", "train.global_batch_size=4", "optim.moment_dtype=fp32", "optim.warmup_steps=1", "train.max_steps=2",
                 "model.n_expert_groups=4", "model.n_limited_groups=2"]
GROUP_LAYOUTS = {   # name: (ranks_per_node, dispatcher, the start-up line's routing bound)
    "1 node, hierarchical": (2, "hierarchical", "4 expert groups on 1 EP node(s) (4 per node), dispatcher "
                             "hierarchical; each token reaches <= 2 groups = <= 1 node(s)"),
    "2 nodes, hierarchical": (1, "hierarchical", "4 expert groups on 2 EP node(s) (2 per node), dispatcher "
                              "hierarchical; each token reaches <= 2 groups = <= 2 node(s)"),
    "2 nodes, alltoall": (1, "alltoall", "4 expert groups on 2 EP node(s) (2 per node), dispatcher alltoall; "
                          "each token reaches <= 2 groups = <= 2 node(s)"),
}


def _train_steps(cfg, dims, run_dir, lines=None) -> list[list[float]]:
    from trainer.startup import startup_lines
    from trainer.train import Trainer
    trainer = Trainer(cfg, run_dir, dims, torch.device("cpu"))
    if lines is not None:
        lines += startup_lines(trainer)
    return [[m["loss"], m["grad_norm"]] for m in (trainer.train_step() for _ in range(cfg.train.max_steps))]


def _groups_worker(rank, world, out_dir):
    import json

    from .trainer_utils import make_config
    got = {}
    for name, (rpn, dispatcher, routing) in GROUP_LAYOUTS.items():
        dims = ParallelDims(world_size=world, rank=rank, ep=2, ranks_per_node=rpn).build_groups()
        cfg = make_config(*GROUPS_COMMON, f"data.cache_dir={out_dir}/cache", "parallel.ep=2",
                          f"parallel.ranks_per_node={rpn}", f"parallel.ep_dispatcher={dispatcher}", world_size=world)
        lines = []
        got[name] = _train_steps(cfg, dims, out_dir / f"run-{rpn}-{dispatcher}-{rank}", lines)
        assert f"routing: {routing}" in lines, lines
    if rank == 0:
        (out_dir / "got.json").write_text(json.dumps(got))


def test_four_group_model_under_ep2_on_one_and_two_nodes_matches_single_device(tmp_path):
    """4 routing groups under EP=2 on one node and on two, both dispatchers, train as on one device: loss and
    gradient norm of 2 steps to rel 1e-5 (later steps drift as AdamW grows rounding-level differences)."""
    import json

    from .trainer_utils import make_config
    want = _train_steps(make_config(*GROUPS_COMMON, f"data.cache_dir={tmp_path}/cache"), ParallelDims(world_size=1),
                        tmp_path / "single")
    spawn(_groups_worker, 2, tmp_path, tmp_path)
    got = json.loads((tmp_path / "got.json").read_text())
    assert list(got) == list(GROUP_LAYOUTS)
    for name, steps in got.items():
        for s, ((loss, gnorm), (loss_1, gnorm_1)) in enumerate(zip(steps, want, strict=True)):
            assert abs(loss - loss_1) <= 1e-5 * abs(loss_1), (name, s, loss, loss_1)
            assert abs(gnorm - gnorm_1) <= 1e-5 * abs(gnorm_1), (name, s, gnorm, gnorm_1)
