"""DualPipeV ("cut-in-half" DualPipe): 2*pp stages folded into a V over pp ranks.

Rank r holds chunk 0 = stage r and chunk 1 = stage 2*pp-1-r; every micro-batch enters on rank 0,
goes down chunk 0 to rank pp-1, turns (stages pp-1 and pp are both on rank pp-1, a local hand-over),
comes back up chunk 1 and ends, with its loss, on rank 0. No parameters are duplicated.

The schedule is DualPipe's with 2*pp ranks and 2*N micro-batches, restricted to its first half: rank r
runs DualPipe's eight phases (``dualpipe.local_phases``: nF0, nF0F1, nB1W1F1, nF0B1F1B0, nB1F1B0,
nB1B0, nWB0, nW) with half_rank = r, H = pp and n = N per phase, so phase 0 is chunk 0 and phase 1 is
chunk 1, and the rank pp-1 at the tip of the V plays DualPipe's middle rank. Counts for rank r:
nF0 (pp-r-1)*2, nF0F1 r+1, nB1W1F1 pp-r-1, nF0B1F1B0 N-2*pp+r+1, nB1F1B0 pp-r-1, nB1B0 r+1,
nWB0 pp-r-1, nW r+1. Peak live chunk activations: 2*pp+1 on rank 0. Bubble: (pp-1)(F&B+B-3W) with F,
B, W per chunk, the table's (PP/2-1)(F&B+B-3W) with PP = 2*pp stages on PP/2 devices.
"""
from __future__ import annotations

from .actions import Action, add_p2p, check_counts
from .dualpipe import local_phases, resolve


def min_microbatches(pp: int) -> int:
    return 2 * pp


def dualpipev(pp: int, n_microbatches: int) -> list[list[Action]]:
    check_counts("dualpipev", "pp", pp)
    check_counts("dualpipev", "n_microbatches", n_microbatches, min_microbatches(pp), "2*pp")
    ranks = []
    for r in range(pp):
        def module(phase: int, i: int, r=r) -> tuple[int, int, int]:
            return (i, r if phase == 0 else 2 * pp - 1 - r, phase)

        ranks.append(resolve(local_phases(r, pp, n_microbatches, middle=r == pp - 1), module))
    return add_p2p(ranks)
