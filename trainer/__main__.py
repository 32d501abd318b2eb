"""``python -m trainer +exp=tiny [key=value ...]``: parse the config, build, train, close.

Multi-process: ``torchrun --nproc_per_node=N -m trainer ...`` (gloo on CPU, NCCL on GPUs).
"""
from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from configs.schema import register, to_object, validate
from models.config import ConfigError

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
    dims = ParallelDims(world_size=world, rank=rank, pp=p.pp, ep=p.ep, ranks_per_node=p.ranks_per_node)
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
        sys.exit(2)
    try:
        trainer.train()
    finally:
        if dims.world_size > 1:
            import torch.distributed as dist
            dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
