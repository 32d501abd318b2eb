"""Step metrics: ``metrics.jsonl`` in the run dir, Weights & Biases (offline by default), tqdm on rank 0."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


class MetricsLogger:
    def __init__(self, run_dir: Path, wandb_cfg, config_dict: dict, total_steps: int, start_step: int,
                 progress: bool = True, is_main: bool = True):
        self.is_main = is_main
        self.run_dir = Path(run_dir)
        self._file = open(self.run_dir / "metrics.jsonl", "a") if is_main else None
        self._eval_file = open(self.run_dir / "eval.jsonl", "a") if is_main else None
        self.wandb = None
        if is_main and wandb_cfg.mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb
            self.wandb = wandb.init(project=wandb_cfg.project, entity=wandb_cfg.entity, name=wandb_cfg.name,
                                    tags=list(wandb_cfg.tags), mode=wandb_cfg.mode, dir=str(self.run_dir),
                                    config=config_dict)
        self.bar = None
        if is_main and progress:
            import sys

            from tqdm.auto import tqdm
            # Redraw rarely when stderr is a log file rather than a terminal.
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                            mininterval=0.1 if sys.stderr.isatty() else 30.0)

    def log_step(self, metrics: dict[str, Any], expert_load: list[torch.Tensor] | None = None) -> None:
        if not self.is_main:
            return
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()
        if self.wandb is not None:
            extra = {}
            for i, load in enumerate(expert_load or []):
                load = load.float().cpu()
                extra[f"expert_load/moe{i}_max_over_mean"] = (load.max() / load.mean().clamp_min(1e-9)).item()
                extra[f"expert_load/moe{i}_min_over_mean"] = (load.min() / load.mean().clamp_min(1e-9)).item()
                extra[f"expert_load_hist/moe{i}"] = self._wandb_hist(load)
            self.wandb.log({f"train/{k}": v for k, v in metrics.items() if k != "step"} | extra,
                           step=metrics["step"])
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")

    def log_eval(self, step: int, val_loss: float) -> None:
        if not self.is_main:
            return
        self._eval_file.write(json.dumps({"step": step, "val_loss": val_loss}) + "\n")
        self._eval_file.flush()
        if self.wandb is not None:
            self.wandb.log({"val/loss": val_loss}, step=step)

    def write(self, line: str) -> None:
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        for f in (self._file, self._eval_file):
            if f is not None:
                f.close()
        if self.wandb is not None:
            self.wandb.finish()

    @staticmethod
    def _wandb_hist(load: torch.Tensor):
        import wandb
        # One bar per expert: tokens routed to expert i.
        return wandb.Histogram(np_histogram=(load.numpy(), list(range(len(load) + 1))))
