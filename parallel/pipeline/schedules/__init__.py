"""Pipeline schedules as pure data: ``get_schedule(name, pp, n_microbatches) -> Schedule``.

One generator per file; each maps (pp, n_microbatches) to one ordered action list per rank. The
simulator (``parallel.pipeline.simulator``) and the executor consume the same lists; the stage
placement (``Schedule.n_stages``, ``stages_of``, ``rank_of``) is read off them. ``SCHEDULES`` is the one
list of schedule names; ``NO_PIPELINE`` is the one other value ``parallel.schedule`` takes (pp = 1).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from . import dualpipe, dualpipev, one_f_one_b, zb1p
from .actions import Action, Kind, Payload, add_p2p, fb, p2p_streams
from .schedule import Schedule

NO_PIPELINE = "none"


class Generator(NamedTuple):
    build: Callable[[int, int], list[list[Action]]]   # (pp, n_microbatches) -> one action list per rank
    min_microbatches: Callable[[int], int]            # the fewest micro-batches it accepts on pp ranks


SCHEDULES: dict[str, Generator] = {
    "1f1b": Generator(one_f_one_b.one_f_one_b, one_f_one_b.min_microbatches),
    "zb1p": Generator(zb1p.zb1p, zb1p.min_microbatches),
    "dualpipe": Generator(dualpipe.dualpipe, dualpipe.min_microbatches),
    "dualpipev": Generator(dualpipev.dualpipev, dualpipev.min_microbatches),
}


def get_schedule(name: str, pp: int, n_microbatches: int | None = None) -> Schedule:
    """Schedule ``name`` for ``pp`` ranks and ``n_microbatches`` (default: the fewest it accepts, which
    is enough for its placement)."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule ({name!r}) must be one of {sorted(SCHEDULES)}")
    gen = SCHEDULES[name]
    n = gen.min_microbatches(pp) if n_microbatches is None else n_microbatches
    return Schedule(name, pp, n, tuple(tuple(actions) for actions in gen.build(pp, n)))


__all__ = ["NO_PIPELINE", "SCHEDULES", "Action", "Generator", "Kind", "Payload", "Schedule", "add_p2p", "fb",
           "get_schedule", "p2p_streams"]
