"""FP8 dispatch (``apply_ep(..., fp8_dispatch=True)``) on gloo/CPU processes against the single-device MoE layer
whose experts' inputs are quantise-dequantised alike (E4M3, 1x128 tiles, pow2 scales, straight-through backward):
as tight as the plain EP path, since only the quantisation differs."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from kernels import reference as fp8_ref
from models import ModelConfig, build
from models.moe import LocalDispatcher, MoE
from parallel.data_parallel import sync_gradients
from parallel.dims import ParallelDims
from parallel.ep import AllToAllDispatcher, HierarchicalDispatcher, apply_ep
from parallel.ep import comm

from .dist_utils import grads_with_reference, rel_err, spawn

TOL = 1e-5
D = 128


class _QDQ(torch.autograd.Function):
    """Quantise-dequantise rows (1x128 tiles, pow2 scales); straight-through backward."""

    @staticmethod
    def forward(ctx, x):
        return fp8_ref.dequant(*fp8_ref.quant_act(x, pow2=True)).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g


class QDQDispatcher(LocalDispatcher):
    def dispatch(self, x_TD, topk_idx_TK, topk_weight_TK):
        return super().dispatch(_QDQ.apply(x_TD), topk_idx_TK, topk_weight_TK)


class Layer(nn.Module):   # a one-MoE "model" for apply_ep (dispatcher name "ffn")
    def __init__(self, cfg):
        super().__init__()
        self.ffn = MoE(cfg)


def moe_cfg(ep_nodes: int) -> ModelConfig:
    return ModelConfig(dim=D, moe_inter_dim=16, n_routed_experts=8, n_activated_experts=2, n_shared_experts=1,
                       n_expert_groups=ep_nodes, n_limited_groups=1 if ep_nodes <= 2 else 2)


class WireLog:
    """Within ``with``: (phase, dtype, shape) of every ``all_to_all_single`` input; phase "dispatch" / "combine"
    inside ``disp``'s forward calls and their launches, "other" elsewhere (the backward)."""

    def __init__(self, disp):
        self.disp, self.calls, self.phase = disp, [], "other"

    def __enter__(self):
        self._orig = orig = dist.all_to_all_single

        def record(output, input, *args, **kwargs):
            self.calls.append((self.phase, input.dtype, tuple(input.shape)))
            return orig(output, input, *args, **kwargs)
        dist.all_to_all_single = record
        flat = isinstance(self.disp, AllToAllDispatcher)
        self.hooked = ("start",) if flat else ("_dispatch", "_combine")
        for attr in self.hooked:
            def wrapped(*a, _fn=getattr(self.disp, attr), _attr=attr, **kw):
                phase = a[2] if flat else _attr[1:]   # start(rows, plan, direction)
                self.phase = phase if phase in ("dispatch", "combine") else "other"
                try:
                    return _fn(*a, **kw)
                finally:
                    self.phase = "other"
            setattr(self.disp, attr, wrapped)
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._orig
        for attr in self.hooked:
            delattr(self.disp, attr)

    def of(self, phase):
        return [(dt, shape) for p, dt, shape in self.calls if p == phase]


def check_wire(log, disp, hops: int, act_dtype):
    """Dispatch: token rows only as uint8 [n, D] + fp32 [n, D/128], one pair per hop; combine in act_dtype."""
    sent = log.of("dispatch")
    assert not [c for c in sent if c[1][-1:] == (D,) and c[0] != torch.uint8], f"full-precision rows sent: {sent}"
    pairs = [(a, b) for a, b in zip(sent, sent[1:]) if a[0] == torch.uint8]
    assert len(pairs) == hops, sent
    for (dt_q, shape_q), (dt_s, shape_s) in pairs:
        assert shape_q[1:] == (D,) and dt_s == torch.float32 and shape_s == (shape_q[0], D // 128), (shape_q, shape_s)
    assert disp.stats.dispatch_bytes == sum(q[0] * (D + 4 * D // 128) for (_, q), _ in pairs)
    rows = [c for c in log.of("combine") if c[1][-1:] == (D,)]
    assert rows and all(dt == act_dtype for dt, _ in rows), rows
    assert disp.stats.combine_bytes == sum(s[0] * D * act_dtype.itemsize for _, s in rows)


def _worker(rank, world, ep, rpn, dispatcher):
    dims = ParallelDims(world_size=world, rank=rank, ep=ep, ranks_per_node=rpn).build_groups()
    cfg = moe_cfg(dims.ep_nodes)
    dims.check_model(cfg)
    torch.manual_seed(0)
    ref = Layer(cfg)
    ref.ffn.init_weights(0.2)
    ep_model = apply_ep(copy.deepcopy(ref), dims, dispatcher=dispatcher, fp8_dispatch=True)
    plain = copy.deepcopy(ref.ffn)                      # unquantised single-device layer, for a sanity check
    ref.ffn.dispatcher = QDQDispatcher(cfg.n_routed_experts)
    moe_ref, moe_ep = ref.ffn, ep_model.ffn
    disp = moe_ep.dispatcher
    two_hop = isinstance(disp, HierarchicalDispatcher)
    assert disp.fp8 and (two_hop or isinstance(disp, AllToAllDispatcher))

    B = 2
    gen = torch.Generator().manual_seed(2)
    # Per-token magnitudes spanning a few binades, so the tiles get different power-of-2 scales.
    x = torch.randn(B * dims.dp, 9, D, generator=gen) * torch.exp2(torch.randint(-3, 4, (B * dims.dp, 9, 1),
                                                                                  generator=gen).float())
    g = torch.randn(x.shape, generator=gen)
    mine = slice(dims.dp_rank * B, (dims.dp_rank + 1) * B)
    x_ref, x_ep = x.clone().requires_grad_(True), x[mine].clone().requires_grad_(True)

    y_ref = moe_ref(x_ref)
    (y_ref * g).sum().div(dims.dp).backward()

    quant_calls = []
    orig_quant = comm.quant_rows
    comm.quant_rows = lambda *a, **k: quant_calls.append(1) or orig_quant(*a, **k)
    try:
        with WireLog(disp) as log:
            y = moe_ep(x_ep)
            (y * g[mine]).sum().backward()
    finally:
        comm.quant_rows = orig_quant

    # Forward: exactly the quantised reference; and the quantisation is really there.
    assert rel_err(y, y_ref[mine]) <= TOL, f"fp8 moe output rel err {rel_err(y, y_ref[mine]):.2e}"
    assert rel_err(y, plain(x[mine])) > 1e-4
    # Backward: straight-through gradients for x, experts, gate and shared experts.
    assert rel_err(x_ep.grad, x_ref.grad[mine] * dims.dp) <= TOL, rel_err(x_ep.grad, x_ref.grad[mine] * dims.dp)
    sync_gradients(moe_ep, dims)
    for name, g, g_ref in grads_with_reference(moe_ep, moe_ref, dims):
        assert rel_err(g, g_ref) <= TOL, f"grad {name} rel err {rel_err(g, g_ref):.2e}"

    # The wire: FP8 bytes + scales out, activation dtype back; quantised once (before the inter-node hop).
    assert len(quant_calls) == 1, quant_calls
    check_wire(log, disp, 2 if two_hop else 1, torch.float32)
    sent_rows = [shape[0] for dt, shape in log.of("dispatch") if dt == torch.uint8]
    idx = moe_ep.gate(x[mine].reshape(-1, D))[0]
    T, K = idx.shape
    if two_hop:   # hop 1: one row per (token, target node); hop 2: one per (token, expert), over all ranks
        assert sent_rows[0] == len({(t, n) for t in range(T) for n in (idx[t] // disp.per_node).tolist()})
        totals = torch.tensor([sent_rows[1], T * K])
        dist.all_reduce(totals)
        assert totals[0] == totals[1], totals
    else:
        assert sent_rows == [T * K]
    # Backward all-to-alls carry the gradient unquantised, in its own dtype.
    back = [c for c in log.of("other") if c[1][-1:] == (D,)]
    assert back and all(dt == torch.float32 for dt, _ in back), back

    # BF16 activations: dispatched rows arrive as BF16, the combine sends BF16, the dispatch still sends FP8.
    disp.stats.reset()
    moe16 = moe_ep.to(torch.bfloat16)
    seen = []
    moe16.experts.register_forward_pre_hook(lambda m, a: seen.append(a[0].dtype))
    with WireLog(disp) as log, torch.no_grad():
        y16 = moe16(x[mine].bfloat16())
    assert y16.dtype == torch.bfloat16 and seen == [torch.bfloat16]
    check_wire(log, disp, 2 if two_hop else 1, torch.bfloat16)


LAYOUTS = [  # world, ep, ranks_per_node, dispatcher
    (2, 2, 1, "hierarchical"),   # 2 nodes of 1 rank: inter hop + a self intra hop
    (2, 2, 2, "hierarchical"),   # one node: flat all-to-all
    (4, 4, 2, "hierarchical"),   # 2 nodes x 2 ranks: FP8 bytes forwarded through the intra-node hop
    (4, 4, 2, "alltoall"),
]


@pytest.mark.parametrize("world,ep,rpn,dispatcher", LAYOUTS)
def test_fp8_dispatch_matches_quantised_reference(tmp_path, world, ep, rpn, dispatcher):
    spawn(_worker, world, tmp_path, ep, rpn, dispatcher)


def _sync_async_worker(rank, world):
    """``all_to_all_fp8`` without and with ``pending`` gives the quantise-dequantised rows of the sender."""
    torch.manual_seed(rank)
    rows = [3, 0] if rank == 0 else [2, 4]          # rows this rank sends to rank 0 / 1 (one empty split)
    x = torch.randn(sum(rows), 2 * D) * (rank + 1)
    counts = comm.exchange_counts(torch.tensor(rows), dist.group.WORLD).tolist()
    sync = comm.all_to_all_fp8(x, counts, rows, dist.group.WORLD)
    pending = comm.Pending()
    late = comm.all_to_all_fp8(x, counts, rows, dist.group.WORLD, pending=pending)
    pending.wait()
    assert torch.equal(sync, late)
    everyone = [None] * world
    dist.all_gather_object(everyone, x)
    mine = torch.cat([everyone[0][:3], everyone[1][:2]] if rank == 0 else [everyone[0][3:], everyone[1][2:]])
    want = fp8_ref.dequant(*fp8_ref.quant_act(mine, pow2=True))
    assert torch.equal(sync, want)


def test_all_to_all_fp8_sync_and_async(tmp_path):
    spawn(_sync_async_worker, 2, tmp_path)


def test_dim_not_multiple_of_128_rejected():
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, first_k_dense=1, inter_dim=32, n_heads=2, q_lora_rank=16,
                      kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, moe_inter_dim=16,
                      n_routed_experts=4, n_activated_experts=2, n_expert_groups=2, n_limited_groups=1)
    for dims in (ParallelDims(world_size=2, rank=0, ep=2), ParallelDims(world_size=1)):
        with pytest.raises(ValueError, match=r"model\.dim.*multiple of 128.*model\.dim=32"):
            apply_ep(build(cfg, seed=0), dims, fp8_dispatch=True)
    with pytest.raises(ValueError, match=r"model\.dim"):
        comm.quant_rows(torch.zeros(2, 32))
