"""Cross-entropy of a linear output head without FP32 logits: ``linear_cross_entropy(x_ND, w_VD, labels_N)``,
taken by a ``ChunkedLossHead`` (``train.head_loss=chunked``: ``parallel.head_loss`` turns the model's head into one).

The plain path (``head(x)`` then ``F.cross_entropy(logits.float())``) keeps ``N x V`` FP32 log-probabilities for
the backward and makes two more FP32 copies on the way (v3_small, 4 x 2048 tokens, V = 129,280: 4.2 GB each, per
head, and the model has two: the main head and MTP's). Here the vocabulary goes through in blocks (``CHUNK_BYTES``
of FP32 temporaries each), twice, inside the forward:

1. ``logits[:, block] = x W[block]ᵀ`` in the head's dtype (autocast's), kept; a running max and sum give each
   token's log-sum-exp in FP32, and the target logits give the loss;
2. per block, ``dlogits = softmax - onehot`` (FP32, then the head's dtype, as autograd hands it to the head's
   backward), ``dW[block] = dlogitsᵀ x`` (written once: every token is in the block) and ``dx += dlogits W[block]``
   (summed in FP32).

Only ``dx`` (the size of ``x``) and ``dW`` (the size of ``W``) wait for the backward, which scales them by the
incoming gradient; the logits (in the head's dtype, ``N x V``) live only inside the forward. Same GEMMs as the
plain path's forward + backward. Without grad (evaluation) only the loss is computed. Labels equal to ``IGNORE``
count neither in the sum nor in the mean, as in ``F.cross_entropy``.

It saves memory, not time: its elementwise passes over each block move more bytes than a fused cross-entropy
kernel (the 4-layer v3_small step on an H100: 168.7 ms, against 88.0 ms with the default ``fused`` head,
``parallel/head_loss.py``); ``chunked`` is for a batch whose BF16 logits do not fit.

Shape legend: N tokens, D hidden, V vocabulary, U words of a block.
"""
from __future__ import annotations

import torch
from torch import nn

CHUNK_BYTES = 1 << 28   # FP32 temporaries per vocabulary block: 256 MiB (8,192 tokens: blocks of 8,192 words)
IGNORE = -100           # F.cross_entropy's ignore_index


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dev = x_ND.device.type
        mm = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x_ND.dtype   # the head's GEMM dtype
        N, V = labels_N.shape[0], w_VD.shape[0]
        U = max(1, CHUNK_BYTES // (4 * max(N, 1)))
        blocks = [(v, min(v + U, V)) for v in range(0, V, U)]
        valid_N = labels_N != IGNORE
        lab_N = labels_N.clamp_min(0)
        scale = 1.0 / valid_N.sum().clamp_min(1).float()   # a tensor: no host sync
        with torch.autocast(dev, enabled=False):   # the dtypes are explicit below
            x_mm, w_mm = x_ND.to(mm), w_VD.to(mm)
            logits_NV = torch.empty(N, V, dtype=mm, device=x_ND.device)
            top_N = torch.full((N,), -float("inf"), device=x_ND.device)
            sum_N = torch.zeros(N, device=x_ND.device)
            for a, b in blocks:   # pass 1: logits, running log-sum-exp
                blk = torch.mm(x_mm, w_mm[a:b].t(), out=logits_NV[:, a:b]).float()
                new_N = torch.maximum(top_N, blk.amax(1))
                sum_N = sum_N * torch.exp(top_N - new_N) + torch.exp(blk - new_N.unsqueeze(1)).sum(1)
                top_N = new_N
            lse_N = top_N + torch.log(sum_N)
            target_N = logits_NV.gather(1, lab_N.unsqueeze(1)).squeeze(1).float()
            loss = ((lse_N - target_N) * valid_N).sum() * scale
            dx_ND = dw_VD = None
            if need_x or need_w:
                dx_ND = torch.zeros(N, x_ND.shape[1], dtype=torch.float32, device=x_ND.device) if need_x else None
                dw_VD = torch.empty(w_VD.shape, dtype=mm, device=w_VD.device) if need_w else None
                row_N = (valid_N.float() * scale).unsqueeze(1)
                for a, b in blocks:   # pass 2: this block's dlogits, its dW rows, its share of dx
                    d_NU = torch.exp(logits_NV[:, a:b].float() - lse_N.unsqueeze(1))
                    hit_N = ((lab_N >= a) & (lab_N < b)).float()   # the target is in this block (no host sync)
                    d_NU.scatter_add_(1, (lab_N - a).clamp(0, b - a - 1).unsqueeze(1), -hit_N.unsqueeze(1))
                    d_NU = d_NU.mul_(row_N).to(mm)
                    if need_w:
                        torch.mm(d_NU.t(), x_mm, out=dw_VD[a:b])
                    if need_x:
                        dx_ND += d_NU @ w_mm[a:b]
                dx_ND = None if dx_ND is None else dx_ND.to(x_ND.dtype)
                dw_VD = None if dw_VD is None else dw_VD.to(w_VD.dtype)
        ctx.save_for_backward(dx_ND, dw_VD)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        dx_ND, dw_VD = ctx.saved_tensors
        return (None if dx_ND is None else dx_ND * grad_loss.to(dx_ND.dtype),
                None if dw_VD is None else dw_VD * grad_loss.to(dw_VD.dtype), None)


def linear_cross_entropy(x_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``x @ w.T`` against ``labels`` (see the module docstring)."""
    return LinearCrossEntropy.apply(x_ND, w_VD, labels_N)


class ChunkedLossHead(nn.Linear):
    """The output head (an ``nn.Linear``: same forward, same parameters) whose cross-entropy takes
    ``linear_cross_entropy`` (``models.transformer.head_ce``)."""

    def cross_entropy(self, x_BTD: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(x_BTD.flatten(0, 1), self.weight, labels_BT.flatten())
