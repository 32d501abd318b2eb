"""The Triton kernels of ``cross_entropy.py`` (imported by it after ``kernels.configure()``). Reductions name
their combine functions (``tl.reduce``) instead of ``tl.max``/``tl.sum``: see ``quant._amax``."""
import triton
import triton.language as tl

from .gemm import round_output


@triton.jit
def _ce_fwd_kernel(logits_ptr, labels_ptr, loss_ptr, lse_ptr, V, stride_n, IGNORE: tl.constexpr,
                   BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_n
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
    label = tl.load(labels_ptr + row)
    valid = label != IGNORE
    target = tl.load(base + tl.where(valid, label, 0)).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - target, 0.0))
    tl.store(lse_ptr + row, lse)


@triton.jit
def _ce_bwd_kernel(logits_ptr, labels_ptr, lse_ptr, scale_ptr, dlogits_ptr, V, stride_n, stride_dn,
                   IGNORE: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_n
    dbase = dlogits_ptr + row * stride_dn
    offs = tl.arange(0, BLOCK_V)
    label = tl.load(labels_ptr + row)
    lse = tl.load(lse_ptr + row)
    g = tl.where(label != IGNORE, tl.load(scale_ptr), 0.0)   # d loss / d loss_row: grad / n_valid, 0 if ignored
    for v in range(0, V, BLOCK_V):
        cols = v + offs
        x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        d = tl.where(cols == label, p - 1.0, p) * g
        tl.store(dbase + cols, round_output(d, dlogits_ptr), mask=cols < V)
