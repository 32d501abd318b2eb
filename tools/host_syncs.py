"""Find a training step's host synchronisations without a GPU: ``python -m tools.host_syncs +exp=tiny [overrides]``.

On CUDA the host stops and waits for the GPU whenever it needs a value or a shape the GPU computes:
``.item()``, ``.tolist()``, ``float(t)`` / ``int(t)`` / ``bool(t)``, ``.cpu()``, ``.numpy()``, and ops whose
output size depends on the data (``nonzero``, boolean-mask indexing, ``unique``, ``bincount``,
``masked_select``, ``repeat_interleave`` without ``output_size``). Each such wait drains the launch queue,
so the GPU idles while the host catches up. ``torch.cuda.set_sync_debug_mode("warn")`` reports them on a
GPU; ``HostSyncAudit`` records the same calls on the CPU, with the calling function, so that the CPU test
suite (``tests/test_host_syncs.py``) can hold the step to the list below and ``docs/gpu.md`` can quote it.

``EXPECTED`` is that list: every host sync a training step may make, keyed by (file, function, op), with
the reason it is needed. A new one fails the test until it is removed or added here with its reason.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from contextlib import ExitStack
from typing import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (file, function, op) -> why the step needs it. Per micro-batch and MoE layer unless said otherwise.
EXPECTED: dict[tuple[str, str, str], str] = {
    ("parallel/ep/dispatch.py", "_plan", "tolist"):
        "all-to-all split sizes: torch's all_to_all_single takes them as Python ints (flat dispatcher)",
    ("parallel/ep/dispatch.py", "plan_nodes", "tolist"):
        "split sizes of the inter-node hop (hierarchical dispatcher)",
    ("parallel/ep/dispatch.py", "plan_nodes", "nonzero"):
        "the (token, node) pairs to send: their number depends on the routing",
    ("parallel/ep/dispatch.py", "plan_forward", "nonzero"):
        "the expert copies to forward inside the node: their number depends on the routing",
    ("parallel/ep/dispatch.py", "plan_forward", "tolist"):
        "split sizes of the intra-node hop (hierarchical dispatcher)",
    ("trainer/train.py", "check_step", "tolist"):
        "once per step, before the update: whether any rank's loss or gradients are non-finite (the update is "
        "skipped) or a stop was requested; host control flow, one world all-reduce (as Megatron's found-inf check)",
    ("trainer/train.py", "train_step", "tolist"):
        "once per step: the step's loss, grad norm and load imbalance reach the host for the logs",
    ("trainer/train.py", "_ep_metrics", "tolist"):
        "once per step, after the step: the dispatch counters for the logs",
    ("trainer/metrics.py", "rank_memory", "tolist"):
        "once per step, after the step: per-rank peak memory for the logs",
    ("parallel/zero/__init__.py", "step", "item"):
        "not a GPU sync: torch.optim.AdamW (parallel.zero=0) reads its step counters, which it keeps on the CPU",
    ("parallel/pipeline/p2p.py", "_decode", "tolist"):
        "NCCL-strict mode only (a debugging mode): the header of each pipeline transfer",
    ("kernels/reference.py", "e4m3_to_float", "tolist"):
        "not a GPU sync: CPU tensors only (elsewhere the plain cast runs): whether FP8 bytes widened on the CPU "
        "hold a NaN, whose bits torch's own cast gives",
}

_SCALAR = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")
_SHAPE = ("nonzero", "unique", "bincount", "masked_select", "argwhere")


class HostSyncAudit:
    """Context manager: counts the calls that would synchronise a CUDA host, by (file, function, op) of
    the nearest caller inside this repository (see the module docstring)."""

    def __init__(self):
        self.calls: Counter = Counter()
        self._stack = ExitStack()
        self._busy = False   # a recorded op calling another (e.g. tolist -> item) counts once

    def __enter__(self) -> HostSyncAudit:
        for name in _SCALAR + _SHAPE + ("repeat_interleave", "__getitem__"):
            self._patch(torch.Tensor, name, self._method(name))
        for name in _SHAPE + ("repeat_interleave", "where"):
            self._patch(torch, name, self._function(name))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def sites(self) -> set[tuple[str, str, str]]:
        return set(self.calls)

    def unexpected(self) -> set[tuple[str, str, str]]:
        return {s for s in self.calls if s not in EXPECTED}

    # ---- patching ------------------------------------------------------------------------------------
    def _patch(self, owner, name: str, make: Callable) -> None:
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        self._stack.callback(setattr, owner, name, original)

    def _syncs(self, name: str, args: tuple, kwargs: dict) -> bool:
        if name == "__getitem__":   # boolean-mask indexing has a data-dependent size
            idx = args[1] if len(args) > 1 else None
            idx = idx if isinstance(idx, tuple) else (idx,)
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)
        if name == "repeat_interleave":
            return kwargs.get("output_size") is None and any(isinstance(a, torch.Tensor) for a in args[1:2]) \
                or isinstance(kwargs.get("repeats"), torch.Tensor) and kwargs.get("output_size") is None
        if name == "where":         # torch.where(cond) == nonzero
            return len(args) + len(kwargs) == 1
        return True   # .cpu() too: free on a CPU run, a device-to-host copy on a GPU

    def _record(self, name: str, args: tuple, kwargs: dict) -> None:
        if self._busy or not self._syncs(name, args, kwargs):
            return
        op = {"__float__": "float", "__int__": "int", "__bool__": "bool", "__index__": "index",
              "__getitem__": "bool-mask index"}.get(name, name)
        self.calls[(*_caller(), op)] += 1

    def _method(self, name: str):
        def make(original):
            def wrapper(*args, **kwargs):
                self._record(name, args, kwargs)
                busy, self._busy = self._busy, True
                try:
                    return original(*args, **kwargs)
                finally:
                    self._busy = busy
            return wrapper
        return make

    _function = _method


def _caller() -> tuple[str, str]:
    f = sys._getframe(3)
    here = os.path.abspath(__file__)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if path.startswith(ROOT) and path != here and "/.venv" not in path and "site-packages" not in path:
            return os.path.relpath(path, ROOT), f.f_code.co_name
        f = f.f_back
    return "?", "?"


def audit_steps(trainer, steps: int = 1) -> HostSyncAudit:
    """Run one warm-up step, then ``steps`` steps under the audit."""
    trainer.logger = _NullLogger()
    trainer.train_step()
    with HostSyncAudit() as audit:
        for _ in range(steps):
            trainer.train_step()
    return audit


class _NullLogger:
    def write(self, line: str) -> None:
        pass


def report(audit: HostSyncAudit) -> str:
    lines = [f"{'calls':>6}  {'site':<58} op / reason"]
    for (path, fn, op), n in sorted(audit.calls.items()):
        why = EXPECTED.get((path, fn, op), "NOT EXPECTED: remove it or add it to tools.host_syncs.EXPECTED")
        lines.append(f"{n:>6}  {path + ':' + fn:<58} {op} / {why}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +exp=tiny parallel.ep=2")
    args = ap.parse_args(argv)
    from configs.schema import compose, validate
    from errors import ConfigError
    from trainer.train import Trainer
    try:
        cfg = validate(compose(["logging.wandb.mode=disabled", "logging.progress=false", *args.overrides]))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        audit = audit_steps(Trainer(cfg, tmp))
    print(report(audit))
    return 1 if audit.unexpected() else 0


if __name__ == "__main__":
    sys.exit(main())
