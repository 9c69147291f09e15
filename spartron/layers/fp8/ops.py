"""The FP8 GEMMs as torch.library ops with registered autograd: `spartron_fp8::linear` (a dense
linear, x @ w^T) and `spartron_fp8::grouped_mm` (rows grouped by expert, x[rows of e] @ w[e]^T).

Both quantise inside (1x128 activations, 128x128 weights) and run their backward, dgrad and wgrad, in FP8 too
(spartron.layers.fp8.quant: the tilings; `fp8_wgrad` False: the wgrad in the inputs' dtype). They save their bf16
inputs for backward, like the GEMMs they replace, and are GEMM targets of the checkpoint policy
(spartron.checkpointing.policy DEFAULT_TARGETS): selective AC keeps their outputs as it keeps aten::mm's, a replay
re-runs their quantisation from the same inputs (deterministic), and offload sees the same bf16 saved tensors.
As one op each, compile and the policy see one boundary per GEMM.

`backend`: "reference" (spartron.layers.fp8.reference, any device), "triton" (Spartron's kernels,
Hopper), "torch_scaled_mm" (the dense GEMMs and the experts' wgrad through torch's blockwise `scaled_mm`,
the wgrad as a loop over the experts: torch has no sm90 blockwise grouped GEMM; spartron.layers.fp8.scaled_mm_backend),
"deep_gemm" (fprop and dgrad on DeepGEMM, the experts' and the dense linears' (one group), the rest as "triton":
spartron.layers.fp8.deep_gemm_backend).
"""

from __future__ import annotations

import torch
from torch import Tensor

from spartron.layers.fp8 import gemms

BACKENDS = ("reference", "triton", "torch_scaled_mm", "deep_gemm")


def backend_impl(backend: str):
    """The primitives module of `backend`."""
    if backend == "reference":
        from spartron.layers.fp8 import reference as impl
    elif backend == "triton":
        from spartron.layers.fp8 import triton_backend as impl
    elif backend == "torch_scaled_mm":
        from spartron.layers.fp8 import scaled_mm_backend as impl
    elif backend == "deep_gemm":
        from spartron.layers.fp8 import deep_gemm_backend as impl
    else:
        raise ValueError(f"model.fp8.backend must be one of {BACKENDS}, got {backend!r}")
    return impl


# --- grouped ------------------------------------------------------------------------------------

@torch.library.custom_op("spartron_fp8::grouped_mm", mutates_args=())
def grouped_mm(x: Tensor, w: Tensor, counts: Tensor, backend: str, pow2: bool, fp8_wgrad: bool) -> Tensor:
    """x [M, K] grouped by `counts` [E] (int32), w [E, N, K] -> [M, N] in x's dtype."""
    return gemms.forward(backend_impl(backend), x, w, counts, pow2)


@grouped_mm.register_fake
def _(x, w, counts, backend, pow2, fp8_wgrad):
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("spartron_fp8::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(grad: Tensor, x: Tensor, w: Tensor, counts: Tensor, backend: str,
                        pow2: bool, fp8_wgrad: bool) -> tuple[Tensor, Tensor]:
    return gemms.backward(backend_impl(backend), grad.contiguous(), x, w, counts, pow2, fp8_wgrad)


@grouped_mm_backward.register_fake
def _(grad, x, w, counts, backend, pow2, fp8_wgrad):
    return torch.empty_like(x), torch.empty_like(w)


def _grouped_setup(ctx, inputs, output):
    x, w, counts, backend, pow2, fp8_wgrad = inputs
    ctx.save_for_backward(x, w, counts)
    ctx.backend, ctx.pow2, ctx.fp8_wgrad = backend, pow2, fp8_wgrad


def _grouped_backward(ctx, grad):
    x, w, counts = ctx.saved_tensors
    dx, dw = grouped_mm_backward(grad, x, w, counts, ctx.backend, ctx.pow2, ctx.fp8_wgrad)
    return dx, dw, None, None, None, None


grouped_mm.register_autograd(_grouped_backward, setup_context=_grouped_setup)


# --- dense --------------------------------------------------------------------------------------

def _dense_forward(x2d: Tensor, w: Tensor, backend: str, pow2: bool, cached: list[Tensor]) -> Tensor:
    impl = backend_impl(backend)
    return gemms.forward(impl, x2d, w.unsqueeze(0), impl.one_group(x2d), pow2, cached[0:2])


def _dense_backward(g2d: Tensor, x2d: Tensor, w: Tensor, backend: str, pow2: bool,
                    fp8_wgrad: bool, cached: list[Tensor]) -> tuple[Tensor, Tensor]:
    impl = backend_impl(backend)
    dx, dw = gemms.backward(impl, g2d, x2d, w.unsqueeze(0), impl.one_group(x2d), pow2, fp8_wgrad,
                            cached[2:4] or None)
    return dx, dw.squeeze(0)


@torch.library.custom_op("spartron_fp8::linear", mutates_args=())
def linear(x: Tensor, w: Tensor, backend: str, pow2: bool, fp8_wgrad: bool,
           cached: list[Tensor]) -> Tensor:
    """x [..., K] @ w[N, K]^T -> [..., N] in x's dtype. `cached`: w's blocks as gemms.weight_blocks lays them out
    for one weight, [q, s, q^T, s^T] with a leading dim of 1 (model.fp8.param_gather's gathered FP8 weight;
    empty: quantised here)."""
    return _dense_forward(x.reshape(-1, x.shape[-1]), w, backend, pow2, cached).reshape(*x.shape[:-1],
                                                                                                w.shape[0])


@linear.register_fake
def _(x, w, backend, pow2, fp8_wgrad, cached):
    return x.new_empty(*x.shape[:-1], w.shape[0])


@torch.library.custom_op("spartron_fp8::linear_backward", mutates_args=())
def linear_backward(grad: Tensor, x: Tensor, w: Tensor, backend: str, pow2: bool,
                    fp8_wgrad: bool, cached: list[Tensor]) -> tuple[Tensor, Tensor]:
    dx, dw = _dense_backward(grad.reshape(-1, grad.shape[-1]).contiguous(), x.reshape(-1, x.shape[-1]), w,
                             backend, pow2, fp8_wgrad, cached)
    return dx.reshape(x.shape), dw


@linear_backward.register_fake
def _(grad, x, w, backend, pow2, fp8_wgrad, cached):
    return torch.empty_like(x), torch.empty(w.shape, dtype=w.dtype, device=w.device)


def _linear_setup(ctx, inputs, output):
    x, w, backend, pow2, fp8_wgrad, cached = inputs
    ctx.save_for_backward(x, w)
    ctx.backend, ctx.pow2, ctx.fp8_wgrad, ctx.cached = backend, pow2, fp8_wgrad, cached


def _linear_backward(ctx, grad):
    x, w = ctx.saved_tensors
    dx, dw = linear_backward(grad, x, w, ctx.backend, ctx.pow2, ctx.fp8_wgrad, ctx.cached)
    return dx, dw, None, None, None, [None] * len(ctx.cached)


linear.register_autograd(_linear_backward, setup_context=_linear_setup)
