"""The config key set is a public contract: a snapshot makes every new or renamed knob a reviewed change."""
from pathlib import Path

from omegaconf import OmegaConf

from configs.schema import Config, Piecewise

from .trainer_utils import make_config

SNAPSHOT = Path(__file__).parent / "assets" / "config_keys.txt"


def flat_keys(node, prefix=""):
    for key, value in node.items():
        path = f"{prefix}{key}"
        if OmegaConf.is_dict(value):
            yield from flat_keys(value, path + ".")
        else:
            yield path


def test_config_keys_match_snapshot():
    keys = sorted(flat_keys(OmegaConf.structured(Config)))
    assert keys == SNAPSHOT.read_text().split(), (
        "config keys changed; if intended, regenerate tests/assets/config_keys.txt and update README's key table")


def test_public_contract_keys_exist():
    keys = set(SNAPSHOT.read_text().split())
    contract = {"train.max_steps", "train.seed", "train.global_batch_size", "train.micro_batch_size",
                "train.precision", "train.device", "data.seq_len", "data.path", "data.tokenizer",
                "logging.wandb.mode", "checkpoint.dir", "checkpoint.every", "checkpoint.resume", "parallel.pp",
                "parallel.ep", "parallel.schedule", "parallel.ranks_per_node", "parallel.zero"}
    assert contract <= keys


def test_parallel_defaults():
    p = make_config().parallel
    assert (p.pp, p.ep, p.schedule, p.ranks_per_node, p.zero) == (1, 1, "none", 1, 0)


def test_piecewise_switches_by_steps_or_tokens():
    gamma = Piecewise(value=0.001, then=0.0, after_tokens=1000)
    assert gamma.at(step=5, tokens=999) == 0.001 and gamma.at(step=5, tokens=1000) == 0.0
    lam = Piecewise(value=0.3, then=0.1, after_steps=10)
    assert lam.at(9, 10**9) == 0.3 and lam.at(10, 0) == 0.1
    assert Piecewise(value=0.3).at(10**6, 10**15) == 0.3


def test_experiment_overrides_compose():
    cfg = make_config("model=v3_small")
    assert cfg.model.n_routed_experts == 64 and cfg.train.max_steps == 150  # exp=tiny train values kept
