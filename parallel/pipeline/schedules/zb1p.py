"""ZB1P (ZB-H1, "Zero Bubble Pipeline Parallelism", Qi et al.): 1F1B with the backward split in B
(input gradient) and W (weight gradient), and W deferred to fill the bubbles.

Rank r has 1F1B's shape for F and B: ``pp - r - 1`` warm-up forwards, then F / B pairs, then the
remaining Bs. W runs right after a B except that rank r keeps ``r`` Ws pending: later ranks delay
their Ws so that the chain of Bs reaches the early ranks sooner, and the pending Ws fill the gaps of
the cool-down. Activations (F to B) per rank are the same as 1F1B (``pp`` on rank 0); rank r holds
at most ``r`` extra W inputs, so F-to-W in-flight micro-batches never exceed ``pp``.
Bubble: (pp-1)(F+B-2W) with B the full backward, i.e. (pp-1)(F + b - w) with b the input-only B.
"""
from __future__ import annotations

from collections import deque

from .actions import Action, Kind, add_p2p, check_counts


def min_microbatches(pp: int) -> int:
    return pp


def zb1p(pp: int, n_microbatches: int) -> list[list[Action]]:
    check_counts("zb1p", "pp", pp)
    check_counts("zb1p", "n_microbatches", n_microbatches, min_microbatches(pp), "pp")
    ranks = []
    for r in range(pp):
        warmup = pp - r - 1
        pending: deque[Action] = deque()
        seq = [Action(Kind.F, m, r) for m in range(warmup)]

        def backward(m: int) -> None:
            seq.append(Action(Kind.B, m, r))
            pending.append(Action(Kind.W, m, r))
            if len(pending) > r:                  # rank r keeps r Ws deferred
                seq.append(pending.popleft())

        for i in range(n_microbatches - warmup):  # steady state: F, B (, W)
            seq.append(Action(Kind.F, warmup + i, r))
            backward(i)
        for m in range(n_microbatches - warmup, n_microbatches):  # cool-down: B (, W)
            backward(m)
        seq += pending                            # the deferred Ws close the schedule
        ranks.append(seq)
    return add_p2p(ranks)
