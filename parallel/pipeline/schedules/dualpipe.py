"""DualPipe (DeepSeek-V3 report §3.2.1): bidirectional pipeline with overlapped forward/backward pairs.

pp ranks (pp even), pp stages, every stage held twice. Rank r holds
  chunk 0: stage r        for direction 0 (micro-batches 0 .. N/2-1 enter at rank 0 and flow to pp-1)
  chunk 1: stage pp-1-r   for direction 1 (micro-batches N/2 .. N-1 enter at rank pp-1 and flow to 0).
Each rank runs eight phases. They are written for a rank in the first half, where the *local* phase 0
is direction 0; a rank in the second half is the mirror image, so its local phase 0 is direction 1.
With h = half_rank = min(r, pp-1-r), H = pp/2 and n = N/2 micro-batches per direction the counts are
  1 nF0        (H-h-1)*2      forwards of phase 0
  2 nF0F1      h+1            F0, F1
  3 nB1W1F1    H-h-1          B1 (zero-bubble: input grad only), W, F1
  4 nF0B1F1B0  n-pp+h+1       F0&B1, F1&B0 (the middle ranks do their first F0, B1 un-overlapped)
  5 nB1F1B0    H-h-1          B1, F1&B0
  6 nB1B0      h+1            B1, B0 (the second half of these use zero-bubble)
  7 nWB0       H-h-1          W, B0 (zero-bubble)
  8 nW         h+1            W
Every "&" pair is one F&B action: a forward and a full backward (BW) run overlapped. Zero-bubble
backwards emit B now and W later, in FIFO order. Peak live activations: pp+1 on every
rank. Bubble: (pp/2-1)(F&B+B-3W) with B the full backward.

``local_phases`` is shared with DualPipeV, which is this schedule cut in half.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from .actions import Action, Kind, add_p2p, check_counts, fb

# A local op: ("F", phase) | ("B", phase, zero_bubble) | ("W",) | ("FB", forward phase, backward phase)
Op = tuple


def local_phases(h: int, H: int, n: int, middle: bool) -> list[Op]:
    """The eight phases of one rank in local phase numbering (h = half_rank, H = half the ranks of the
    bidirectional pipeline, n = micro-batches per direction, middle = h == H-1)."""
    ops: list[Op] = []
    # 1 nF0: (H-h-1)*2
    ops += [("F", 0)] * ((H - h - 1) * 2)
    # 2 nF0F1: h+1
    for _ in range(h + 1):
        ops += [("F", 0), ("F", 1)]
    # 3 nB1W1F1: H-h-1 (zero bubble)
    for _ in range(H - h - 1):
        ops += [("B", 1, True), ("W",), ("F", 1)]
    # 4 nF0B1F1B0 (main step): n-2H+h+1
    for i in range(n - 2 * H + h + 1):
        if i == 0 and middle:  # not overlapped, to shorten the bubble of the turn-around
            ops += [("F", 0), ("B", 1, False)]
        else:
            ops.append(("FB", 0, 1))
        ops.append(("FB", 1, 0))
    # 5 nB1F1B0: H-h-1
    for _ in range(H - h - 1):
        ops += [("B", 1, False), ("FB", 1, 0)]
    # 6 nB1B0: h+1 steps of B1, B0; the second half of these 2(h+1) backwards use zero bubble
    for j in range(2 * (h + 1)):
        ops.append(("B", 1 - j % 2, j >= h + 1))
    # 7 nWB0: H-h-1 (zero bubble)
    for _ in range(H - h - 1):
        ops += [("W",), ("B", 0, True)]
    # 8 nW: h+1
    ops += [("W",)] * (h + 1)
    return ops


def resolve(ops: list[Op], module: Callable[[int, int], tuple[int, int, int]]) -> list[Action]:
    """Turn local ops into actions. ``module(phase, i) -> (mb, stage, chunk)`` for the i-th micro-batch
    of a local phase; forwards and backwards of a phase both run in micro-batch order, Ws in FIFO order."""
    n_f, n_b = [0, 0], [0, 0]
    pending_w: deque[Action] = deque()

    def forward(p: int) -> Action:
        n_f[p] += 1
        return Action(Kind.F, *module(p, n_f[p] - 1))

    def backward(p: int, zero_bubble: bool) -> Action:
        n_b[p] += 1
        mb, stage, chunk = module(p, n_b[p] - 1)
        if zero_bubble:
            pending_w.append(Action(Kind.W, mb, stage, chunk))
        return Action(Kind.B if zero_bubble else Kind.BW, mb, stage, chunk)

    out = []
    for op in ops:
        if op[0] == "F":
            out.append(forward(op[1]))
        elif op[0] == "B":
            out.append(backward(op[1], op[2]))
        elif op[0] == "W":
            out.append(pending_w.popleft())
        else:
            out.append(fb(forward(op[1]), backward(op[2], False)))
    assert not pending_w, "every zero-bubble B must have its W"
    return out


def min_microbatches(pp: int) -> int:
    return 2 * pp


def dualpipe(pp: int, n_microbatches: int) -> list[list[Action]]:
    check_counts("dualpipe", "pp", pp, 2, even=True)
    check_counts("dualpipe", "n_microbatches", n_microbatches, min_microbatches(pp), "2*pp", even=True)
    H, n = pp // 2, n_microbatches // 2
    ranks = []
    for r in range(pp):
        h = min(r, pp - 1 - r)
        second_half = r >= H

        def module(phase: int, i: int, r=r, second_half=second_half) -> tuple[int, int, int]:
            direction = phase ^ second_half   # chunk == direction
            return (i + direction * n, r if direction == 0 else pp - 1 - r, direction)

        ranks.append(resolve(local_phases(h, H, n, middle=h == H - 1), module))
    return add_p2p(ranks)
