"""Where a training step's time goes: the seconds of each named phase of ``Trainer.train_step`` (forward/
backward, gradient checks, optimizer step, expert-load all-reduce), logged as ``time_<phase>_s`` next to
``step_time_s`` (W&B: ``time/<phase>_s``).

On CPU the host clock measures a phase. On CUDA the host only launches most of a phase's work, so a phase
records a CUDA event at each end and ``read`` converts them after the step's final host sync, when they
have completed: the device's time for the work the phase issued on the current stream.
"""
from __future__ import annotations

import contextlib
import re
import time

import torch


def metric_key(phase: str) -> str:
    """``metrics.jsonl`` key of a phase: ``"forward/backward"`` -> ``"time_forward_backward_s"``."""
    return "time_" + re.sub(r"[^a-z0-9]+", "_", phase.lower()).strip("_") + "_s"


class StepTimers:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._spans: list[tuple[str, object, object]] = []   # (phase, start, end): seconds or CUDA events
        self._depth = 0   # a phase inside another counts in the outer one only: the times add up to the step

    def reset(self) -> None:
        """Forget what was timed (phases outside a step: checks, checkpoints, validation)."""
        self._spans.clear()

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if self._depth:
            yield
            return
        self._depth += 1
        try:
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                yield
                end.record()
            else:
                start = time.perf_counter()
                yield
                end = time.perf_counter()
        finally:
            self._depth -= 1
        self._spans.append((phase, start, end))

    def read(self) -> dict[str, float]:
        """Seconds per phase timed since the last ``reset`` (a phase entered twice: summed), then reset. On
        CUDA: call after a host sync that follows the phases' work."""
        out: dict[str, float] = {}
        for phase, start, end in self._spans:
            s = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            out[metric_key(phase)] = out.get(metric_key(phase), 0.0) + s
        self.reset()
        return out
