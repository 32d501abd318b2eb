"""Expert parallelism (+ data parallelism) against the single-device model, on gloo/CPU processes."""
import copy

import pytest
import torch
import torch.distributed as dist

from models import ModelConfig, build
from models.moe import MoE
from parallel.data_parallel import sync_gradients
from parallel.dims import ParallelDims
from parallel.ep import HierarchicalDispatcher, apply_ep

from .dist_utils import grads_with_reference, rel_err, spawn

TOL = 1e-6   # norm-wise relative error, fp32


def model_cfg(ep_nodes: int, limited: int) -> ModelConfig:
    return ModelConfig(vocab_size=128, dim=32, n_layers=3, first_k_dense=1, inter_dim=64, n_heads=2,
                       q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                       moe_inter_dim=16, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
                       n_expert_groups=ep_nodes, n_limited_groups=limited, route_scale=2.5, mtp_depth=1,
                       init_std=0.2)


def check_grads(ep_model, ref_model, dims, tag):
    for name, g, g_ref in grads_with_reference(ep_model, ref_model, dims):
        assert rel_err(g, g_ref) <= TOL, f"{tag}: grad {name} rel err {rel_err(g, g_ref):.2e}"


def distinct_cross_node_pairs(topk_idx, per_node, my_node):
    nodes = topk_idx // per_node
    pairs = {(t, int(n)) for t in range(nodes.shape[0]) for n in nodes[t].tolist() if n != my_node}
    return len(pairs), int(max((len(set(r.tolist())) for r in nodes), default=0))


def _worker(rank, world, ep, rpn, dispatcher, skew):
    dims = ParallelDims(world_size=world, rank=rank, ep=ep, ranks_per_node=rpn).build_groups()
    limited = 1 if dims.ep_nodes <= 2 else 2
    cfg = model_cfg(dims.ep_nodes, limited)
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
        assert disp.stats.max_nodes_per_token == max_nodes <= cfg.n_limited_groups

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
    (dict(n_expert_groups=4, n_limited_groups=2), "model.n_expert_groups"),
])
def test_invalid_model_for_layout(cfg_kw, key):
    from errors import ConfigError
    dims = ParallelDims(world_size=4, ep=4, ranks_per_node=2)   # 2 EP nodes
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        dims.check_model(ModelConfig(**cfg_kw))


def test_m_greater_than_nodes_rejected():
    from errors import ConfigError
    dims = ParallelDims(world_size=4, ep=4, ranks_per_node=2)
    cfg = ModelConfig(n_expert_groups=2, n_limited_groups=2, n_activated_experts=2)
    dims.check_model(cfg)   # M = nodes is allowed
    with pytest.raises(ConfigError, match=r"model\.n_expert_groups|model\.n_limited_groups"):
        dims.check_model(ModelConfig(n_expert_groups=2, n_limited_groups=2, n_activated_experts=2,
                                     n_routed_experts=8).__class__(n_expert_groups=2, n_limited_groups=3,
                                                                    n_activated_experts=3))


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
