"""1F1B (PipeDream-Flush): one stage per rank, full backward (BW) after each forward in steady state.

Rank r runs ``pp - r - 1`` warm-up forwards, then alternates F / BW, then drains the remaining BWs.
Rank r holds stage r; micro-batches flow rank 0 -> pp-1 and gradients back. At most ``pp - r``
activations are live on rank r (``pp`` on rank 0). Bubble per rank: (pp-1)(F+B), B = full backward.
"""
from __future__ import annotations

from .actions import Action, Kind, add_p2p, check_counts


def min_microbatches(pp: int) -> int:
    return pp


def one_f_one_b(pp: int, n_microbatches: int) -> list[list[Action]]:
    check_counts("1f1b", "pp", pp)
    check_counts("1f1b", "n_microbatches", n_microbatches, min_microbatches(pp), "pp")
    ranks = []
    for r in range(pp):
        warmup = pp - r - 1
        fwd = [Action(Kind.F, m, r) for m in range(n_microbatches)]
        bwd = [Action(Kind.BW, m, r) for m in range(n_microbatches)]
        seq = fwd[:warmup]
        for i in range(n_microbatches - warmup):  # steady state: 1F1B
            seq += [fwd[warmup + i], bwd[i]]
        seq += bwd[n_microbatches - warmup:]      # cool-down
        ranks.append(seq)
    return add_p2p(ranks)
