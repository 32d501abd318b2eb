"""Learning-rate and batch-size schedules: pure functions of the step and the consumed tokens, so a resume
(which restores both) continues them exactly.

* LR (``optim.decay``): ``cosine`` / ``constant`` after a linear warmup, over ``train.max_steps``; or ``phases``:
  DeepSeek-V3's multi-phase schedule by tokens (``optim.phases``: each phase lasts ``tokens`` and goes from the
  previous phase's end value to its own ``lr``, constant, linearly or along a half cosine), with the warmup
  (``optim.warmup_steps``) scaling the first steps. ``configs/schedule/v3.yaml`` holds the report's values.
* Batch size (``train.batch_ramp``): from ``start`` to ``train.global_batch_size`` sequences in steps of
  ``increment``, evenly over the first ``tokens`` consumed tokens (Megatron-LM's ramp-up, by tokens).
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


def batch_size_at(t, tokens: float) -> int:
    """Sequences in the next global batch after ``tokens`` consumed tokens (``train.batch_ramp``)."""
    r = t.batch_ramp
    if r.start is None or tokens >= r.tokens:
        return t.global_batch_size
    inc = r.increment or r.start
    n_increments = (t.global_batch_size - r.start) // inc
    done = int(tokens // (r.tokens / n_increments)) if n_increments else 0
    return min(t.global_batch_size, r.start + done * inc)


def ramp_sizes(t) -> list[int]:
    """Every global batch size the ramp passes through (for layout validation)."""
    r = t.batch_ramp
    if r.start is None:
        return [t.global_batch_size]
    return list(range(r.start, t.global_batch_size, r.increment or r.start)) + [t.global_batch_size]
