"""Autograd-aware uneven all-to-all over a process group, with an optional async launch.

Shapes: rows are dim 0; ``out_splits[i]`` rows arrive from rank i, ``in_splits[i]`` rows go to rank i.

``all_to_all_fp8`` / ``fp8_route``: the same, with the rows travelling as FP8 (E4M3 bytes, sent as
``uint8``, plus one power-of-2 FP32 scale per 1x128 tile) through one or more hops — quantised once
before the first hop, forwarded unchanged, dequantised to the input dtype only at the final receiver.
Their backward is **straight-through**: the gradient travels back in its own dtype, unquantised, as if
the forward had sent the rows exactly.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from kernels.reference import TILE

from ..errors import named


@contextlib.contextmanager
def named_errors(name: str, rank: int):
    """Re-raise communication failures (timeouts, dead peers) naming the rank and the MoE layer (and its
    EP group: ``name`` carries it, see ``apply_ep``); other errors pass unchanged."""
    with named(f"expert all-to-all of {name} failed on rank {rank} (a peer may have died, timed out, or "
               f"skipped this layer)"):
        yield


class Pending:
    """Launched collectives; ``wait()`` blocks until all are done, then runs the ``then`` callbacks
    (e.g. dequantising an FP8 payload into the output tensor) — after it the output tensor is valid."""

    def __init__(self, work=None):
        self.works, self.then = ([work] if work is not None else []), []

    def add(self, *works, then: Callable[[], None] | None = None) -> None:
        self.works.extend(w for w in works if w is not None)
        if then is not None:
            self.then.append(then)

    def wait(self) -> None:
        works, self.works = self.works, []
        for w in works:
            w.wait()
        then, self.then = self.then, []
        for fn in then:
            fn()


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, pending, name):
        ctx.out_splits, ctx.in_splits, ctx.group, ctx.name = out_splits, in_splits, group, name
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group,
                                      async_op=pending is not None)
        if pending is not None:
            pending.add(work)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        with named_errors(f"{ctx.name} (backward)", dist.get_rank()):
            dist.all_to_all_single(out, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, pending: Pending | None = None,
               name: str = "moe") -> torch.Tensor:
    """Differentiable ``all_to_all_single`` (the backward sends the gradient back over ``group``). With
    ``pending``, returns at once; wait on it before use."""
    return _AllToAll.apply(x, out_splits, in_splits, group, pending, name)


def start_all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group, pending: Pending,
                     fp8: bool = False, on_send: Callable[[torch.Tensor], None] | None = None,
                     rows: torch.Tensor | None = None) -> torch.Tensor:
    """Launch an uneven all-to-all of ``x[rows]`` (all of ``x`` when None) outside autograd (``x`` is read
    detached); the returned tensor is valid after ``pending.wait()``. ``fp8``: the rows travel as E4M3
    bytes + power-of-2 scales, quantised before the row gather (once per row of ``x``), and are dequantised
    to ``x.dtype`` in ``wait()`` (as ``all_to_all_fp8``). Used by the dispatchers' cut links."""
    x = x.detach()
    if fp8:
        q, s = quant_rows(x)
        if rows is not None:
            q, s = q[rows], s[rows]
        q_out = q.new_empty((sum(out_splits), q.shape[1]))
        s_out = s.new_empty((sum(out_splits), s.shape[1]))
        if on_send is not None:
            on_send(q)
            on_send(s)
        w_q = dist.all_to_all_single(q_out, q, out_splits, in_splits, group=group, async_op=True)
        w_s = dist.all_to_all_single(s_out, s, out_splits, in_splits, group=group, async_op=True)
        out = x.new_empty((q_out.shape[0], x.shape[1]))

        def land():
            out.copy_(dequant_rows(q_out, s_out, out.dtype))
        pending.add(w_q, w_s, then=land)
        return out
    x = (x if rows is None else x[rows]).contiguous()
    if on_send is not None:
        on_send(x)
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    pending.add(dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True))
    return out


# ------------------------------------------------------------------------------------------ FP8 routing
def quant_rows(x: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, D]`` -> ``(bytes [R, D] uint8 (E4M3 bit patterns), scales [R, D/128] fp32 powers of 2)``.

    1x128 tiles along D, power-of-2 scales (DeepSeek-V3's dispatch quantisation), via ``kernels``
    (``auto``: the Triton kernel on CUDA, the bit-identical plain-torch reference elsewhere)."""
    R, D = x.shape
    if D % TILE:
        raise ValueError(f"FP8 dispatch needs the row width (model.dim) to be a multiple of {TILE}, got {D}")
    if R == 0:
        return x.new_empty((0, D), dtype=torch.uint8), x.new_empty((0, D // TILE), dtype=torch.float32)
    import kernels
    with torch.autocast(x.device.type, enabled=False):
        q, s = kernels.get_ops(backend, x.device).quant_act(x.contiguous(), True)
    return q.view(torch.uint8), s


def dequant_rows(q_u8: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``quant_rows``: ``bytes * scale`` per tile, in ``dtype``."""
    from kernels.reference import FP8_DTYPE, dequant
    if q_u8.shape[0] == 0:
        return torch.empty(q_u8.shape, dtype=dtype, device=q_u8.device)
    with torch.autocast(q_u8.device.type, enabled=False):
        return dequant(q_u8.view(FP8_DTYPE), s).to(dtype)


@dataclass(frozen=True)
class Hop:
    """One uneven all-to-all of an FP8 route. ``rows`` (int64, or None for all rows in order) picks the rows
    of the current buffer (the route's input, or the previous hop's output) to send, grouped by destination."""
    out_splits: list[int]
    in_splits: list[int]
    group: Any
    rows: torch.Tensor | None = None


class _FP8Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, hops, pending, name, backend, on_send):
        ctx.hops, ctx.name, ctx.n_in = hops, name, x.shape[0]
        q, s = quant_rows(x.detach(), backend)      # once, at the source
        for i, hop in enumerate(hops):
            if hop.rows is not None:
                q, s = q[hop.rows], s[hop.rows]
            q, s = q.contiguous(), s.contiguous()
            if on_send is not None:
                on_send(q)
                on_send(s)
            q_out = q.new_empty((sum(hop.out_splits), q.shape[1]))
            s_out = s.new_empty((sum(hop.out_splits), s.shape[1]))
            async_op = pending is not None and i == len(hops) - 1
            w_q = dist.all_to_all_single(q_out, q, hop.out_splits, hop.in_splits, group=hop.group, async_op=async_op)
            w_s = dist.all_to_all_single(s_out, s, hop.out_splits, hop.in_splits, group=hop.group, async_op=async_op)
            q, s = q_out, s_out
        if pending is None:
            return dequant_rows(q, s, x.dtype)
        out = x.new_empty((q.shape[0], x.shape[1]))

        def land(out=out.detach(), q=q, s=s):   # runs in ``pending.wait()``, once both payloads are here
            out.copy_(dequant_rows(q, s, out.dtype))
        pending.add(w_q, w_s, then=land)
        return out

    @staticmethod
    def backward(ctx, grad):
        # Straight-through: the gradient of the dequantised rows is taken as the gradient of the rows that
        # were sent, and goes back unquantised, in its own dtype, through the hops in reverse.
        hops = ctx.hops
        sizes = [ctx.n_in] + [sum(h.out_splits) for h in hops[:-1]]    # rows of each hop's source buffer
        with named_errors(f"{ctx.name} (backward)", dist.get_rank()):
            for hop, n_src in zip(reversed(hops), reversed(sizes)):
                back = grad.new_empty((sum(hop.in_splits), *grad.shape[1:]))
                dist.all_to_all_single(back, grad.contiguous(), hop.in_splits, hop.out_splits, group=hop.group)
                grad = back if hop.rows is None else \
                    back.new_zeros((n_src, *back.shape[1:])).index_put_((hop.rows,), back, accumulate=True)
        return grad, None, None, None, None, None


def fp8_route(x: torch.Tensor, hops: list[Hop], pending: Pending | None = None, name: str = "moe",
              backend: str = "auto", on_send: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """Send rows of ``x [N, D]`` through ``hops`` as FP8 (quantised once here, forwarded as bytes + scales,
    dequantised to ``x.dtype`` on arrival). Differentiable in ``x``, straight-through (module docstring).

    ``pending``: the last hop is launched asynchronously; the result is valid after ``pending.wait()``.
    ``on_send``: called with every buffer handed to an all-to-all in the forward (for byte counting)."""
    return _FP8Route.apply(x, list(hops), pending, name, backend, on_send)


def all_to_all_fp8(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
                   pending: Pending | None = None, name: str = "moe", rows: torch.Tensor | None = None,
                   backend: str = "auto", on_send: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """``all_to_all`` of ``x[rows]`` (all of ``x`` when None) with the rows travelling as FP8: two uneven
    all-to-alls with the same splits, E4M3 bytes (as uint8) and the 1x128 power-of-2 scales (fp32).
    Quantising before the row gather quantises each source row once. Straight-through backward."""
    return fp8_route(x, [Hop(out_splits, in_splits, group, rows)], pending, name, backend, on_send)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """``counts [P, ...]`` (row i = what this rank sends to rank i) -> row i = what rank i sends here."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out
