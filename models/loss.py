"""Cross-entropy of a linear output head without the full logits: ``linear_cross_entropy(x_ND, w_VD, labels_N)``.

The plain path (``head(x)`` then ``F.cross_entropy(logits.float())``) holds the logits twice until the backward:
in the head's dtype and as FP32 log-probabilities, ``N x V`` each (v3_small, 4 x 2048 tokens, V = 129,280: 2.1 GB
BF16 + 4.2 GB FP32 per head, and the model has two: the main head and MTP's). Here the tokens go through in
chunks of ``CHUNK_BYTES`` of FP32 logits; each chunk's loss and its gradients (``dlogits = softmax - onehot``,
``dx = dlogits W``, ``dW += dlogitsᵀ x``) are computed at once in the forward, so only ``dx`` (the size of ``x``) and
``dW`` (the size of ``W``, accumulated in FP32 over the chunks) wait for the backward, which scales them by the
incoming gradient. Same GEMMs as the plain path's forward + backward, in the dtypes autocast gives them there
(``tests/test_linear_ce.py`` compares loss and gradients with it). Without grad (evaluation) only the loss is
computed. Labels equal to ``IGNORE`` count neither in the sum nor in the mean, as in ``F.cross_entropy``.

Shape legend: N tokens, D hidden, V vocabulary, C tokens of a chunk.
"""
from __future__ import annotations

import torch

CHUNK_BYTES = 1 << 28   # FP32 logits per chunk: 256 MiB (v3_small: 519 tokens of 129,280 words; tiny: all at once)
IGNORE = -100           # F.cross_entropy's ignore_index


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dev = x_ND.device.type
        mm = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x_ND.dtype   # the head's GEMM dtype
        w_mm = w_VD.to(mm)
        N, V = labels_N.shape[0], w_VD.shape[0]
        valid_N = labels_N != IGNORE
        scale = 1.0 / valid_N.sum().clamp_min(1).float()   # a tensor: no host sync
        dx_CD, dw_VD = [], None   # dx per chunk; dW summed in FP32 when the GEMM's dtype is narrower
        loss = torch.zeros((), dtype=torch.float32, device=x_ND.device)
        rows = max(1, CHUNK_BYTES // (4 * V))
        with torch.autocast(dev, enabled=False):   # the dtypes are explicit below
            for s in range(0, N, rows):
                x_CD, lab_C, ok_C = x_ND[s:s + rows].to(mm), labels_N[s:s + rows], valid_N[s:s + rows]
                logits_CV = (x_CD @ w_mm.t()).float()   # as _ce: the head's output, then FP32
                lse_C = torch.logsumexp(logits_CV, dim=-1)
                target_C = logits_CV.gather(1, lab_C.clamp_min(0).unsqueeze(1)).squeeze(1)
                loss += ((lse_C - target_C) * ok_C).sum()
                if not (need_x or need_w):
                    continue
                d_CV = torch.exp(logits_CV.sub_(lse_C.unsqueeze(1)))   # softmax, in place of the logits
                d_CV.scatter_add_(1, lab_C.clamp_min(0).unsqueeze(1), -torch.ones_like(lse_C).unsqueeze(1))
                d_CV = d_CV.mul_((ok_C.float() * scale).unsqueeze(1)).to(mm)   # dlogits as the head's backward gets it
                if need_x:
                    dx_CD.append(d_CV @ w_mm)
                if need_w:
                    dw = (d_CV.t() @ x_CD).float()
                    dw_VD = dw if dw_VD is None else dw_VD.add_(dw)
        dx_ND = None if not dx_CD else (dx_CD[0] if len(dx_CD) == 1 else torch.cat(dx_CD)).to(x_ND.dtype)
        ctx.save_for_backward(dx_ND, None if dw_VD is None else dw_VD.to(w_VD.dtype))
        return loss * scale

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        dx_ND, dw_VD = ctx.saved_tensors
        return (None if dx_ND is None else dx_ND * grad_loss.to(dx_ND.dtype),
                None if dw_VD is None else dw_VD * grad_loss.to(dw_VD.dtype), None)


def linear_cross_entropy(x_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``x @ w.T`` against ``labels`` (see the module docstring)."""
    return LinearCrossEntropy.apply(x_ND, w_VD, labels_N)
