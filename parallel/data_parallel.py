"""Data parallelism for replicated and expert-sharded parameters (without ZeRO: ``parallel.zero=0``).

Gradient of the global-batch mean loss, from per-rank mean losses:
* replicated parameters: all-reduce SUM over the dp group, divide by dp;
* routed-expert parameters: after the backward all-to-alls each EP rank already holds the sum over its
  EP group; all-reduce SUM over the expert-dp group (same experts, other EP groups), divide by dp.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .dims import ParallelDims
from .ep import is_expert_param


def _all_reduce_flat(grads: list[torch.Tensor], group, scale: float) -> None:
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None:
        dist.all_reduce(flat, group=group)
    flat.mul_(scale)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def sync_gradients(model: nn.Module, dims: ParallelDims, named: list | None = None) -> None:
    """Average ``.grad`` over data parallelism (see the module doc). ``named``: the ``(name, tensor)`` pairs
    whose ``.grad`` to reduce instead of the model's parameters (an FP32 master copy), by the same names."""
    if dims.dp == 1:
        return
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad] if named is None else named
    for _, p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    reduce_gradients(model, dims, [(n, p.grad) for n, p in params])


def reduce_gradients(model: nn.Module, dims: ParallelDims, named_grads: list[tuple[str, torch.Tensor]]) -> None:
    """``sync_gradients`` of the given ``(name, gradient)`` pairs, in place: experts' over their data-parallel
    group, the rest over dp, each averaged over dp."""
    if dims.dp == 1:
        return
    expert = is_expert_param(model)
    _all_reduce_flat([g for n, g in named_grads if not expert[n]], dims.group("dp"), 1.0 / dims.dp)
    _all_reduce_flat([g for n, g in named_grads if expert[n]], dims.group("edp") if dims.edp > 1 else None,
                     1.0 / dims.dp)


def clip_grad_norm(model: nn.Module, max_norm: float, dims: ParallelDims, weight=None,
                   named: list | None = None) -> torch.Tensor:
    """Global L2 norm over all parameters (``grad_norm``), clipped in place. No host sync: the clip factor
    min(1, max_norm / norm) is applied on the device, like torch's own. ``named``: as in ``sync_gradients``."""
    params = [p for _, p in (model.named_parameters() if named is None else named) if p.grad is not None]
    total = grad_norm(model, dims, weight, named)
    if max_norm > 0 and params:
        torch._foreach_mul_([p.grad.detach() for p in params], clip_coef(total, max_norm))
    return total


def clip_coef(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)) on the device (torch's ``clip_grad_norm_`` formula)."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def grad_sq(model: nn.Module, weight=None, named: list | None = None,
            grads: list[torch.Tensor | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's sums of squared gradients, (dense, routed expert): FP64 scalars on the parameters' device, before
    any reduction. Arguments as ``grad_norm``'s. Non-finite exactly when a gradient holds an inf or nan (the sums
    are FP64, as ``all_finite``'s, and every ``weight`` is positive), so one pass serves the finiteness check and
    the clip (``Replicated.grads_finite``)."""
    expert = is_expert_param(model)
    named = list(model.named_parameters() if named is None else named)
    grads = [p.grad for _, p in named] if grads is None else grads
    pairs = [(n, g.detach()) for (n, _), g in zip(named, grads) if g is not None]
    device = pairs[0][1].device if pairs else torch.device("cpu")
    dense, routed = weighted_sq([g for _, g in pairs], [int(expert[n]) for n, _ in pairs],
                                [weight(n) if weight else 1.0 for n, _ in pairs], 2, device)
    return dense, routed


def weighted_sq(tensors: list[torch.Tensor], slots: list[int], weights: list[float], k: int,
                device: torch.device) -> list[torch.Tensor]:
    """``k`` FP64 scalars: slot ``j`` is ``Σ weights[i] · ‖tensors[i]‖²`` over the tensors with ``slots[i] = j``.
    One fused ``_foreach_norm`` per (slot, weight), accumulated in FP64 (no FP64 copy of a tensor; the squares of
    any finite FP32 value fit) and scaled by a Python float: nothing travels from the host to the device."""
    groups: dict[tuple[int, float], list[torch.Tensor]] = {}
    for t, j, w in zip(tensors, slots, weights):
        groups.setdefault((j, w), []).append(t)
    sq = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(k)]
    for (j, w), ts in groups.items():
        sq[j] = sq[j] + torch.stack(torch._foreach_norm(ts, 2, dtype=torch.float64)).square().sum() * w
    return sq


def grad_norm(model: nn.Module, dims: ParallelDims, weight=None, named: list | None = None,
              grads: list[torch.Tensor | None] | None = None,
              sq: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Global L2 norm of the gradients (a float64 scalar tensor on the parameters' device). Expert shards are
    summed over the EP group, pipeline stages over the pp group; ``weight(name)`` (1 / holders) counts a tensor
    held by several pipeline ranks (DualPipe replicas, tied embeddings) once. ``named``: as in
    ``sync_gradients``; ``grads``: the gradient of each of them (any float dtype, read as it is) instead of
    their ``.grad``; ``sq``: this rank's sums (``grad_sq``) where the caller has them already."""
    dense_sq, expert_sq = grad_sq(model, weight, named, grads) if sq is None else sq
    if dims.ep > 1:
        expert_sq = expert_sq.clone() if sq is not None else expert_sq   # the caller's sums stay this rank's
        dist.all_reduce(expert_sq, group=dims.group("ep"))
    total_sq = dense_sq + expert_sq
    if dims.pp > 1:
        dist.all_reduce(total_sq, group=dims.group("pp"))
    return total_sq.sqrt()


def all_finite(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """A boolean scalar on ``device``: no inf/nan in any of ``tensors`` (no host sync). One fused L2 pass
    accumulated in FP64: an inf or nan anywhere makes its tensor's norm non-finite, and FP64 holds the sum of
    squares of any finite FP32/BF16 tensor, so a large finite gradient is never taken for an overflow. (The
    max-abs norm says the same but runs 3-4x slower on CPU; in FP32 the L2 norm overflows past ~1.8e19.)"""
    if not tensors:
        return torch.ones((), dtype=torch.bool, device=device)
    return torch.isfinite(torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64))).all()


def all_reduce_mean(values: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    if dims.dp > 1:
        values = values.clone()
        dist.all_reduce(values, group=dims.group("dp"))
        values /= dims.dp
    return values


def all_reduce_sum_(t: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    if dims.dp > 1:
        dist.all_reduce(t, group=dims.group("dp"))
    return t
