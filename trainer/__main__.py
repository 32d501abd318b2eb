"""``python -m trainer +exp=tiny [key=value ...]``: parse the config, build, train, close.

Multi-process: ``torchrun --nproc_per_node=N -m trainer ...`` (gloo on CPU, NCCL on GPUs).
"""
from __future__ import annotations

import faulthandler
import os
import sys
import traceback

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from configs.schema import register, to_object, validate
from models.config import ConfigError
from trainer.lifecycle import EXIT_CONFIG, EXIT_FAILED, EXIT_STOPPED, TrainingError

register()


def _init_distributed(cfg):
    """Process group + ParallelDims for torchrun launches; (dims, device)."""
    import torch
    import torch.distributed as dist

    from parallel.dims import ParallelDims
    from trainer.train import pick_device

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = pick_device(cfg.train.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    p = cfg.parallel
    dims = ParallelDims(world_size=world, rank=rank, pp=p.pp, ep=p.ep, ranks_per_node=p.ranks_per_node,
                        timeout_s=p.timeout_s)
    if world > 1:
        from datetime import timedelta
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=p.timeout_s))
        dims.build_groups(device.type)
    return dims, device


def _shared_run_dir(run_dir: str, dims) -> str:
    """Ranks may resolve Hydra's time-stamped run dir a second apart: everyone uses rank 0's."""
    if dims.world_size == 1:
        return run_dir
    import torch.distributed as dist
    box = [run_dir]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@hydra.main(version_base=None, config_path="pkg://configs", config_name="config")
def main(dcfg: DictConfig) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = validate(to_object(dcfg), world_size)   # before any collective
        from .train import Trainer   # heavy imports after the config is known to be valid
        dims, device = _init_distributed(cfg)
        trainer = Trainer(cfg, _shared_run_dir(HydraConfig.get().runtime.output_dir, dims), dims, device)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    # A rank ended by a signal it cannot handle in Python (NCCL's watchdog aborts a rank whose collective timed
    # out: SIGABRT) prints every thread's Python stack first: the MoE layer or pipeline action it was in.
    faulthandler.enable(all_threads=True)
    try:
        summary = trainer.train()
    except TrainingError as e:        # one line naming rank, step, phase; no barrier that would wait out peers
        _exit_now(f"error: {e}", EXIT_FAILED)
    except ConfigError as e:
        _exit_now(f"error: {e}", EXIT_CONFIG)
    except SystemExit:                # a launcher's own signal handler ended the run (submitit: requeue on USR2)
        raise
    except BaseException:             # a bug or an unexpected failure: this rank's traceback, at once
        _exit_now(f"rank {dims.rank}: training failed:\n{traceback.format_exc()}", EXIT_FAILED)
    if dims.world_size > 1:
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()
    if summary.get("stopped"):
        sys.exit(EXIT_STOPPED)
    # Done: return (exit code 0). Launchers that run this function in their own process (Hydra's submitit
    # launcher) wait for its return value; a SystemExit here would leave them waiting for a result.


def _exit_now(message: str, code: int) -> None:
    """Print and leave without waiting for peers (a barrier or process-group teardown could block until
    their timeout). torchrun then stops the other ranks; under srun they fail at their next collective."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
