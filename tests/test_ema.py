"""Parameter EMA (train.ema_decay, trainer/ema.py): the values, off the critical path, in checkpoints (resume
and resharding), and exported with ``convert_hf export --ema``."""
import pytest
import torch
from safetensors.torch import load_file

from tools.convert_hf import load_model_checkpoint
from tools.convert_hf import main as convert_main
from trainer.ema import ParamEMA
from trainer.train import Trainer

from .test_trainer import SMALL, cache  # noqa: F401 - the same small run and data-cache fixture
from .trainer_utils import fast_overrides, make_config, run_torchrun

DECAY = 0.5


def test_ema_values_match_the_formula():
    model = torch.nn.Linear(4, 3)
    ema = ParamEMA(model, 0.9)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    for k in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update()
        for n, p in model.named_parameters():
            want[n] = 0.9 * want[n] + 0.1 * p.detach()
    got = ema.state_dict()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-6)
    ema.close()


def _trainer(tmp_path, cache, name, *overrides):   # noqa: F811 - cache is the fixture
    cfg = make_config(*fast_overrides(tmp_path, cache), *SMALL, f"train.ema_decay={DECAY}", *overrides)
    return Trainer(cfg, tmp_path / name)


def test_trainer_ema_follows_every_update_and_resumes_bitwise(tmp_path, cache):  # noqa: F811
    tr = _trainer(tmp_path, cache, "a", "train.max_steps=4", f"checkpoint.dir={tmp_path}/ck_a")
    want = {n: p.detach().clone().float() for n, p in tr.model.named_parameters()}
    for _ in range(4):   # step by step: the EMA of the weights after each optimizer step
        tr.train_step()
        for n, p in tr.model.named_parameters():
            want[n] = DECAY * want[n] + (1 - DECAY) * p.detach().float()
    got = tr.ema.state_dict()
    assert max((got[n] - want[n]).abs().max().item() for n in want) < 1e-6
    assert any((got[n] - dict(tr.model.named_parameters())[n]).abs().max() > 1e-4 for n in want)   # not the weights

    straight = _trainer(tmp_path, cache, "s", "train.max_steps=6", f"checkpoint.dir={tmp_path}/ck_s")
    straight.train()
    first = _trainer(tmp_path, cache, "r", "train.max_steps=6", "train.stop_at_step=3", f"checkpoint.dir={tmp_path}/ck_r")
    first.train()
    resumed = _trainer(tmp_path, cache, "r", "train.max_steps=6", f"checkpoint.dir={tmp_path}/ck_r")
    assert resumed.resumed_from is not None and resumed.step == 3
    resumed.train()
    for n, t in straight.ema.state_dict().items():
        assert torch.equal(resumed.ema.state_dict()[n], t), n

    # export --ema writes the EMA (here fp32, as saved), plain export the weights
    step = tmp_path / "ck_s/step_00000006"
    assert convert_main(["export", str(step), str(tmp_path / "hf_ema"), "--ema"]) == 0
    exported = {}
    for f in (tmp_path / "hf_ema").glob("*.safetensors"):
        exported.update(load_file(f))
    ema_model = load_model_checkpoint(step, ema=True)
    assert torch.equal(ema_model.embed.weight, straight.ema.state_dict()["embed.weight"])
    assert torch.equal(exported["model.embed_tokens.weight"], straight.ema.state_dict()["embed.weight"])
    assert not torch.equal(load_model_checkpoint(step).embed.weight, ema_model.embed.weight)


def test_resume_without_a_saved_ema_starts_it_from_the_weights(tmp_path, cache):  # noqa: F811
    cfg = make_config(*fast_overrides(tmp_path, cache), *SMALL, "train.max_steps=2", f"checkpoint.dir={tmp_path}/ck")
    Trainer(cfg, tmp_path / "run").train()
    tr = _trainer(tmp_path, cache, "run", "train.max_steps=3", f"checkpoint.dir={tmp_path}/ck")
    assert tr.step == 2
    for n, p in tr.model.named_parameters():
        assert torch.equal(tr.ema.state_dict()[n], p.detach().float()), n
    assert convert_main(["export", str(tmp_path / "ck/step_00000002"), str(tmp_path / "hf"), "--ema"]) == 2


@pytest.mark.slow
def test_ema_reshards_from_ep2_to_one_process(tmp_path):
    """Trained under EP=2 (torchrun, each rank holds half the experts' EMA), exported in one process: the
    same EMA as a one-process run (up to the reduction order of the gradients)."""
    common = [*SMALL, f"train.ema_decay={DECAY}", "train.max_steps=3"]
    run_torchrun(tmp_path, "one", 1, *common, f"checkpoint.dir={tmp_path}/ck1", steps=3)
    run_torchrun(tmp_path, "ep2", 2, *common, "parallel.ep=2", f"checkpoint.dir={tmp_path}/ck2", steps=3)
    a = load_model_checkpoint(tmp_path / "ck1/step_00000003", ema=True).state_dict()
    b = load_model_checkpoint(tmp_path / "ck2/step_00000003", ema=True).state_dict()
    assert any(".experts." in k for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
