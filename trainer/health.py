"""The health guard: whether a step whose values are all finite still shows training going wrong.

Non-finite steps are handled before this (``Trainer.skip_step``). A finite run can still diverge: a loss spike
that the optimizer amplifies, then a collapsed model (the loss exactly ln(vocab), no gradient) that saves and
prunes good checkpoints for as long as nothing is NaN. Each step's loss, gradient norm and worst expert-load
ratio are already on the host (the step's one sync); the rules below read only those, so every rank reaches
the same verdict without a collective (the values are all-reduced before they get here).

A step is unhealthy when (``train.health``):
- its loss is above ``max_loss_over_uniform`` x ln(vocab): worse than guessing uniformly, from the first step;
- before ``warmup_steps`` healthy steps: its gradient norm is over 1000x the last healthy one;
- after them: its loss, or the log of its gradient norm, is more than ``spike_sigmas`` typical step-to-step
  changes above the last healthy value (floors below keep a smooth run from tripping on noise);
- its gradient norm is zero (nothing left to learn from: a collapsed model), or, after warm-up, its loss sits at
  ln(vocab) although the model had learned below it;
- after warm-up, some MoE layer sent every token to the same experts (max load / mean = experts / top-k) after the
  last healthy step had been balanced (below half of that).
Only healthy steps update the running statistics. ``patience`` unhealthy steps in a row ask for a rollback
(``Trainer.roll_back``); the guard's state is saved in each checkpoint, so a resumed run decides the same way.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

WINDOW = 20               # steps of the running step-to-step change (exact below it, then exponentially weighted)
LOSS_SIGMA_FLOOR = 0.02   # relative to the last healthy loss: a spike is at least spike_sigmas x 2 % above it
LOG_GRAD_SIGMA_FLOOR = 0.5  # in log space: at spike_sigmas=6 a grad-norm spike is at least e^3 = 20x the last healthy one
EARLY_GRAD_JUMP = 1000.0  # before warm-up, a gradient norm this many times the last healthy one is a spike
COLLAPSED_GRAD_NORM = 1e-8  # below it the model produces no gradient
LEARNED = 0.95            # "had learned": the last healthy loss below this share of ln(vocab)
AT_UNIFORM = 0.01         # "back at ln(vocab)": within this share of it
FULL_IMBALANCE = 0.99     # "every token to the same experts": max/mean load at this share of experts / top-k ...
BALANCED = 0.5            # ... when the last healthy step's was below this share (small models run near it)


@dataclass
class Running:
    """The last healthy value of a series and the typical size of its step-to-step change (root mean square,
    exact over the first ``WINDOW`` changes, then exponentially weighted). Changes, not levels: a falling loss
    is a trend, not noise, and must not widen the band a spike is measured against."""
    n: int = 0
    last: float = 0.0
    msd: float = 0.0          # mean squared step-to-step change

    def add(self, x: float) -> None:
        if self.n:
            a = 1.0 / min(self.n, WINDOW)
            self.msd += a * ((x - self.last) ** 2 - self.msd)
        self.n += 1
        self.last = x

    def sigmas_above(self, x: float, floor: float) -> float:
        return (x - self.last) / max(math.sqrt(self.msd), floor)


@dataclass
class HealthGuard:
    cfg: object               # configs.schema.HealthConfig
    vocab_size: int
    full_imbalance: float | None = None   # experts / top-k of the MoE layers; None: a dense model
    loss: Running = field(default_factory=Running)
    log_grad: Running = field(default_factory=Running)
    imbalance: float = 0.0    # max expert load / mean of the last healthy step
    streak: int = 0           # unhealthy steps in a row
    rollbacks: int = 0        # over the whole run, resumes included
    skipped: list = field(default_factory=list)   # [first, last] step whose data a rollback skipped, per rollback

    @property
    def uniform(self) -> float:
        return math.log(self.vocab_size)

    def check(self, m: dict) -> str | None:
        """Why the step with metrics ``m`` (``Trainer.train_step``'s) is unhealthy, or None; updates the state."""
        why = self._why(m["loss"], m["grad_norm"], m.get("max_expert_load_over_mean"))
        if why is None:
            self.streak = 0
            self.loss.add(m["loss"])
            self.log_grad.add(math.log(max(m["grad_norm"], COLLAPSED_GRAD_NORM)))
            self.imbalance = m.get("max_expert_load_over_mean") or 0.0
        else:
            self.streak += 1
        return why

    def _why(self, loss: float, grad_norm: float, imbalance: float | None) -> str | None:
        c, ln_v = self.cfg, self.uniform
        if loss > c.max_loss_over_uniform * ln_v:
            return (f"loss {loss:.4g} is above train.health.max_loss_over_uniform={c.max_loss_over_uniform:g} x "
                    f"ln(vocab) = {c.max_loss_over_uniform * ln_v:.4g} (worse than guessing)")
        if grad_norm < COLLAPSED_GRAD_NORM:
            return f"gradient norm {grad_norm:.3g}: the model has collapsed (no gradient)"
        warm = self.loss.n >= c.warmup_steps
        if self.log_grad.n and not warm and math.log(grad_norm) - self.log_grad.last > math.log(EARLY_GRAD_JUMP):
            return (f"gradient norm {grad_norm:.4g} is over {EARLY_GRAD_JUMP:g} x the last healthy one "
                    f"({math.exp(self.log_grad.last):.4g})")
        if not warm:
            return None
        if self.loss.last < LEARNED * ln_v and abs(loss - ln_v) < AT_UNIFORM * ln_v:
            return (f"loss {loss:.4g} is back at ln(vocab) = {ln_v:.4g} after the model had learned (last healthy "
                    f"loss {self.loss.last:.4g}): it has collapsed to uniform predictions")
        s = self.loss.sigmas_above(loss, LOSS_SIGMA_FLOOR * self.loss.last)
        if s > c.spike_sigmas:
            return (f"loss {loss:.4g} is {s:.1f} typical step changes above the last healthy loss "
                    f"{self.loss.last:.4g} (train.health.spike_sigmas={c.spike_sigmas:g})")
        s = self.log_grad.sigmas_above(math.log(grad_norm), LOG_GRAD_SIGMA_FLOOR)
        if s > c.spike_sigmas:
            return (f"gradient norm {grad_norm:.4g} is {s:.1f} typical step changes (in log) above the last healthy "
                    f"one {math.exp(self.log_grad.last):.4g} (train.health.spike_sigmas={c.spike_sigmas:g})")
        full = self.full_imbalance
        if full and imbalance is not None and imbalance >= FULL_IMBALANCE * full and self.imbalance < BALANCED * full:
            return (f"max expert load / mean {imbalance:.3g} (last healthy step {self.imbalance:.3g}): some MoE layer "
                    f"sent every token to the same experts (routing collapse)")
        return None

    def state_dict(self) -> str:
        """The state as one JSON string (one object in the checkpoint, whatever the number of rollbacks)."""
        return json.dumps({"loss": vars(self.loss), "log_grad": vars(self.log_grad), "imbalance": self.imbalance,
                           "streak": self.streak,
                           "rollbacks": self.rollbacks, "skipped": self.skipped})

    def load_state_dict(self, text: str) -> None:
        s = json.loads(text)
        self.loss, self.log_grad, self.imbalance = Running(**s["loss"]), Running(**s["log_grad"]), s["imbalance"]
        self.streak, self.rollbacks, self.skipped = s["streak"], s["rollbacks"], [list(w) for w in s["skipped"]]
