"""Stacked weights: the gate and up projections as one parameter, ``w13`` (MLPs and routed experts), and the two
projections of the attention's input as one, ``wqkv_a``. Checkpoints written before them (``w1``/``w3``,
``wq_a``/``wq`` and ``wkv_a``) load into today's model: ``parallel.state_dict.stacked_from_older`` names each stacked
tensor's parts by the older names for the load, as views of as many rows as the checkpoint's tensors have, so DCP
fills the stacked tensor in place (``trainer.run_state.load_into``). A seed initialises the values it did before."""
import dataclasses
import types

import pytest
import torch
from torch.distributed.tensor import DTensor

import models
from checkpoint import CheckpointManager, state_keys
from configs import model_preset
from parallel.state_dict import _part, stacked_from_older
from trainer.run_state import load_into


def _older(sd: dict, cfg) -> dict:
    """``sd`` as a checkpoint from before the stacking: each stacked tensor's parts under the older names."""
    q_rows = cfg.q_rows
    out = {}
    for k, v in sd.items():
        if ".w13" in k:
            out |= {k.replace("w13", o): t.clone() for o, t in zip(("w1", "w3"), v.chunk(2, dim=-2))}
        elif ".wqkv_a" in k:
            q = "wq_a" if cfg.q_lora_rank else "wq"
            out |= {k.replace("wqkv_a", o): t.clone()
                    for o, t in zip((q, "wkv_a"), v.split([q_rows, v.shape[-2] - q_rows], dim=-2))}
        else:
            out[k] = v.clone()
    return out


@pytest.mark.parametrize("q_lora", [True, False])
def test_an_older_checkpoint_loads_into_the_stacked_parameters(tmp_path, q_lora):
    cfg = model_preset("tiny")
    cfg = cfg if q_lora else dataclasses.replace(cfg, q_lora_rank=0)
    sd = {k: v.detach() for k, v in models.build(cfg, seed=0).state_dict().items()}
    stacked = [k for k in sd if ".w13" in k or ".wqkv_a" in k]
    assert all(any(s in k for k in stacked) for s in (".experts.w13", ".w13.weight", ".wqkv_a.weight"))
    names = [next(k for k in stacked if ".wqkv_a" in k), next(k for k in stacked if ".experts.w13" in k)]
    older = _older({n: sd[n] + 1 for n in names}, cfg)                   # moments: the weights + 1, cut alike
    older_optim = {"state": {k: {"step": torch.tensor(7.0), "exp_avg": t} for k, t in older.items()}}
    ckpt = CheckpointManager(tmp_path / "ck")
    path = ckpt.save(3, {"model": _older(sd, cfg), "optim": older_optim})
    saved = state_keys(path)
    assert not any(".w13" in k or ".wqkv_a" in k for k in saved)
    assert any(k.endswith(".wq_a.weight") for k in saved) == q_lora

    fresh = models.build(cfg, seed=1)
    state = {"model": {k: v.detach() for k, v in fresh.state_dict().items()},
             "optim": {"state": {n: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(sd[n])} for n in names}}}
    keys = {k: set(v) for k, v in state.items()}
    load_into(types.SimpleNamespace(ckpt=ckpt), path, state)
    assert {k: set(v) for k, v in state.items()} == keys           # its own names again
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, sd[k]), k                             # the model's own tensors, filled in place
    for n in names:
        got = state["optim"]["state"][n]
        assert float(got["step"]) == 7.0 and torch.equal(got["exp_avg"], sd[n] + 1), n


def test_a_checkpoint_of_today_is_left_alone():
    t = torch.zeros(4, 3)
    state = {"model": {"ffn.w13.weight": t}}
    with stacked_from_older(state, {"model.ffn.w13.weight": (4, 3)}):
        assert state["model"] == {"ffn.w13.weight": t}
    with stacked_from_older(state, {"model.ffn.w1.weight": (2, 3)}):   # only one of the older names: not this case
        assert set(state["model"]) == {"ffn.w13.weight"}


def test_a_layout_that_shards_the_stacking_dimension_is_named():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        dt = DTensor.from_local(torch.zeros(4, 3), mesh, [Shard(0)], run_check=False)
        with pytest.raises(ValueError, match=r"optim.state.ffn.w13.weight: the checkpoint holds it as separate"):
            _part(dt, 0, 2, "optim.state.ffn.w13.weight")
        experts = DTensor.from_local(torch.arange(24.0).view(2, 4, 3), mesh, [Shard(0)], run_check=False)
        up = _part(experts, 1, 3, "model.experts.w13")
        assert up.shape == (2, 3, 3) and torch.equal(up.to_local(), experts.to_local()[:, 1:])
        up.to_local().fill_(-1)                                    # a view: writes reach the stacked tensor
        assert (experts.to_local()[:, 1:] == -1).all()
    finally:
        dist.destroy_process_group()


def test_a_seed_draws_the_values_of_the_separate_weights():
    """``GroupedExperts.init_weights``: the gate half, the down weight and the up half as three contiguous draws in
    that order (the order and shapes of w1, w2, w3 before they were stacked), so a seed initialises what it did
    then (``normal_in_order_``); ``MLA.init_weights`` likewise: the query rows, wq_b, the key/value rows, wkv_b,
    wo."""
    from models.attention import MLA
    from models.moe import GroupedExperts
    E, F, D = 3, 16, 24
    experts = GroupedExperts(E, D, F)
    torch.manual_seed(5)
    experts.init_weights(0.02)
    torch.manual_seed(5)
    want = [torch.empty(s).normal_(std=0.02) for s in ((E, F, D), (E, D, F), (E, F, D))]
    w13, w2 = experts.w13.detach(), experts.w2.detach()
    assert torch.equal(w13[:, :F], want[0]) and torch.equal(w2, want[1]) and torch.equal(w13[:, F:], want[2])
    cfg = model_preset("tiny")
    attn = MLA(cfg)
    torch.manual_seed(6)
    attn.init_weights(0.02)
    q, kv = attn.wqkv_a.weight.detach().split([cfg.q_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim])
    torch.manual_seed(6)
    for got in (q, attn.wq_b.weight, kv, attn.wkv_b.weight, attn.wo.weight):
        assert torch.equal(got, torch.empty(got.shape).normal_(std=0.02))
