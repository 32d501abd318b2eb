"""The gate and up projections as one parameter, ``w13``. Checkpoints written before it (they hold ``w1`` and ``w3``)
load into today's model: ``parallel.state_dict.stacked_from_older`` names each stacked tensor's halves by the older
names for the load, as views, so DCP fills the stacked tensor in place (``trainer.run_state.load_into``)."""
import types

import pytest
import torch
from torch.distributed.tensor import DTensor

import models
from checkpoint import CheckpointManager, state_keys
from configs import model_preset
from parallel.state_dict import STACKED, _half, stacked_from_older
from trainer.run_state import load_into


def _older(sd: dict) -> dict:
    """``sd`` as a checkpoint from before ``w13``: each stacked tensor as its two halves under the older names."""
    out = {}
    for k, v in sd.items():
        parts = k.split(".")
        if "w13" in parts:
            i = parts.index("w13")
            for j, old in enumerate(STACKED["w13"]):
                out[".".join(parts[:i] + [old] + parts[i + 1:])] = v.chunk(2, dim=-2)[j].clone()
        else:
            out[k] = v.clone()
    return out


def test_an_older_checkpoint_loads_into_the_stacked_parameters(tmp_path):
    model = models.build(model_preset("tiny"), seed=0)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    stacked = [k for k in sd if ".w13" in k]
    assert any(".experts.w13" in k for k in stacked) and any(".w13.weight" in k for k in stacked)
    name = stacked[0]
    older_optim = {"state": {n.replace("w13", o): {"step": torch.tensor(7.0), "exp_avg": t.clone() + 1}
                             for n in (name,) for o, t in zip(STACKED["w13"], sd[n].chunk(2, dim=-2))}}
    ckpt = CheckpointManager(tmp_path / "ck")
    path = ckpt.save(3, {"model": _older(sd), "optim": older_optim})
    assert not any("w13" in k for k in state_keys(path))

    fresh = models.build(model_preset("tiny"), seed=1)
    state = {"model": {k: v.detach() for k, v in fresh.state_dict().items()},
             "optim": {"state": {name: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(sd[name])}}}}
    keys = {k: set(v) for k, v in state.items()}
    load_into(types.SimpleNamespace(ckpt=ckpt), path, state)
    assert {k: set(v) for k, v in state.items()} == keys           # its own names again
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, sd[k]), k                             # the model's own tensors, filled in place
    got = state["optim"]["state"][name]
    assert float(got["step"]) == 7.0 and torch.equal(got["exp_avg"], sd[name] + 1)


def test_a_checkpoint_of_today_is_left_alone():
    t = torch.zeros(4, 3)
    state = {"model": {"ffn.w13.weight": t}}
    with stacked_from_older(state, {"model.ffn.w13.weight"}):
        assert state["model"] == {"ffn.w13.weight": t}
    with stacked_from_older(state, {"model.ffn.w1.weight"}):     # only one of the two older names: not this case
        assert set(state["model"]) == {"ffn.w13.weight"}


def test_a_layout_that_shards_the_stacking_dimension_is_named():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        dt = DTensor.from_local(torch.zeros(4, 3), mesh, [Shard(0)], run_check=False)
        with pytest.raises(ValueError, match=r"optim.state.ffn.w13.weight: the checkpoint holds it as two tensors"):
            _half(dt, 0, "optim.state.ffn.w13.weight")
        experts = DTensor.from_local(torch.arange(24.0).view(2, 4, 3), mesh, [Shard(0)], run_check=False)
        up = _half(experts, 1, "model.experts.w13")
        assert up.shape == (2, 2, 3) and torch.equal(up.to_local(), experts.to_local()[:, 2:])
        up.to_local().fill_(-1)                                    # a view: writes reach the stacked tensor
        assert (experts.to_local()[:, 2:] == -1).all()
    finally:
        dist.destroy_process_group()


def test_a_seed_draws_the_values_of_the_separate_weights():
    """``init_gate_down_up_``: the gate half, the down weight and the up half as three contiguous draws in that order
    (the order and shapes of w1, w2, w3 before they were stacked), so a seed initialises what it did then."""
    from models.layers import init_gate_down_up_
    E, F, D = 3, 16, 24
    w13, w2 = torch.empty(E, 2 * F, D), torch.empty(E, D, F)
    torch.manual_seed(5)
    init_gate_down_up_(w13, w2, 0.02)
    torch.manual_seed(5)
    want = [torch.empty(s).normal_(std=0.02) for s in ((E, F, D), (E, D, F), (E, F, D))]
    assert torch.equal(w13[:, :F], want[0]) and torch.equal(w2, want[1]) and torch.equal(w13[:, F:], want[2])
