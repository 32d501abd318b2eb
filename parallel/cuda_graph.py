"""``train.cuda_graph``: a step's forward and backward replayed as one CUDA graph (``GraphedStep``).

In eager mode the host enqueues every kernel of the step from Python: about 2,400 in the 12-layer ``v3_small``
BF16 step, and its FP8 step adds the Triton launches' own Python. On an H100 both steps wait for the host
(docs/benchmarks.md: host time 149.5 of 156.6 ms, and 299.5 of 307.9 ms in FP8). A CUDA graph records the
launches once and replays them with one call.

What is captured: the step's micro-batches, forward and backward (the losses, the gradients the optimizer reads,
the MoE layers' load counters), reading the tokens from static buffers. The optimizer step, the finiteness check,
the bias update and the metrics stay eager: they read host values (the LR, the step count, the skip decision).

Replay equals eager because:
- shapes are static: one graph per key (the trainer's: micro-batch count, MTP loss weight, batch shape); a new key
  (a batch ramp, a new MTP weight) captures again;
- tensors stay where the graph reads and writes them: the tokens are copied into the static buffers, and the
  parameters' and buffers' addresses are compared before each replay (a reload that replaced one captures again);
- the gradients the graph writes are handed back to the optimizer after each replay (``hold_grads``, as they were
  right after the capture): the optimizer drops its references after its step, the graph keeps writing there;
- nothing inside syncs the host (``tools.host_syncs``: the single-process forward and backward make none);
  compilation, Triton's autotuning and the kernels' self-checks do, so the first ``WARMUP`` steps run eagerly,
  on the stream the capture then uses (cuBLAS makes its workspace there).
A capture that fails: one warning line naming the error, and every later step runs eagerly. One process only
(``enabled``; ``configs/schema.py`` refuses ``on`` elsewhere): collectives would need NCCL's graph support and fixed
split sizes.
"""
from __future__ import annotations

import logging
from typing import Callable, Hashable

import torch
from torch import nn

log = logging.getLogger("parallel")

WARMUP = 2   # eager steps of each key before its capture
MODES = ("auto", "on", "off")   # train.cuda_graph


def why_eager(mode: str, device: torch.device | str, world_size: int, weights: str = "bf16",
              recompute: str = "none") -> str | None:
    """None when ``train.cuda_graph=mode`` replays the step from a graph, else why the steps run eagerly. A graph
    needs one process on CUDA (the config refuses ``on`` anywhere else); ``auto`` graphs only what a GPU has run,
    BF16 weights without recomputation. FP32 weights, the reference precision, stay eager: torch's CUDA
    ``_grouped_mm`` has its CUTLASS kernel for BF16 only, and its fallback for other dtypes copies the group
    offsets to the host, which a capture refuses (an H100, torch 2.11). Recomputation inside a graph has not run on
    a GPU (``on`` tries it)."""
    if mode not in MODES:
        raise ValueError(f"train.cuda_graph: {mode!r} is not one of {', '.join(MODES)}")
    if torch.device(device).type != "cuda":
        return "not on CUDA"
    if world_size > 1:
        return f"{world_size} processes"
    if mode == "off":
        return "train.cuda_graph=off"
    if mode == "auto" and weights != "bf16":
        return "FP32 weights"
    if mode == "auto" and recompute != "none":
        return f"train.recompute={recompute}"
    return None


def enabled(mode: str, device: torch.device | str, world_size: int, weights: str = "bf16",
            recompute: str = "none") -> bool:
    """Whether ``train.cuda_graph=mode`` replays the step from a graph (``why_eager`` says why not)."""
    return why_eager(mode, device, world_size, weights, recompute) is None


class CudaGraphs:
    """How ``GraphedStep`` makes and replays graphs: ``torch.cuda.CUDAGraph`` (tests on the CPU stand another in)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)

    def eager(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``fn()`` on the capture stream, ordered after and before the current stream's work."""
        current = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            out = fn()
        current.wait_stream(self.stream)
        return out

    def capture(self, fn: Callable[[], torch.Tensor]):
        """``(graph, fn's output)``: ``fn`` recorded, not run."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            out = fn()
        return graph, out

    def replay(self, graph) -> None:
        graph.replay()


class GraphedStep:
    """``step(tensors, consts)``: ``fn(*tensors, *consts)`` (a step's forward and backward; returns a device
    tensor), replayed from a CUDA graph after ``WARMUP`` eager calls with its key (a new shape compiles and tunes
    eagerly before a capture). The tensors are copied into the graph's buffers; the constants (hashable host values
    the graph bakes in) are part of its key. ``opt`` holds the gradients between backward and step
    (``held_grads`` / ``hold_grads``: ``parallel.zero.Replicated``)."""

    def __init__(self, fn: Callable[..., torch.Tensor], model: nn.Module, opt, graphs: CudaGraphs):
        self.fn, self.model, self.opt, self.graphs = fn, model, opt, graphs
        self.calls = 0   # calls in a row with the key of the last call
        self.last_key = None
        self.failed: str | None = None   # why the capture failed: every call runs eagerly
        self.graph = None
        self.key = self.addresses = self.inputs = self.out = self.held = None

    def __call__(self, tensors: tuple[torch.Tensor, ...], consts: tuple[Hashable, ...] = ()) -> torch.Tensor:
        key = (consts, tuple((t.shape, t.dtype, t.device) for t in tensors))
        self.calls, self.last_key = (self.calls + 1 if key == self.last_key else 1), key
        if self.failed or self.calls <= WARMUP:
            return self.graphs.eager(lambda: self.fn(*tensors, *consts))
        if self.graph is None or key != self.key or self._addresses() != self.addresses:
            self._capture(tensors, consts, key)
            if self.failed:
                return self.graphs.eager(lambda: self.fn(*tensors, *consts))
        for buf, t in zip(self.inputs, tensors):
            buf.copy_(t)
        self.graphs.replay(self.graph)
        self.opt.hold_grads(self.held)
        return self.out

    def _addresses(self) -> list[int]:
        return [t.data_ptr() for t in (*self.model.parameters(), *self.model.buffers())]

    def _capture(self, tensors: tuple[torch.Tensor, ...], consts: tuple, key: Hashable) -> None:
        self.graph = self.out = self.held = None   # the old graph's memory goes back before the new one takes its own
        self.inputs = tuple(t.clone() for t in tensors)
        self.opt.zero_grad()   # the graph's backward makes the gradients it then rewrites
        try:
            self.graph, self.out = self.graphs.capture(lambda: self.fn(*self.inputs, *consts))
        except Exception as e:   # noqa: BLE001 - any failure of the capture: the eager step is the reference
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log.warning("train.cuda_graph: capturing the forward and backward failed (%s); every step runs eagerly",
                        self.failed)
            self.graph = self.inputs = None
            self.opt.zero_grad()   # what the failed capture left is not this step's
            return
        self.key, self.addresses, self.held = key, self._addresses(), self.opt.held_grads()
        log.info("train.cuda_graph: captured the forward and backward; steps of the same shape replay them")


__all__ = ["MODES", "CudaGraphs", "GraphedStep", "WARMUP", "enabled", "why_eager"]
