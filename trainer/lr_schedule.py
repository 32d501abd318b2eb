"""The learning-rate schedule: a pure function of the step and the consumed tokens, so a resume (which restores
both) continues it exactly (the batch-size ramp, likewise: ``data/ramp.py``).

* LR (``optim.decay``): ``cosine`` / ``constant`` after a linear warmup, over ``train.max_steps``; or ``phases``:
  DeepSeek-V3's multi-phase schedule by tokens (``optim.phases``: each phase lasts ``tokens`` and goes from the
  previous phase's end value to its own ``lr``, constant, linearly or along a half cosine), with the warmup
  (``optim.warmup_steps``) scaling the first steps. ``configs/schedule/v3.yaml`` holds the report's values.
"""
from __future__ import annotations

import math


def lr_multiplier(o, max_steps: int, step: int, tokens: float) -> float:
    """Multiplier of ``o.lr`` for optimizer step ``step`` (0-based) taken after ``tokens`` consumed tokens."""
    warm = (step + 1) / o.warmup_steps if step < o.warmup_steps else 1.0
    if o.decay == "phases":
        return warm * phase_lr(o, tokens) / o.lr
    if step < o.warmup_steps:
        return warm
    if o.decay == "constant":
        return 1.0
    floor = o.min_lr / o.lr
    progress = min(1.0, (step - o.warmup_steps) / max(1, max_steps - o.warmup_steps))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def phase_lr(o, tokens: float) -> float:
    """The LR after ``tokens`` consumed tokens under ``optim.phases`` (without warmup); after the last phase,
    that phase's end value."""
    start, begin = o.lr, 0.0
    for ph in o.phases:
        end = begin + ph.tokens
        if tokens < end:
            frac = (tokens - begin) / ph.tokens
            if ph.shape == "constant":
                return ph.lr
            if ph.shape == "linear":
                return start + (ph.lr - start) * frac
            return ph.lr + (start - ph.lr) * 0.5 * (1 + math.cos(math.pi * frac))
        start, begin = ph.lr, end
    return start
