"""Pipeline schedules as pure data: ``get_schedule(name, pp, n_microbatches) -> list[list[Action]]``.

One generator per file; each maps (pp, n_microbatches) to one ordered action list per rank. The
simulator (``parallel.pipeline.simulator``) and the executor consume the same lists.
"""
from __future__ import annotations

from typing import Callable

from .actions import Action, Kind, Payload, add_p2p, fb, p2p_streams
from .dualpipe import dualpipe
from .dualpipev import dualpipev
from .one_f_one_b import one_f_one_b
from .zb1p import zb1p

SCHEDULES: dict[str, Callable[[int, int], list[list[Action]]]] = {
    "1f1b": one_f_one_b,
    "zb1p": zb1p,
    "dualpipe": dualpipe,
    "dualpipev": dualpipev,
}


def get_schedule(name: str, pp: int, n_microbatches: int) -> list[list[Action]]:
    """Per-rank ordered actions of schedule ``name`` for ``pp`` ranks and ``n_microbatches``."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule ({name!r}) must be one of {sorted(SCHEDULES)}")
    return SCHEDULES[name](pp, n_microbatches)


__all__ = ["Action", "Kind", "Payload", "SCHEDULES", "add_p2p", "fb", "get_schedule", "p2p_streams"]
