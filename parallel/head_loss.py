"""``train.head_loss``: how the output heads' cross-entropy is computed. One of ``HEAD_LOSSES``:

- ``plain``: ``head(x)`` then ``F.cross_entropy`` of the FP32 logits (``models.transformer._ce``);
- ``chunked``: ``models.loss.ChunkedLossHead``: the vocabulary in blocks inside the forward, no ``N x V`` tensor
  kept for the backward (less memory; slower in eager torch);
- ``fused``: ``FusedLossHead``: ``head(x)`` then the Triton cross-entropy (``kernels/cross_entropy.py``) over the
  logits in their own dtype, which keeps only them and one FP32 value per token for the backward; on a CUDA
  device where its self-check passed, else ``F.cross_entropy`` as ``plain``;
- ``inplace``: ``InplaceLossHead``: the head's GEMM and ``kernels.cross_entropy.head_cross_entropy``, which takes
  the logits' gradient in the forward, over the logits' buffer: the logits are read once instead of twice, same
  memory as ``fused`` (its kernel falls back as ``fused``'s). Opt-in until a GPU has timed it against ``fused``
  (``bench.step_variants`` variant N).

``apply_head_loss`` swaps the class of the model's plain linear head in place (same Parameter); a head that FP8,
deferred Wgrad or pipeline stages wrap or replace afterwards computes its loss as ``plain`` does. The model
reaches a head's own loss through its ``cross_entropy(x, labels)`` method (``models.transformer.head_ce``).
"""
from __future__ import annotations

import torch
from torch import nn

from kernels.cross_entropy import cross_entropy, head_cross_entropy
from models.loss import ChunkedLossHead

HEAD_LOSSES = ("plain", "chunked", "fused", "inplace")


class FusedLossHead(nn.Linear):
    """The output head (an ``nn.Linear``: same forward, same parameters) whose cross-entropy is
    ``kernels.cross_entropy`` of its logits."""

    def cross_entropy(self, x_BTD: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
        return cross_entropy(self(x_BTD).flatten(0, 1), labels_BT.flatten())


class InplaceLossHead(nn.Linear):
    """The output head (an ``nn.Linear``: same forward, same parameters) whose cross-entropy is
    ``kernels.cross_entropy.head_cross_entropy`` of its input and weight."""

    def cross_entropy(self, x_BTD: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
        return head_cross_entropy(x_BTD.flatten(0, 1), self.weight, labels_BT.flatten())


def apply_head_loss(model: nn.Module, kind: str) -> None:
    """Make the model's plain linear head the class of ``kind`` (module docstring)."""
    if kind not in HEAD_LOSSES:
        raise ValueError(f"train.head_loss: {kind!r} is not one of {HEAD_LOSSES}")
    if kind != "plain" and type(model.head) is nn.Linear and model.head.bias is None:
        model.head.__class__ = {"chunked": ChunkedLossHead, "fused": FusedLossHead,
                                "inplace": InplaceLossHead}[kind]
