"""``Schedule``: one schedule's per-rank action lists and the stage placement read off them.

Which global stage each rank's chunk runs is not written down anywhere else: every compute action
names its ``(chunk, stage)``, so the placement is read from the lists themselves. Any valid list
names every stage (each ``(mb, stage)`` has an F), so a schedule built with the fewest micro-batches
its generator accepts already shows the whole placement.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from .actions import Action, Kind


def count_stages(schedule: Sequence[Sequence[Action]]) -> int:
    """Number of stages the compute actions of ``schedule`` name (one more than the largest)."""
    return 1 + max((p.stage for rank in schedule for a in rank if a.is_compute for p in a.parts()), default=-1)


@dataclass(frozen=True)
class Schedule(Sequence):
    """The ordered actions of schedule ``name`` for ``pp`` ranks and ``n_microbatches``, one tuple per
    rank; indexes and iterates like the ``list[list[Action]]`` it holds (``schedule[pp_rank]``)."""
    name: str
    pp: int
    n_microbatches: int
    actions: tuple[tuple[Action, ...], ...]

    def __getitem__(self, rank):
        return self.actions[rank]

    def __len__(self) -> int:
        return len(self.actions)

    def __iter__(self):
        return iter(self.actions)

    @cached_property
    def n_stages(self) -> int:
        return count_stages(self.actions)

    @cached_property
    def splits_backward(self) -> bool:
        """Whether some backward is split into B (input gradients) and a later W (weight gradients): the
        zero-bubble schedules. Such a run defers its weight-gradient GEMMs (``parallel/wgrad.py``)."""
        return any(a.kind in (Kind.B, Kind.W) for actions in self.actions for a in actions)

    @cached_property
    def _placement(self) -> tuple[dict[int, int], ...]:
        """Per rank: chunk -> the global stage it runs, from the rank's compute actions."""
        out = []
        for r, actions in enumerate(self.actions):
            chunks: dict[int, int] = {}
            for p in (p for a in actions if a.is_compute for p in a.parts()):
                if chunks.setdefault(p.chunk, p.stage) != p.stage:
                    raise ValueError(f"{self.name}: rank {r} chunk {p.chunk} runs stages {chunks[p.chunk]} "
                                     f"and {p.stage}")
            out.append(chunks)
        return tuple(out)

    def stages_of(self, pp_rank: int) -> dict[int, int]:
        """chunk -> global stage on pipeline rank ``pp_rank``."""
        return dict(self._placement[pp_rank])

    def rank_of(self, stage: int) -> int:
        """The rank that runs ``stage`` on its lowest chunk (DualPipe holds every stage twice: the
        chunk-0 copy), the lowest such rank first."""
        held = [(c, r) for r, chunks in enumerate(self._placement) for c, s in chunks.items() if s == stage]
        if not held:
            raise ValueError(f"{self.name}: no rank runs stage {stage} (stages 0..{self.n_stages - 1})")
        return min(held)[1]
