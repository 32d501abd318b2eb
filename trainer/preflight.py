"""The trainer's pre-flight memory check (``train.memory_check``): before anything big is built, the
worst rank's estimate from ``trainer.memory_plan.plan_memory`` (recipe trainer) against the memory a rank may use."""
from __future__ import annotations

import copy
import os

import torch

from configs.schema import Config
from errors import ConfigError
from parallel.dims import ParallelDims

from .memory_plan import GB, plan_memory

LIMIT_ENV = "DSV3_MEMORY_LIMIT_GB"   # overrides the free memory a rank may use (tests; shared hosts)
HEADROOM = 0.1


def memory_limit(device) -> tuple[float, str]:
    """(bytes one rank may use, where that came from): free device memory on CUDA; on CPU the host's
    MemAvailable shared by the ranks on this host (LOCAL_WORLD_SIZE); ``HEADROOM`` kept free."""
    if os.environ.get(LIMIT_ENV):
        return float(os.environ[LIMIT_ENV]) * GB, f"${LIMIT_ENV}"
    if getattr(device, "type", "cpu") == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free * (1 - HEADROOM), f"free memory of {device} less {100 * HEADROOM:.0f}%"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    return avail * (1 - HEADROOM) / local, (f"host MemAvailable {avail / GB:.1f} GB less {100 * HEADROOM:.0f}%"
                                            + (f", shared by {local} local ranks" if local > 1 else ""))


def preflight(cfg: Config, dims: ParallelDims, device) -> str:
    """Stop (``ConfigError``, one line) when the worst rank's estimate under the trainer's recipe (weights,
    gradients, optimizer state, activations at the schedule's peak) exceeds ``memory_limit``; else the line
    to log. The same ``plan_memory`` as ``python -m tools.size --recipe trainer``, on the run's ``dims``."""
    kind = getattr(device, "type", "cpu")   # as memory_limit reads it
    need = plan_memory(cfg, recipe="trainer", dims=dims, device=kind).worst
    limit, where = memory_limit(device)
    what = (f"~{need.total / GB:.2f} GB per rank (weights {need.weights / GB:.2f}, grads {need.grads / GB:.2f}, "
            f"optimizer {need.optim / GB:.2f}, activations {need.act_peak / GB:.2f}; python -m tools.size --recipe trainer)")
    if need.total <= limit:
        return f"memory: {what}; {limit / GB:.1f} GB available ({where})"
    raise ConfigError(f"memory: this run needs {what} but {limit / GB:.1f} GB are available ({where}); "
                      f"{_fits_with(cfg, dims, limit, kind)}")


def _fits_with(cfg: Config, dims: ParallelDims, limit: float, kind: str) -> str:
    """The first changes (one key each) under which the estimate fits, or how far off it is."""
    p, t = cfg.parallel, cfg.train
    tries = []
    if dims.dp > 1 and p.zero < 2:
        tries.append(("parallel.zero", 2, lambda c: setattr(c.parallel, "zero", 2)))
    if t.micro_batch_size > 1:
        tries.append(("train.micro_batch_size", 1, lambda c: setattr(c.train, "micro_batch_size", 1)))
    fits = []
    for key, value, change in tries:
        c = copy.deepcopy(cfg)
        change(c)
        if plan_memory(c, recipe="trainer", dims=dims, device=kind).worst.total <= limit:
            fits.append(f"{key}={value}")
    if fits:
        return "it fits with " + " or ".join(fits)
    total = plan_memory(cfg, recipe="trainer", dims=dims, device=kind).worst.total
    return (f"spread it over about {total / limit:.0f}x more ranks (parallel.ep, parallel.pp, with parallel.zero=1 "
            f"or 2), or pick a smaller model; python -m tools.size --recipe trainer <overrides> --world-size N sizes a layout")
