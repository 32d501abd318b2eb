"""The output heads' cross-entropy in ``tools.roofline``: each ``train.head_loss`` whose kernels torch cannot see
(``parallel.head_loss``), recorded as the kernels CUDA runs. ``head_losses(recorder)`` covers both: ``fused``
(``_FusedCrossEntropy``) and ``inplace`` (``kernels.cross_entropy._HeadCrossEntropy`` with its Triton launches
recorded: ``_CrossEntropyLaunch``, ``_ScaleLaunch``)."""
from __future__ import annotations

import contextlib
import types

import torch

from .roofline import Recorder, _paused


class _FusedCrossEntropy(torch.autograd.Function):
    """``kernels/cross_entropy.py`` as CUDA runs it (``train.head_loss=fused``): one kernel forward (reads the
    logits, writes a loss and a log-sum-exp per row), one backward (reads the logits, writes dlogits), recorded
    as such; the reductions of the mean are small ops of their own."""

    @staticmethod
    def forward(ctx, logits, labels, recorder):
        rows = logits.new_empty(2, logits.shape[0], dtype=torch.float32)
        ctx.save_for_backward(logits)
        ctx.recorder = recorder
        recorder.record("cross-entropy forward", None, (logits, labels), {}, rows, 0.0)
        return rows[0].sum()

    @staticmethod
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        dlogits = torch.empty_like(logits)
        ctx.recorder.record("cross-entropy backward", None, (logits,), {}, dlogits, 0.0)
        return dlogits, None, None


@contextlib.contextmanager
def fused_cross_entropy(recorder: Recorder):
    """``parallel.head_loss``'s cross-entropy (the fused head's) replaced by ``_FusedCrossEntropy``."""
    from parallel import head_loss

    def ce(logits, labels):
        with _paused(recorder):
            return _FusedCrossEntropy.apply(logits, labels, recorder)

    original, head_loss.cross_entropy = head_loss.cross_entropy, ce
    try:
        yield
    finally:
        head_loss.cross_entropy = original


class _CrossEntropyLaunch:
    """A Triton kernel of ``kernels/cross_entropy.py`` launched as ``kernel[grid](logits, labels, loss, ...)``,
    recorded as one ``cross-entropy forward``: reads the logits; writes the per-row losses, and the logits' buffer
    again where the kernel writes the gradient over it (``_ce_fwd_grad_kernel``)."""

    def __init__(self, recorder: Recorder, in_place: bool):
        self.recorder, self.in_place = recorder, in_place

    def __getitem__(self, grid):
        return self

    def __call__(self, logits, labels, loss, *args, **kwargs):
        written = (logits, loss) if self.in_place else (loss, args[0])   # args[0]: the scale, or the log-sum-exp
        self.recorder.record("cross-entropy forward", None, (logits, labels), {}, written, 0.0)


class _ScaleLaunch(_CrossEntropyLaunch):
    """``kernels.cross_entropy._scale_kernel[grid](src, g, dst, ...)``: an elementwise pass, read and written."""

    def __init__(self, recorder: Recorder):
        super().__init__(recorder, False)

    def __call__(self, src, g, dst, *args, **kwargs):
        self.recorder.record("aten.mul", None, (src, g), {}, dst, 0.0)


@contextlib.contextmanager
def inplace_cross_entropy(recorder: Recorder):
    """``train.head_loss=inplace`` as CUDA runs it: ``kernels.cross_entropy._HeadCrossEntropy`` with its kernels
    recorded (``_CrossEntropyLaunch``); its GEMMs and small ops record themselves."""
    from kernels import cross_entropy as ce
    from parallel import head_loss
    launches = types.SimpleNamespace(_ce_fwd_grad_kernel=_CrossEntropyLaunch(recorder, True),
                                     _ce_fwd_kernel=_CrossEntropyLaunch(recorder, False),
                                     _scale_kernel=_ScaleLaunch(recorder))

    def head_ce(x, w, labels):
        return ce._HeadCrossEntropy.apply(x, w, labels, None)

    saved = ce._kernels, head_loss.head_cross_entropy
    ce._kernels, head_loss.head_cross_entropy = (lambda: launches), head_ce
    try:
        yield
    finally:
        ce._kernels, head_loss.head_cross_entropy = saved


@contextlib.contextmanager
def head_losses(recorder: Recorder):
    """``fused_cross_entropy`` and ``inplace_cross_entropy`` at once."""
    with fused_cross_entropy(recorder), inplace_cross_entropy(recorder):
        yield
