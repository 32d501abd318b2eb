"""The Triton kernels of ``cross_entropy.py`` (imported by it after ``kernels.configure()``). Reductions name
their combine functions (``tl.reduce``) instead of ``tl.max``/``tl.sum``: see ``quant._amax``."""
import triton
import triton.language as tl

from .gemm import round_output


@triton.jit
def _row_loss(base, label, V, IGNORE: tl.constexpr, BLOCK_V: tl.constexpr):
    """One row's log-sum-exp, and its loss (0 if the label is ``IGNORE``), in one pass over the row."""
    offs = tl.arange(0, BLOCK_V)
    top = tl.full((BLOCK_V,), -float("inf"), tl.float32)     # per lane: running max and sum of exp(x - max)
    acc = tl.full((BLOCK_V,), 0.0, tl.float32)
    for v in range(0, V, BLOCK_V):
        x = tl.load(base + v + offs, mask=v + offs < V, other=-float("inf")).to(tl.float32)
        new = tl.maximum(top, x)
        seen = new > -float("inf")                              # a lane past V in every block so far stays empty
        acc = tl.where(seen, acc * tl.exp(top - new) + tl.exp(x - new), 0.0)
        top = new
    row_max = tl.reduce(top, 0, tl.standard._elementwise_max)
    lse = row_max + tl.log(tl.reduce(tl.where(top > -float("inf"), acc * tl.exp(top - row_max), 0.0), 0,
                                     tl.standard._sum_combine))
    valid = label != IGNORE
    target = tl.load(base + tl.where(valid, label, 0)).to(tl.float32)
    return lse, tl.where(valid, lse - target, 0.0)


@triton.jit
def _row_grad(base, dbase, label, lse, g, V, BLOCK_V: tl.constexpr):
    """``dlogits = (softmax - onehot) * g`` of one row, in the dtype of ``dbase`` (which may be ``base``)."""
    offs = tl.arange(0, BLOCK_V)
    for v in range(0, V, BLOCK_V):
        cols = v + offs
        x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        d = tl.where(cols == label, p - 1.0, p) * g
        tl.store(dbase + cols, round_output(d, dbase), mask=cols < V)


@triton.jit
def _ce_fwd_kernel(logits_ptr, labels_ptr, loss_ptr, lse_ptr, V, stride_n, IGNORE: tl.constexpr,
                   BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lse, loss = _row_loss(logits_ptr + row * stride_n, tl.load(labels_ptr + row), V, IGNORE, BLOCK_V)
    tl.store(loss_ptr + row, loss)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _ce_bwd_kernel(logits_ptr, labels_ptr, lse_ptr, scale_ptr, dlogits_ptr, V, stride_n, stride_dn,
                   IGNORE: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row)
    g = tl.where(label != IGNORE, tl.load(scale_ptr), 0.0)   # d loss / d loss_row: grad / n_valid, 0 if ignored
    _row_grad(logits_ptr + row * stride_n, dlogits_ptr + row * stride_dn, label, tl.load(lse_ptr + row), g, V,
              BLOCK_V)


@triton.jit
def _ce_fwd_grad_kernel(logits_ptr, labels_ptr, loss_ptr, scale_ptr, V, stride_n, IGNORE: tl.constexpr,
                        BLOCK_V: tl.constexpr):
    """The loss, then the row's gradient (``scale`` per valid row) written over its logits: the row is read
    twice, the second time mostly from L2 (one row per program), and written once."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_n
    label = tl.load(labels_ptr + row)
    lse, loss = _row_loss(base, label, V, IGNORE, BLOCK_V)
    tl.store(loss_ptr + row, loss)
    _row_grad(base, base, label, lse, tl.where(label != IGNORE, tl.load(scale_ptr), 0.0), V, BLOCK_V)


@triton.jit
def _scale_kernel(src_ptr, g_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """``dst = src * g`` in FP32, rounded once to the dtype of ``dst`` (``g``: one FP32 value)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(dst_ptr + offs, round_output(x * tl.load(g_ptr), dst_ptr), mask=offs < n)
