"""Hydra callback for jobs that hydra-submitit-launcher starts with several tasks (one per GPU).

submitit runs the Hydra job once per SLURM task but does not set torch's ``env://`` variables; this
callback does, before the trainer reads them: ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` from
``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``, ``MASTER_ADDR`` = the job's first node and
``MASTER_PORT`` derived from the job id (submitit's ``TorchDistributedEnvironment``). It leaves
``CUDA_VISIBLE_DEVICES`` alone (the trainer picks ``cuda:LOCAL_RANK``). Enabled by
``hydra/launcher=slurm`` (``configs/hydra/launcher/slurm.yaml``); a no-op outside multi-task SLURM jobs
and under torchrun (which sets the variables itself).
"""
from __future__ import annotations

import os
from typing import Any

from hydra.experimental.callback import Callback


class SlurmTorchEnv(Callback):
    def on_job_start(self, config: Any = None, **kwargs: Any) -> None:
        if int(os.environ.get("SLURM_NTASKS", "1")) <= 1 or "TORCHELASTIC_RUN_ID" in os.environ:
            return
        from submitit.helpers import TorchDistributedEnvironment

        TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
