"""Triton kernels of the AdamW update with the gradient-clip coefficient folded in (adamw_triton.py launches them).

One pass per element: read param, grad, exp_avg, exp_avg_sq, compute in fp32 registers, write param, exp_avg,
exp_avg_sq in their own dtypes (the gradient is only read). With HAS_COPY the parameter is an fp32 master
(spartron.runtime.master_weights) and the pass also writes its copy in the compute dtype (`w`, rounded to
nearest even as torch's `.to(torch.bfloat16)` rounds): the bf16 weight costs no pass of its own. The math follows
torch.optim.AdamW's single-tensor update operation by operation on the clipped gradient (decoupled decay, lerp,
mul/addcmul, sqrt / sqrt(bc2) + eps, addcdiv), with correctly rounded sqrt and division (torch's CUDA division by
the Python float sqrt(bc2) multiplies by its fp32 reciprocal: a rounding apart, within the tests' bound).

Every rounding is written in the source: the launchers pass ``enable_fp_fusion=False`` (no multiply-add the
compiler contracts on its own), and `tl.fma` stands where torch's CUDA kernels contract a multiply-add (lerp's
``self + w * (end - self)``, addcmul's ``a + value * (b * c)``, addcdiv's ``a + value * (b / c)``). Why: with fusion
on, the compiler may fold the clip multiply ``g * scale`` into lerp's ``g - m`` (one rounding fewer than torch, which
stores the clipped gradient before the update); lerp cancels where ``m`` turns sign, so that half-ulp of ``g`` is a
large relative difference of a small ``exp_avg`` (up to 7.6e-5 on 2 of 2112 elements on the H100, issue 38). Now
the compiled kernel computes exactly what Triton's interpreter computes from this source (IEEE fp32).

`adamw_table_kernel` serves many tensors in one launch: a program reads its tensor from the block map, and that
tensor's addresses and size from an int64 table, cast to pointers here. Pointers loaded from memory carry no
alignment, so when the launcher has checked that every base address is 16-byte aligned and every size a
multiple of 16 (ALIGNED) the kernel says so, which is what lets Triton emit 16-byte loads and stores.
`adamw_tensor_kernel` is the same update for one tensor passed directly (Triton specialises its pointers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
TABLE_COLUMNS = tl.constexpr(7)  # param, grad, exp_avg, exp_avg_sq addresses; numel; first block; copy address


@triton.jit
def _update(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs, mask, scale, decay, w1, beta2, w2, eps, neg_step_size, bc2_sqrt,
            HAS_SCALE: tl.constexpr, HAS_DECAY: tl.constexpr, LERP_SMALL: tl.constexpr, HAS_COPY: tl.constexpr):
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
    if HAS_SCALE:
        g = g * scale  # the clipped gradient, rounded to fp32 as torch's clip stores it
    if HAS_DECAY:
        p = p * decay  # param.mul_(1 - lr * wd)
    if LERP_SMALL:  # exp_avg.lerp_(g, w1): torch.lerp's two forms (weight < 0.5 or not)
        m = tl.fma(w1, g - m, m)
    else:
        m = tl.fma(m - g, 1.0 - w1, g)
    v = tl.fma(w2, g * g, v * beta2)  # exp_avg_sq.mul_(beta2).addcmul_(g, g, value=w2): torch squares g first
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = tl.fma(neg_step_size, tl.div_rn(m, denom), p)  # param.addcdiv_(exp_avg, denom, value=-step_size)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
    if HAS_COPY:
        tl.store(w_ptr + offs, p.to(w_ptr.dtype.element_ty), mask=mask)


@triton.jit
def adamw_table_kernel(table_ptr, block_tensor_ptr, coef_ptr, scale_ptr, decay, w1, beta2, w2, eps,
                       P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, M_DTYPE: tl.constexpr, V_DTYPE: tl.constexpr,
                       W_DTYPE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_DECAY: tl.constexpr,
                       LERP_SMALL: tl.constexpr, HAS_COPY: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
                       ITERS: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(block_tensor_ptr + pid).to(tl.int64)
    row = table_ptr + t * TABLE_COLUMNS
    p_ptr = tl.load(row).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(G_DTYPE))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(M_DTYPE))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(V_DTYPE))
    n = tl.load(row + 4)
    w_ptr = p_ptr
    if HAS_COPY:
        w_ptr = tl.load(row + 6).to(tl.pointer_type(W_DTYPE))
    if ALIGNED:
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        w_ptr = tl.multiple_of(w_ptr, 16)
        n = tl.multiple_of(n, 16)
    start = (pid - tl.load(row + 5)) * (BLOCK * ITERS)
    neg_step_size = tl.load(coef_ptr + t * 2)
    bc2_sqrt = tl.load(coef_ptr + t * 2 + 1)
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(scale_ptr)
    for i in tl.range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        _update(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs, offs < n, scale, decay, w1, beta2, w2, eps, neg_step_size,
                bc2_sqrt, HAS_SCALE, HAS_DECAY, LERP_SMALL, HAS_COPY)


@triton.jit
def adamw_tensor_kernel(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, n, coef_ptr, scale_ptr, decay, w1, beta2, w2, eps,
                        HAS_SCALE: tl.constexpr, HAS_DECAY: tl.constexpr, LERP_SMALL: tl.constexpr,
                        HAS_COPY: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    neg_step_size = tl.load(coef_ptr)
    bc2_sqrt = tl.load(coef_ptr + 1)
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(scale_ptr)
    for i in tl.range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        _update(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs, offs < n, scale, decay, w1, beta2, w2, eps, neg_step_size,
                bc2_sqrt, HAS_SCALE, HAS_DECAY, LERP_SMALL, HAS_COPY)
