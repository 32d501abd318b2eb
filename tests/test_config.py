"""The config key set is a public contract: a snapshot makes every new or renamed knob a reviewed change.
Every key's range is checked before anything is built, with one line naming the key."""
import copy
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from configs.schema import BatchRamp, BlendSource, Config, LRPhase, Piecewise, check_key, validate
from errors import ConfigError

from .trainer_utils import ROOT, make_config, run_cli

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


# ------------------------------------------------------------------------------------------- validation
NAN, INF = math.nan, math.inf


@pytest.fixture(scope="module")
def tiny():
    return make_config()


def _with(cfg, **values):
    """A copy of ``cfg`` with dotted keys set (``optim__eps=0`` sets optim.eps)."""
    cfg = copy.deepcopy(cfg)
    for dotted, value in values.items():
        *path, last = dotted.split("__")
        node = cfg
        for part in path:
            node = getattr(node, part)
        setattr(node, last, value)
    return cfg


BAD = [  # (key, value, extra keys to set) -> validate() must name key
    ("optim.lr", 0.0), ("optim.lr", -1e-3), ("optim.lr", NAN), ("optim.lr", INF),
    ("optim.min_lr", -1e-5), ("optim.min_lr", NAN), ("optim.min_lr", 1.0),          # 1.0 > lr
    ("optim.warmup_steps", -1),
    ("optim.beta1", 1.5), ("optim.beta1", 1.0), ("optim.beta1", -0.1), ("optim.beta1", NAN),
    ("optim.beta2", 1.0), ("optim.beta2", -0.5),
    ("optim.eps", 0.0), ("optim.eps", -1e-8), ("optim.eps", NAN),
    ("optim.weight_decay", -0.1), ("optim.weight_decay", INF),
    ("optim.grad_clip", -1.0), ("optim.grad_clip", NAN),
    ("train.bias_update_speed.value", -0.001), ("train.bias_update_speed.value", NAN),
    ("train.bias_update_speed.then", -1.0, {"train.bias_update_speed.after_steps": 5}),
    ("train.bias_update_speed.then", 0.0),                                  # no after_steps / after_tokens
    ("train.bias_update_speed.then", None, {"train.bias_update_speed.after_tokens": 10}),   # switch to nothing
    ("train.bias_update_speed.after_steps", -1, {"train.bias_update_speed.then": 0.0}),
    ("train.mtp_loss_weight.value", -0.3), ("train.mtp_loss_weight.value", INF),
    ("train.mtp_loss_weight.then", NAN, {"train.mtp_loss_weight.after_steps": 5}),
    ("train.mtp_loss_weight.after_tokens", -5, {"train.mtp_loss_weight.then": 0.1}),
    ("train.aux_loss_alpha", -1e-4),
    ("train.eval_every", -1), ("train.eval_batches", -1),
    ("train.max_skipped_steps", 0), ("train.max_skipped_steps", -3),
    ("train.max_steps", 0), ("train.stop_at_step", 0), ("train.seed", -1), ("train.seed", 2**63),
    ("parallel.timeout_s", 0), ("parallel.timeout_s", -5),
    ("parallel.zero_bucket_mb", NAN),
    ("parallel.pp_layout", [2, 2]),                                           # pp = 1
    ("parallel.pp_layout", [3, 0], {"parallel.pp": 2, "parallel.schedule": "1f1b"}),   # 3 != n_layers 4
    ("parallel.schedule", "zb2p"),
    ("checkpoint.every", -1), ("checkpoint.keep", -1),
    ("data.val_fraction", 1.0), ("data.val_fraction", -0.1), ("data.val_fraction", NAN),
    ("data.seq_len", 1),
    ("model.norm_eps", 0.0), ("model.init_std", -0.02), ("model.rope_theta", 0.0), ("model.route_scale", NAN),
    ("model.rope_factor", NAN),
    ("optim.phases", [], {"optim.decay": "phases"}), ("optim.phases", [LRPhase(tokens=100, lr=1e-3)]),   # decay=cosine
    ("train.batch_ramp.start", 16), ("train.batch_ramp.start", 0), ("train.batch_ramp.start", None,
                                                                    {"train.batch_ramp.tokens": 100.0}),
    ("train.batch_ramp.increment", 5, {"train.batch_ramp.start": 4, "train.batch_ramp.tokens": 100.0}),
    ("train.batch_ramp.tokens", 0.0, {"train.batch_ramp.start": 4}),
    ("train.batch_ramp", BatchRamp(start=3, increment=13, tokens=100.0)),    # 3 sequences, micro-batches of 2
    ("data.val_blend", [BlendSource(path="/data/val")]),                    # without data.blend
    ("data.path", "/data/corpus.jsonl", {"data.blend": [BlendSource(path="/data/tokens")]}),
    ("data.blend", [BlendSource(path="/a/x"), BlendSource(path="/b/x")]),   # two sources named x
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: f"{c[0]}={c[1]}")
def test_bad_values_fail_validation_naming_the_key(tiny, case):
    key, value, *extra = case
    values = {k.replace(".", "__"): v for k, v in (extra[0] if extra else {}).items()}
    cfg = _with(tiny, **values, **{key.replace(".", "__"): value})
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=cfg.parallel.pp)
    msg = str(e.value)
    assert msg.startswith(key + ": ") and "\n" not in msg, msg


@pytest.mark.parametrize("values", [
    {"optim__eps": 1e-30, "optim__beta1": 0.0, "optim__beta2": 0.0, "optim__weight_decay": 0.0,
     "optim__grad_clip": 0.0, "optim__warmup_steps": 0, "optim__min_lr": 0.0},
    {"optim__min_lr": 3e-3},                                                 # = lr
    {"train__bias_update_speed__value": 0.0, "train__bias_update_speed__then": 0.0,
     "train__bias_update_speed__after_tokens": 0, "train__mtp_loss_weight__value": 0.0, "train__aux_loss_alpha": 0.0},
    {"train__eval_every": 0, "train__eval_batches": 0, "train__max_skipped_steps": 1, "checkpoint__every": 0,
     "checkpoint__keep": 0, "data__val_fraction": 0.0, "train__seed": 2**63 - 1},
    {"parallel__timeout_s": 1},
    {"parallel__pp_layout": [1, 3]},
], ids=["optim-edges", "min_lr-eq-lr", "piecewise-zero", "zero-edges", "parallel-edges", "pp_layout"])
def test_edge_values_are_accepted(tiny, values):
    pp = {"parallel__pp": 2, "parallel__schedule": "1f1b"} if "parallel__pp_layout" in values else {}
    validate(_with(tiny, **values, **pp), world_size=2 if pp else 1)


def test_zb1p_is_a_schedule(tiny):
    cfg = validate(_with(tiny, parallel__pp=2, parallel__schedule="zb1p"), world_size=2)
    assert cfg.parallel.schedule == "zb1p"
    with pytest.raises(ConfigError, match=r"^parallel\.schedule=zb1p with 1 micro-batches"):   # needs n >= pp
        validate(_with(tiny, parallel__pp=2, parallel__schedule="zb1p", train__global_batch_size=8,
                       train__micro_batch_size=8), world_size=2)


def test_phase_and_blend_entries_are_named_by_index(tiny):
    with pytest.raises(ConfigError, match=r"^optim\.phases\[1\]\.shape: 'step' is not one of constant"):
        validate(_with(tiny, optim__decay="phases", optim__phases=[LRPhase(tokens=10, lr=1e-3),
                                                                   LRPhase(tokens=10, lr=0, shape="step")]))
    with pytest.raises(ConfigError, match=r"^data\.blend\[1\]\.weight: must be finite and > 0, got 0"):
        validate(_with(tiny, data__blend=[BlendSource(path="/a"), BlendSource(path="/b", weight=0.0)]))


def test_every_ramp_size_must_fit_the_pipeline(tiny):
    """DualPipe pp=2 needs an even number >= 4 of micro-batches: the ramp's first size (4 sequences in
    micro-batches of 2) gives 2."""
    cfg = _with(tiny, parallel__pp=2, parallel__schedule="dualpipe", train__batch_ramp=BatchRamp(4, 4, 1000.0))
    with pytest.raises(ConfigError, match=r"^parallel\.schedule=dualpipe with 2 micro-batches per step "
                                          r"\(train\.batch_ramp step 4 "):
        validate(cfg, world_size=2)
    validate(_with(cfg, train__micro_batch_size=1), world_size=2)


def test_max_skipped_steps_default():
    assert Config().train.max_skipped_steps == 3 and make_config().train.max_skipped_steps == 3


@pytest.mark.parametrize("override,key", [
    ("optim.eps=0", "optim.eps"),
    ("optim.lr=nan", "optim.lr"),
    ("train.bias_update_speed.value=-1", "train.bias_update_speed.value"),
    ("train.max_skipped_steps=0", "train.max_skipped_steps"),
])
def test_cli_prints_one_line_and_exits_2(tmp_path, override, key):
    proc = run_cli("+exp=tiny", override, f"hydra.run.dir={tmp_path}/run", "logging.wandb.mode=disabled", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {key}: "), proc.stderr
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").glob("metrics.jsonl"))


# ------------------------------------------------------------------------------------------- strict keys
UNKNOWN = [  # (override, the one-line error)
    ("+train.max_step=3", "train.max_step: not a config key; did you mean train.max_steps?"),
    ("+optim.betaa=0.9", "optim.betaa: not a config key; did you mean optim.beta1 or optim.beta2?"),
    ("+train.bias_update_speed.valu=0", "train.bias_update_speed.valu: not a config key; did you mean "
                                       "train.bias_update_speed.value?"),
    ("+data.foo=1", "data.foo: not a config key; the keys under data are path, tokenizer, seq_len, text_field, "
                    "val_fraction, cache_dir, blend, val_blend, on_bad_document"),
    ("+modle.dim=64", "modle: not a config key; did you mean model?"),
]


@pytest.mark.parametrize("override,message", UNKNOWN, ids=[u[0] for u in UNKNOWN])
def test_unknown_keys_added_with_plus_are_errors(override, message):
    """Hydra's ``+`` adds any key: a misspelt one must not be dropped in silence."""
    with pytest.raises(ConfigError) as e:
        make_config(override)
    assert str(e.value) == message


def test_keys_inside_list_values_are_checked():
    with pytest.raises(ConfigError, match=r"^optim\.phases\[0\]\.shap: not a config key; did you mean "
                                          r"optim\.phases\[0\]\.shape\?$"):
        check_key("optim.phases", [{"tokens": 1e9, "lr": 1e-4, "shap": "cosine"}])
    with pytest.raises(ConfigError, match=r"^data\.blend\[1\]\.wieght: not a config key; did you mean"):
        check_key("data.blend", [{"path": "/a"}, {"path": "/b", "wieght": 2}])
    with pytest.raises(ConfigError, match=r"^data\.blend\.x: not a config key; data\.blend is a list"):
        check_key("data.blend.x")
    with pytest.raises(ConfigError, match=r"^train\.max_steps\.x: not a config key; train\.max_steps is a single"):
        check_key("train.max_steps.x")
    check_key("optim.phases.0.lr")
    check_key("data.blend", [{"path": "/a", "weight": 2.0, "name": "a"}])


def test_keys_legitimately_added_with_plus_still_work():
    """Config groups (``+schedule=v3``) and list fields of the schema (``+optim.phases``)."""
    assert make_config("+optim.phases=[{tokens: 1e6, lr: 1e-4}]", "optim.decay=phases").optim.phases == \
        [LRPhase(tokens=1e6, lr=1e-4)]
    from hydra import compose, initialize_config_module

    from configs.schema import to_object
    with initialize_config_module("configs", version_base=None):
        cfg = to_object(compose("config", overrides=["+exp=tiny", "+schedule=v3"]))
    assert cfg.optim.decay == "phases" and len(cfg.optim.phases) == 4


@pytest.mark.parametrize("override", ["+train.max_step=3", "train.max_step=3"])
def test_cli_unknown_key_prints_one_line_and_exits_2(tmp_path, override):
    """With or without ``+``: checked before Hydra composes (Hydra's own answer to ``train.max_step=3`` is
    seven lines and exit 1). Hydra's own keys (``hydra.*``) and config groups pass."""
    proc = run_cli("+exp=tiny", override, f"hydra.run.dir={tmp_path}/run", "hydra.job.chdir=false",
                   "logging.wandb.mode=disabled", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == ["error: train.max_step: not a config key; did you mean "
                                                "train.max_steps?"], proc.stderr
    assert not (tmp_path / "run").exists()


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
QUIET = [sys.executable, "-m", "trainer.torchrun", "--standalone", "--nproc_per_node=2"]


@pytest.mark.parametrize("launcher", ["torchrun", "trainer.torchrun"])
def test_config_error_under_torchrun_prints_once(tmp_path, launcher):
    """Only rank 0 prints a config error. Stock torchrun adds its ChildFailedError report and exits 1 whatever
    the workers do; ``python -m trainer.torchrun`` exits 2 and adds at most 2 lines."""
    cmd = [*(TORCHRUN if launcher == "torchrun" else QUIET), "-m", "trainer", "+exp=tiny", "optim.eps=0",
           f"hydra.run.dir={tmp_path}/run", "logging.wandb.mode=disabled"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"})
    line = "error: optim.eps: must be finite and > 0, got 0"
    err = proc.stderr.strip().splitlines()
    assert err.count(line) == 1 and proc.stdout.count(line) == 0, proc.stderr
    if launcher == "torchrun":
        assert proc.returncode == 1 and "ChildFailedError" in proc.stderr
    else:
        assert proc.returncode == 2 and len(err) <= 3 and "Traceback" not in proc.stderr, proc.stderr


def test_torchrun_endpoint_held_by_a_non_store_is_one_line(tmp_path):
    """An endpoint held by a non-store (stock torchrun waits on it in silence): one line naming it, exit 2, no
    worker started."""
    import socket
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cmd = [sys.executable, "-m", "trainer.torchrun", "--nnodes=1", "--nproc_per_node=2", "--rdzv_backend=c10d",
               f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=held", "-m", "trainer", "+exp=tiny",
               f"hydra.run.dir={tmp_path}/run", "logging.wandb.mode=disabled"]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and f"127.0.0.1:{port}" in err[0] and "not a rendezvous store" in err[0], proc.stderr
    assert time.monotonic() - t0 < 60 and not (tmp_path / "run").exists()


def test_torchrun_endpoint_check_accepts_a_free_port_and_a_live_store():
    """Nothing listening (this agent will host the store) and a live store (the host's agent is up) pass."""
    import socket
    from datetime import timedelta

    from torch.distributed import TCPStore

    from trainer.torchrun import check_endpoint
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert check_endpoint(f"127.0.0.1:{free}") is None
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    assert check_endpoint(f"127.0.0.1:{store.port}", probe_s=5) is None


# ------------------------------------------------------------------------------------------- value types
def test_value_types_are_checked_against_the_schema():
    """What OmegaConf would refuse, named by key with the expected type and the value; what it converts passes."""
    cases = [
        ("train.max_steps", "abc", "train.max_steps: not an integer (expected int, got 'abc')"),
        ("train.seed", [1], "train.seed: a list where a single value is expected (expected int, got [1])"),
        ("data.blend", {"path": "x"}, "data.blend: a dict where a list is expected (expected list of {path, weight, "
                                      "name}, got {path: 'x'})"),
        ("data.blend", [{"path": "x", "weight": "abc"}],
         "data.blend[0].weight: not a number (expected float, got 'abc')"),
        ("train.stop_at_step", {"a": 1}, "train.stop_at_step: a dict where a single value is expected (expected int "
                                         "or null, got {a: 1})"),
        ("train.bias_update_speed", 3, "train.bias_update_speed: a single value where a group of keys is expected "
                                       "(expected {value, then, after_steps, after_tokens}, got 3)"),
        ("logging.wandb.tags", "abc", "logging.wandb.tags: a single value where a list is expected (expected list "
                                      "of str, got 'abc')"),
        ("train.max_steps", None, "train.max_steps: null is not allowed here (expected int, got null)"),
        ("optim.phases.0.lr", "x", "optim.phases.0.lr: not a number (expected float, got 'x')"),
        ("train.memory_check", "maybe", "train.memory_check: not true or false (expected bool, got 'maybe')"),
    ]
    for key, value, message in cases:
        with pytest.raises(ConfigError) as e:
            check_key(key, value)
        assert str(e.value) == message
    for key, value in [("train.max_steps", "5"), ("train.max_steps", "${train.seed}"), ("optim.lr", 1),
                       ("train.stop_at_step", None), ("data.path", 5), ("train.memory_check", "false"),
                       ("data.blend", [{"path": "x", "weight": 2}]), ("train.bias_update_speed", {"value": 0.1})]:
        check_key(key, value)


def _one_line_exit_2(proc, tmp_path, message: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"error: {message}"], proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


TYPE_MISTAKES = [  # (override, the one line): checked before Hydra composes
    ("train.max_steps=abc", "train.max_steps: not an integer (expected int, got 'abc')"),
    ("data.blend={path: x}", "data.blend: a dict where a list is expected (expected list of {path, weight, name}, "
                             "got {path: 'x'})"),
    ("train.seed=[1]", "train.seed: a list where a single value is expected (expected int, got [1])"),
    ("optim.lr=[1,2", "optim.lr=[1,2: not a valid override: no viable alternative at input '[1,2' (quote a value "
                      "with brackets, braces, commas or spaces: key='...'; syntax: "
                      "https://hydra.cc/docs/advanced/override_grammar/basic)"),
    ("model=v3_smal", "model=v3_smal: configs/model/ has no v3_smal.yaml; did you mean model=v3_small? the options "
                      "are tiny, v3_16b, v3_671b, v3_small"),
    ("data.blend=[{weight: 2}]", "data.blend[0].path: missing (this key has no default); set it"),
]


@pytest.mark.parametrize("override,message", TYPE_MISTAKES, ids=[m[0] for m in TYPE_MISTAKES])
def test_cli_type_mistakes_print_one_line_and_exit_2(tmp_path, override, message):
    proc = run_cli("+exp=tiny", override, f"hydra.run.dir={tmp_path}/run", "logging.wandb.mode=disabled", timeout=120)
    _one_line_exit_2(proc, tmp_path, message)


def test_cli_errors_hydra_meets_while_composing_are_one_line(tmp_path):
    """A bad value and a missing option in the user's config directory: Hydra's error as one line, exit 2;
    HYDRA_FULL_ERROR=1 still gives Hydra's own report."""
    (tmp_path / "cfg" / "exp").mkdir(parents=True)
    (tmp_path / "cfg" / "exp" / "bad.yaml").write_text("# @package _global_\ntrain:\n  max_steps: abc\n")
    common = ["--config-dir", str(tmp_path / "cfg"), f"hydra.run.dir={tmp_path}/run", "logging.wandb.mode=disabled"]
    proc = run_cli(*common, "+exp=bad", timeout=120)
    _one_line_exit_2(proc, tmp_path, "train.max_steps: Value 'abc' of type 'str' could not be converted to Integer "
                                     "(In 'exp/bad': ValidationError raised while composing config)")
    proc = run_cli(*common, "+exp=nope", timeout=120)
    _one_line_exit_2(proc, tmp_path, "In 'config': Could not find 'exp/nope'; Available options in 'exp': bad, tiny, "
                                     "v3_small")
    proc = run_cli(*common, "+exp=bad", timeout=120, env={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 1 and "Traceback" in proc.stderr, proc.stderr[-2000:]
