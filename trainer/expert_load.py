"""Expert load over windows of steps: tokens per expert of each MoE layer summed over the steps since the previous
window closed, as load / the layer's mean (1 everywhere is a perfect balance). A window closes every ``every`` steps
and at the last step. W&B's ``experts/load_heatmap`` (``trainer.wandb_panels``) and ``<run dir>/expert_load.jsonl``
(``trainer.metrics``) are both drawn from one.

Shapes: L MoE layers, E routed experts.
"""
from __future__ import annotations

import torch

Window = tuple[int, torch.Tensor]   # a closed window: (its first step, load / layer mean [L, E])


def load_over_mean(loads: list[torch.Tensor]) -> torch.Tensor:
    """[L, E]: each layer's tokens per expert over that layer's mean."""
    return torch.stack([x / x.mean().clamp_min(1e-9) for x in loads])


class LoadWindow:
    """Sums the per-step loads (one 1-D tensor of tokens per expert per MoE layer) of a run starting after
    ``start_step``; ``add`` returns ``(from_step, load_over_mean_LE)`` at the step that closes a window."""

    def __init__(self, every: int, total_steps: int, start_step: int):
        self.every = every
        self.total_steps = total_steps
        self.restart(start_step)

    def restart(self, step: int) -> None:
        """Drop the open window; the next one starts after ``step`` (a resume or a rollback to it)."""
        self._sum: list[torch.Tensor] | None = None
        self.from_step = step + 1

    def add(self, step: int, loads: list[torch.Tensor]) -> Window | None:
        if not loads:
            return None
        self._sum = loads if self._sum is None else [a + b for a, b in zip(self._sum, loads)]
        if step % self.every == 0 or step >= self.total_steps:
            return self.close(step)
        return None

    def close(self, step: int) -> Window | None:
        """The open window ending at ``step`` (a run stopped between two), or None when none is open."""
        if self._sum is None:
            return None
        out = (self.from_step, load_over_mean(self._sum))
        self.restart(step)
        return out
