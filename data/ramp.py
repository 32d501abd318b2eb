"""The batch-size ramp (``train.batch_ramp``): from ``start`` to ``train.global_batch_size`` sequences in steps of
``increment``, evenly over the first ``tokens`` consumed tokens (Megatron-LM's ramp-up, by tokens). A pure
function of the consumed tokens, so a resume continues it exactly. No torch: ``configs`` validates layouts
against ``ramp_sizes``.
"""
from __future__ import annotations


def batch_size_at(t, tokens: float) -> int:
    """Sequences in the next global batch after ``tokens`` consumed tokens (``train.batch_ramp``)."""
    r = t.batch_ramp
    if r.start is None or tokens >= r.tokens:
        return t.global_batch_size
    inc = r.increment or r.start
    n_increments = (t.global_batch_size - r.start) // inc
    done = int(tokens // (r.tokens / n_increments)) if n_increments else 0
    return min(t.global_batch_size, r.start + done * inc)


def micro_batches(global_batch: int, micro_batch_size: int, dp: int) -> int:
    """Micro-batches per data-parallel rank in a global batch of ``global_batch`` sequences (which
    ``configs.schema.validate`` checks divides into ``micro_batch_size x dp``)."""
    return global_batch // (micro_batch_size * dp)


def ramp_sizes(t) -> list[int]:
    """Every global batch size the ramp passes through (for layout validation)."""
    r = t.batch_ramp
    if r.start is None:
        return [t.global_batch_size]
    return list(range(r.start, t.global_batch_size, r.increment or r.start)) + [t.global_batch_size]
