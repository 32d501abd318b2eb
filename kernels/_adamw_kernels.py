"""The Triton kernel of ``adamw.py`` (imported by it after ``kernels.configure()``). Divisions and the square root
are the IEEE-rounded ones (``div_rn``, ``sqrt_rn``; Triton's ``/`` and ``sqrt`` are approximate on NVIDIA), so
the update is torch's to FP32 rounding; BF16 stores round to nearest even (``gemm.round_output``)."""
import triton
import triton.language as tl

from .gemm import round_output


@triton.jit
def _adamw_kernel(master_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, coef_ptr, n, decay, lerp_w, beta2,
                  one_minus_beta2, step_size, bc2_sqrt, eps, HAS_COEF: tl.constexpr, HAS_OUT: tl.constexpr,
                  SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_COEF:
        g = g * tl.load(coef_ptr)                                   # the clip coefficient, a device scalar
    if SPLIT:   # the FP32 master is the BF16 weight (out) and 16 low bits (master_ptr): adamw.join_master
        high = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
        low = tl.load(master_ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        p = ((high - ((low > 0x8000).to(tl.int32) << 16)) | low).to(tl.float32, bitcast=True)
    else:
        p = tl.load(master_ptr + offs, mask=mask, other=0.0)
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = p * decay                                                   # decoupled weight decay: p *= 1 - lr·wd
    d = g - m                                                       # m.lerp_(g, w), torch's two-sided formula
    m = tl.where(lerp_w < 0.5, m + lerp_w * d, g - d * (1.0 - lerp_w))
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + (-step_size) * tl.div_rn(m, denom)
    tl.store(exp_avg_ptr + offs, round_output(m, exp_avg_ptr), mask=mask)
    tl.store(exp_avg_sq_ptr + offs, round_output(v, exp_avg_sq_ptr), mask=mask)
    if SPLIT:   # adamw.split_master: the high half rounded half toward zero, exactly BF16; the low half as it is
        bits = p.to(tl.int32, bitcast=True)
        low = bits & 0xFFFF
        high = (bits - low) + ((low > 0x8000).to(tl.int32) << 16)
        tl.store(out_ptr + offs, high.to(tl.float32, bitcast=True).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(master_ptr + offs, (low - (low >= 0x8000).to(tl.int32) * 0x10000).to(tl.int16), mask=mask)
    else:
        tl.store(master_ptr + offs, p, mask=mask)
        if HAS_OUT:
            tl.store(out_ptr + offs, round_output(p, out_ptr), mask=mask)
