"""``tools.plan_costs.ep_traffic`` vs the inter-node bytes in the collective trace of a 4-rank FP8-dispatch CPU
run (one rank per node), under the planner's routing: M nodes uniformly, then K distinct experts among theirs."""
import json

import torch

from models import ModelConfig
from models.steps import drive
from parallel.collective_trace import CollectiveTrace
from parallel.dims import ParallelDims
from parallel.ep import HierarchicalDispatcher
from tools.plan_costs import ep_traffic

from .dist_utils import spawn

CFG = ModelConfig(dim=128, n_routed_experts=16, n_activated_experts=4, n_expert_groups=4, n_limited_groups=2)
TOKENS = 2048   # per rank


def balanced_node_limited(T: int, nodes: int, per_node: int, M: int, K: int, gen) -> torch.Tensor:
    """[T, K] expert ids: M distinct nodes per token, then K distinct experts among their M * per_node."""
    chosen = torch.rand(T, nodes, generator=gen).argsort(-1)[:, :M]
    pool = (chosen.unsqueeze(-1) * per_node + torch.arange(per_node)).flatten(1)
    return pool.gather(1, torch.rand(T, M * per_node, generator=gen).argsort(-1)[:, :K])


def _inter_node_row_bytes(calls, members, rank: int) -> int:
    """Bytes of token rows (width D, and D/128 scales) this rank sent to other ranks (nodes); gate weights and
    ids are left out, as the planner leaves them out."""
    total = 0
    for c in calls:
        if c.op != "all_to_all_single":
            continue
        dtype, shape = c.tensors[1]   # (output, input): what this rank sends
        if shape[1:] not in ((CFG.dim,), (CFG.dim // 128,)):
            continue
        row = shape[1] * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        peers = members[c.group]
        total += sum(n * row for j, n in enumerate(c.splits[1]) if peers[j] != rank)
    return total


def _worker(rank, world, out_dir):
    dims = ParallelDims(world_size=world, rank=rank, ep=world, ranks_per_node=1).build_groups()
    disp = HierarchicalDispatcher(CFG.n_routed_experts, dims.group("ep"), dims.group("ep_inter"),
                                  dims.group("ep_intra"), fp8=True)
    gen = torch.Generator().manual_seed(rank)
    idx = balanced_node_limited(TOKENS, world, CFG.n_routed_experts // world, CFG.n_limited_groups,
                                CFG.n_activated_experts, gen)
    x = torch.randn(TOKENS, CFG.dim, generator=gen).bfloat16().requires_grad_()
    w = torch.rand(TOKENS, CFG.n_activated_experts, generator=gen)
    with CollectiveTrace() as trace:
        y = drive(disp.route(x, idx, w, lambda rows, counts: 2 * rows))
        n_fwd = len(trace.calls)
        y.float().square().sum().backward()
    fwd = _inter_node_row_bytes(trace.calls[:n_fwd], trace.members, rank)
    bwd = _inter_node_row_bytes(trace.calls[n_fwd:], trace.members, rank)
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"fwd": fwd, "bwd": bwd, "copies": disp.stats.cross_node_copies}))


def test_inter_node_bytes_match_the_dispatchers_wire(tmp_path):
    world = 4
    spawn(_worker, world, tmp_path, tmp_path)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    t = ep_traffic(CFG, ep=world, ranks_per_node=1, tokens=TOKENS, fp8_dispatch=True)
    pairs = sum(g["copies"] for g in got)   # (token, remote node) rows: the dispatcher's own counter
    # per remote (token, node): FP8 row + scales out, one BF16 row back; backward: two BF16 rows
    assert sum(g["fwd"] for g in got) == pairs * (CFG.dim + 4 * CFG.dim // 128 + 2 * CFG.dim)
    assert sum(g["bwd"] for g in got) == pairs * 2 * 2 * CFG.dim
    # the planner's expectation vs the sampled routing: 4 x 2048 tokens, a fraction of a per cent apart
    for d in ("fwd", "bwd"):
        measured = sum(g[d] for g in got) / world
        assert abs(measured / t.inter_bytes[d] - 1) < 0.02, (d, measured, t.inter_bytes[d])
