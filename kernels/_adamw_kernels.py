"""The Triton kernels of ``adamw.py`` (imported by it after ``kernels.configure()``). Divisions and the square root
are the IEEE-rounded ones (``div_rn``, ``sqrt_rn``; Triton's ``/`` and ``sqrt`` are approximate on NVIDIA), so
the update is torch's to FP32 rounding; BF16 stores round to nearest even (``gemm.round_output``)."""
import triton
import triton.language as tl

from .gemm import round_output


@triton.jit
def _update(offs, mask, master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, coef_ptr, decay, lerp_w, beta2,
            one_minus_beta2, step_size, bc2_sqrt, eps, HAS_COEF: tl.constexpr, HAS_OUT: tl.constexpr):
    """The update of the elements ``offs`` (``mask``) of one tensor: the maths of ``adamw.py``'s docstring."""
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_COEF:
        g = g * tl.load(coef_ptr)                                   # the clip coefficient, a device scalar
    p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = p * decay                                                   # decoupled weight decay: p *= 1 - lr·wd
    d = g - m                                                       # m.lerp_(g, w), torch's two-sided formula
    m = tl.where(lerp_w < 0.5, m + lerp_w * d, g - d * (1.0 - lerp_w))
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + (-step_size) * tl.div_rn(m, denom)
    tl.store(master_ptr + offs, p, mask=mask)
    tl.store(exp_avg_ptr + offs, round_output(m, exp_avg_ptr), mask=mask)
    tl.store(exp_avg_sq_ptr + offs, round_output(v, exp_avg_sq_ptr), mask=mask)
    if HAS_OUT:
        tl.store(out_ptr + offs, round_output(p, out_ptr), mask=mask)


@triton.jit
def _adamw_kernel(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, coef_ptr, n, decay, lerp_w, beta2,
                  one_minus_beta2, step_size, bc2_sqrt, eps, HAS_COEF: tl.constexpr, HAS_OUT: tl.constexpr,
                  BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _update(offs, offs < n, master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, coef_ptr, decay, lerp_w,
            beta2, one_minus_beta2, step_size, bc2_sqrt, eps, HAS_COEF, HAS_OUT)


@triton.jit
def _adamw_many_kernel(ptrs, chunk_tensor, chunk_start, numels, coef_ptr, decay, lerp_w, beta2, one_minus_beta2,
                       step_size, bc2_sqrt, eps, G_DTYPE: tl.constexpr, M_DTYPE: tl.constexpr,
                       V_DTYPE: tl.constexpr, O_DTYPE: tl.constexpr, HAS_COEF: tl.constexpr, HAS_OUT: tl.constexpr,
                       BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Many tensors in one launch: program ``c`` updates ``CHUNK`` elements of tensor ``chunk_tensor[c]`` from
    ``chunk_start[c]``; ``ptrs[t]``: the addresses of tensor ``t``'s master, gradient, moments and output."""
    c = tl.program_id(0)
    t = tl.load(chunk_tensor + c).to(tl.int64)
    start = tl.load(chunk_start + c)
    n = tl.load(numels + t)
    master_ptr = tl.load(ptrs + 5 * t).to(tl.pointer_type(tl.float32))
    grad_ptr = tl.load(ptrs + 5 * t + 1).to(tl.pointer_type(G_DTYPE))
    exp_avg_ptr = tl.load(ptrs + 5 * t + 2).to(tl.pointer_type(M_DTYPE))
    exp_avg_sq_ptr = tl.load(ptrs + 5 * t + 3).to(tl.pointer_type(V_DTYPE))
    out_ptr = tl.load(ptrs + 5 * t + 4).to(tl.pointer_type(O_DTYPE))
    for i in range(0, CHUNK, BLOCK):
        offs = start + i + tl.arange(0, BLOCK)
        _update(offs, offs < n, master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, coef_ptr, decay, lerp_w,
                beta2, one_minus_beta2, step_size, bc2_sqrt, eps, HAS_COEF, HAS_OUT)


@triton.jit
def _sum_squares_many_kernel(ptrs, chunk_tensor, chunk_start, numels, out_ptr, DTYPE: tl.constexpr,
                             BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """``out[c]``: the sum of squares, in FP64, of the ``CHUNK`` elements of tensor ``chunk_tensor[c]`` from
    ``chunk_start[c]`` (an inf or nan stays one); ``ptrs[t]``: tensor ``t``'s address."""
    c = tl.program_id(0)
    t = tl.load(chunk_tensor + c).to(tl.int64)
    start = tl.load(chunk_start + c)
    n = tl.load(numels + t)
    x_ptr = tl.load(ptrs + t).to(tl.pointer_type(DTYPE))
    acc = tl.full((BLOCK,), 0.0, tl.float64)
    for i in range(0, CHUNK, BLOCK):
        offs = start + i + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float64)
        acc += x * x
    # tl.sum's combine function: triton.language's @jit helpers fail under the interpreter (quant._amax)
    tl.store(out_ptr + c, tl.reduce(acc, 0, tl.standard._sum_combine))
