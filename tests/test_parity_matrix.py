"""The parity matrix: every pipeline schedule x F&B overlap on/off x
``train.recompute`` none/selective/full x EP 1/2 x ZeRO 0/1 reproduces the single-device losses of 2
optimizer steps (fp32, relative 1e-6; measured 7e-8), and recomputation changes no bit of a layout's run.
The gradient norm is checked to 1e-5 (measured 1e-6 / 2.4e-6 at steps 1 / 2): one device takes it with
torch's fp32 ``clip_grad_norm_`` over gradients summed in another order, and AdamW's first update
(about lr * sign(g)) turns rounding-level differences of near-zero gradients into full-size ones.

Trainer-level (``Trainer.train_step``: pipeline executor, twin-stage sums, gradient reduction, the AdamW /
ZeRO-1 step, the balancing-bias update), cheaply: one process spawn per layout, each building a fresh
Trainer per configuration inside its workers -- pp=2 (dp 1: EP 1, ZeRO 0), and pp=2 x dp=2 (world 4) with
EP 2 and ZeRO 1, EP 1 and ZeRO 1, EP 2 and ZeRO 0. Overlap changes only schedules with F&B actions (``PipelineExecutor.overlap``); 1F1B and ZB1P have none
(asserted), so they run once."""
import copy
import json

import pytest
import torch

from configs.schema import validate
from parallel.dims import ParallelDims
from parallel.pipeline.schedules import SCHEDULES, Kind, get_schedule
from parallel.recompute import MODES

from .dist_utils import spawn
from .trainer_utils import make_config

STEPS, PP, N_MICRO = 2, 2, 4   # per dp rank: 4 micro-batches of 1 sequence (DualPipe(V) need 2*pp)
COMMON = ["logging.wandb.mode=disabled", "logging.progress=false", "train.eval_every=0", "train.eval_batches=1",
          "train.memory_check=false", "checkpoint.save_final=false", "data.seq_len=32", "train.micro_batch_size=1",
          "optim.moment_dtype=fp32", "optim.warmup_steps=1", f"train.max_steps={STEPS}"]
LAYOUTS = {   # name: (world, overrides)
    "pp2": (2, []),
    "pp2-dp2-ep2-zero1": (4, ["parallel.ep=2", "parallel.zero=1"]),
    "pp2-dp2-zero1": (4, ["parallel.zero=1"]),
    "pp2-dp2-ep2": (4, ["parallel.ep=2"]),
}


def matrix() -> list[tuple[str, bool, str]]:
    """(schedule, overlap, recompute) for every schedule; overlap both ways only where it changes anything."""
    out = []
    for name in SCHEDULES:
        fb = any(a.kind is Kind.FB for acts in get_schedule(name, PP, N_MICRO) for a in acts)
        out += [(name, overlap, mode) for overlap in ((True, False) if fb else (True,)) for mode in MODES]
    return out


def _run(cfg, dims, run_dir) -> list[list[float]]:
    from trainer.train import Trainer
    trainer = Trainer(cfg, run_dir, dims, torch.device("cpu"))
    return [[m["loss"], m["grad_norm"]] for m in (trainer.train_step() for _ in range(STEPS))]


def _worker(rank, world, overrides, out_dir):
    dims = ParallelDims(world_size=world, rank=rank, pp=PP, ep=2 if "parallel.ep=2" in overrides else 1)
    dims.build_groups()
    got, configs = {}, matrix()
    sched, overlap, mode = configs[0]
    first = make_config(*COMMON, f"data.cache_dir={out_dir}/cache", f"train.global_batch_size={N_MICRO * dims.dp}",
                        *overrides, f"parallel.pp={PP}", f"parallel.schedule={sched}",
                        f"parallel.overlap={str(overlap).lower()}", f"train.recompute={mode}", world_size=world)
    for sched, overlap, mode in configs:   # composed once (Hydra: ~0.2 s a time); the three keys set, validated
        cfg = copy.deepcopy(first)
        cfg.parallel.schedule, cfg.parallel.overlap, cfg.train.recompute = sched, overlap, mode
        got[f"{sched} overlap={overlap} {mode}"] = _run(validate(cfg, world), dims, out_dir / f"run{rank}")
    if rank == 0:
        (out_dir / "got.json").write_text(json.dumps(got))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_schedule_overlap_and_recompute_matches_single_device(tmp_path, layout):
    world, overrides = LAYOUTS[layout]
    dp = world // PP
    single = make_config(*COMMON, f"data.cache_dir={tmp_path}/cache", f"train.global_batch_size={N_MICRO * dp}")
    want = _run(single, ParallelDims(world_size=1), tmp_path / "single")
    spawn(_worker, world, tmp_path, overrides, tmp_path)
    got = json.loads((tmp_path / "got.json").read_text())
    assert list(got) == [f"{s} overlap={o} {m}" for s, o, m in matrix()]
    assert len(got) == 3 * (2 * 2 + 2)   # 1F1B, ZB1P once; DualPipe, DualPipeV with and without overlap

    def worst(i: int) -> float:   # i = 0: loss, 1: gradient norm; max relative difference over configs, steps
        return max(abs(v[s][i] - want[s][i]) / abs(want[s][i]) for v in got.values() for s in range(STEPS))
    assert worst(0) <= 1e-6, (want, got)
    assert worst(1) <= 1e-5, (want, got)
    for key, v in got.items():   # recomputation changes no bit of a layout's run
        assert v == got[key.rsplit(" ", 1)[0] + " none"], key
