"""Exponential moving average of the parameters, in CPU memory, updated off the critical path.

DeepSeek-V3 (report §3.3) keeps an EMA of the weights in CPU memory and updates it asynchronously after each
step, so it costs no GPU memory and no step time. ``ParamEMA`` does the same for this rank's parameters
(its pipeline stages and its expert shard): after an optimizer step, ``update`` copies the parameters into
a reused host buffer (pinned, asynchronous, on CUDA) and hands ``ema = decay * ema + (1 - decay) * param``
to one background thread, which overlaps the next step's compute (torch ops release the GIL). The next
``update``, ``state_dict`` or ``load_state_dict`` waits for it first. The EMA is fp32 whatever the
parameters' dtype; skipped steps (non-finite) do not update it. Checkpoints store it under ``ema`` with
the model's single-device names (``parallel/state_dict.py``), so it reshards like the weights, and
``python -m tools.convert_hf export --ema`` writes it instead of the weights. With BF16 weights
(``train.precision=bf16|fp8``) it averages the optimizer's FP32 master instead (``opt.master_weights()``:
under ZeRO this rank's master pieces, so each rank keeps the EMA of its own shard), never the BF16 rounding. A
split master (``optim.master=split``) is given as its live halves (``Replicated.master_halves``): both are copied
to the host and joined there (``kernels.adamw.join_master``), the same FP32 values.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class ParamEMA:
    def __init__(self, params: nn.Module | dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]],
                 decay: float):
        """``params``: a module (its parameters) or name -> tensor (a DTensor: its local piece is averaged), or
        name -> (high, low) halves of a split master (module docstring)."""
        self.decay = float(decay)
        named = params.named_parameters() if isinstance(params, nn.Module) else params.items()
        self.named = [(n, p if isinstance(p, tuple) else (p.to_local() if isinstance(p, DTensor) else p,))
                      for n, p in named]   # one tensor, or the two halves
        cuda = any(p.is_cuda for _, ts in self.named for p in ts)
        self.shadow = {n: _value(ts).detach().to("cpu", torch.float32, copy=True) for n, ts in self.named}
        self._staging = {n: tuple(torch.empty(p.shape, dtype=p.dtype, pin_memory=cuda) for p in ts)
                         for n, ts in self.named}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ema")
        self._pending: Future | None = None

    @torch.no_grad()
    def update(self) -> None:
        """Fold the current parameters in (call after the optimizer step)."""
        self.wait()
        event = None
        for n, ts in self.named:
            for buf, p in zip(self._staging[n], ts):
                buf.copy_(p.detach(), non_blocking=p.is_cuda)
        if any(p.is_cuda for _, ts in self.named for p in ts):
            event = torch.cuda.Event()
            event.record()
        self._pending = self._pool.submit(self._fold, event)

    def _fold(self, event) -> None:
        if event is not None:
            event.synchronize()
        d = self.decay
        for n, s in self.shadow.items():
            s.mul_(d).add_(_value(self._staging[n]).float(), alpha=1 - d)

    def wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()   # re-raises what the thread raised

    def state_dict(self) -> dict[str, torch.Tensor]:
        self.wait()
        return self.shadow

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.wait()
        for n, s in self.shadow.items():
            s.copy_(sd[n])

    @torch.no_grad()
    def reset(self) -> None:
        """Start again from the current parameters (e.g. a checkpoint written without an EMA)."""
        self.wait()
        for n, ts in self.named:
            self.shadow[n].copy_(_value(ts).detach())

    def close(self) -> None:
        self.wait()
        self._pool.shutdown()


def _value(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The tensor itself, or a split master's FP32 values from its two halves."""
    if len(ts) == 1:
        return ts[0]
    from kernels.adamw import join_master
    return join_master(*ts).view(ts[0].shape)
