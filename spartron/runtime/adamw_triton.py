"""AdamW whose update is one Triton pass over each group of tensors, with the gradient-clip coefficient applied in
that same pass (`train.adamw_kernel = "triton"`).

`TritonAdamW` is a torch.optim.AdamW built with fused=True of which only `step` is replaced: its parameter groups
and per-parameter state (``step`` a float32 0-dim tensor on the parameter's device, ``exp_avg`` / ``exp_avg_sq``
like the parameter, or in `moments_dtype`) are torch's fused AdamW's, so state_dict, load_state_dict and saved
states are the same whichever kernel wrote them. The update is torch's AdamW formula in fp32 registers, every
rounding written in the source and none added by the compiler (adamw_triton_kernels.py, compiled with
enable_fp_fusion=False); `step(grad_scale=c)` multiplies each gradient by the 0-dim tensor c as it is read (the clip
coefficient: one read of the gradients instead of a clip pass plus the update's). The gradients themselves are left
unscaled.

Tensors of a parameter group are launched together per (device, param / grad / exp_avg / exp_avg_sq dtypes,
16-byte alignment): one launch for all of them (a pointer table and a block -> tensor map), or, from
`AdamWKernelConfig.per_tensor_min_numel` elements up, one launch per tensor. The bias corrections are computed
on the device from each tensor's own step in float64, as torch computes them on the host, so nothing syncs.
Triton is imported only when a TritonAdamW is built. `_tensors` says what one parameter's update reads and writes;
spartron.runtime.master_weights.MasterAdamW overrides it to update an fp32 master and write the bf16 parameter
(a fifth tensor, the copy) in the same pass.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from spartron.optional import require

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ALIGN_BYTES = 16  # and sizes a multiple of 16 elements: what the table kernel's ALIGNED hints promise
_UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable")
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class AdamWKernelConfig:
    """Elements per block and blocks per program, warps per program, and the size from which a tensor gets a
    launch of its own (None: every tensor of a bucket in one table launch)."""

    block: int = 1024
    iters: int = 8
    num_warps: int = 4
    per_tensor_min_numel: int | None = None

    def __post_init__(self) -> None:
        if self.block < 16 or self.block & (self.block - 1):
            raise ValueError(f"AdamWKernelConfig.block must be a power of two >= 16, got {self.block}")
        if self.iters < 1 or self.num_warps < 1:
            raise ValueError(f"AdamWKernelConfig.iters and num_warps must be >= 1, got {self.iters}, {self.num_warps}")


def _kernels() -> ModuleType:
    require("triton", "train.adamw_kernel = 'triton' (or 'auto' with CUDA parameters)",
            "pip install triton (it ships with CUDA builds of torch)")
    return importlib.import_module("spartron.runtime.adamw_triton_kernels")


def _aligned(tensors: tuple[Tensor, ...]) -> bool:
    return tensors[0].numel() % 16 == 0 and all(t.data_ptr() % _ALIGN_BYTES == 0 for t in tensors)


class TritonAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (fused=True state and groups) updated by Triton kernels; see the module docstring.

    `moments_dtype` (train.adamw_moments_dtype): exp_avg / exp_avg_sq stored in this dtype instead of the updated
    tensor's (bf16 beside fp32 masters, DeepSeek-V3's recipe); the kernels load them into fp32 registers and round
    them to nearest even when they store them, and a loaded state is cast back to it. `reference` (no CUDA, or
    train.adamw_kernel = "torch" where torch's own AdamW cannot serve): the same update in torch operations
    (`_reference_group`), which imports no Triton."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, kernel: AdamWKernelConfig | None = None, reference: bool = False,
                 moments_dtype: torch.dtype | None = None) -> None:
        if moments_dtype is not None and moments_dtype not in KERNEL_DTYPES:
            raise ValueError(f"TritonAdamW: moments_dtype {moments_dtype} is not one of float32, bfloat16, float16")
        self.reference, self.moments_dtype = reference, moments_dtype
        self._triton = self._load_kernels()
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
        self.kernel = kernel or AdamWKernelConfig()
        self._block_maps: dict[tuple, Tensor] = {}  # (device, sizes, elements per program) -> block -> tensor

    def _load_kernels(self) -> ModuleType | None:
        return None if self.reference else _kernels()

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: Tensor | None = None):  # noqa: ANN001, ANN201 - torch.optim signature
        """One AdamW step; `grad_scale` (a one-element tensor, e.g. the clip coefficient) multiplies every gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is not None and grad_scale.numel() != 1:
            raise ValueError(f"TritonAdamW.step: grad_scale must have one element, got shape {tuple(grad_scale.shape)}")
        for group in self.param_groups:
            if self.reference:
                _reference_group(self, group, grad_scale)
            else:
                self._step_group(group, grad_scale)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, then each state tensor kept in another dtype than its parameter's (`_state_dtype`) taken again
        from `state_dict` in that dtype: torch casts every floating state tensor to its parameter's dtype, and a
        cast back would round what that dtype cannot hold (fp32 moments beside bf16 parameters)."""
        super().load_state_dict(state_dict)
        saved = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        for key, p in zip(saved, self._params(), strict=True):
            for name, value in state_dict["state"].get(key, {}).items():
                dtype = self._state_dtype(name)
                if dtype is not None and isinstance(value, Tensor):
                    self.state[p][name] = value.detach().to(p.device, dtype, copy=True)

    def _state_dtype(self, name: str) -> torch.dtype | None:
        """The dtype state `name` is kept in; None: its parameter's (torch's rule)."""
        return self.moments_dtype if name in MOMENTS else None

    def _params(self) -> Iterable[Tensor]:
        return chain.from_iterable(g["params"] for g in self.param_groups)

    def _new_state(self, p: Tensor) -> dict:
        """A parameter's first state: step 0 (float32, on its device) and zero moments shaped like the updated
        tensor, in `moments_dtype` or its dtype."""
        like = self._updated(p)
        dtype = self.moments_dtype or like.dtype
        return {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                **{name: torch.zeros_like(like, dtype=dtype, memory_format=torch.preserve_format) for name in MOMENTS}}

    def _step_group(self, group: dict, grad_scale: Tensor | None) -> None:
        from torch.distributed.tensor import DTensor

        for key in _UNSUPPORTED:
            if group.get(key):
                raise ValueError(f"TritonAdamW does not implement {key}=True")
        if any(isinstance(group[k], Tensor) for k in ("lr", "weight_decay", "eps")) or \
                any(isinstance(b, Tensor) for b in group["betas"]):
            raise ValueError("TritonAdamW takes float lr, betas, eps and weight_decay (no tensors)")
        buckets: dict[tuple, list[tuple[tuple[Tensor, ...], Tensor]]] = {}
        steps = []
        for p in group["params"]:
            grad = self._grad(p)
            if grad is None:
                continue
            if grad.is_sparse:
                raise ValueError("TritonAdamW does not take sparse gradients")
            state = self.state[p]
            if not state:
                state.update(self._new_state(p))
            elif state["step"].device != p.device or state["step"].dtype != torch.float32:
                state["step"] = state["step"].to(p.device, torch.float32)  # a state loaded from a non-fused AdamW
            tensors = tuple(t.to_local() if isinstance(t, DTensor) else t for t in self._tensors(p, state))
            _check(tensors)
            steps.append(state["step"])
            if tensors[0].numel():
                key = (tensors[0].device, *(t.dtype for t in tensors), _aligned(tensors))
                buckets.setdefault(key, []).append((tensors, state["step"]))
        if not steps:
            return
        torch._foreach_add_(steps, 1.0)
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        beta1, beta2 = (float(b) for b in group["betas"])
        w1 = float(torch.tensor(1 - beta1, dtype=torch.float32))  # torch.lerp picks its form on the fp32 weight
        # floats: Triton would specialise an int 1 as a constant
        scalars = dict(decay=1 - lr * wd, w1=1 - beta1, beta2=beta2, w2=1 - beta2, eps=float(group["eps"]),
                       HAS_DECAY=wd != 0, LERP_SMALL=abs(w1) < 0.5)
        big = self.kernel.per_tensor_min_numel
        for (device, *_, aligned), members in buckets.items():
            scale = None if grad_scale is None else grad_scale.detach().to(device, torch.float32)
            shared = [m for m in members if big is None or m[0][0].numel() < big]
            own = [m for m in members if big is not None and m[0][0].numel() >= big]
            coefs = _coefficients([step for _, step in shared + own], lr, beta1, beta2)
            if shared:
                self._launch_table(device, [t for t, _ in shared], coefs[:len(shared)], scale, aligned, scalars)
            for i, (tensors, _) in enumerate(own, start=len(shared)):
                self._launch_tensor(tensors, coefs[i], scale, scalars)

    def _grad(self, p: Tensor) -> Tensor | None:
        """The gradient the update reads."""
        return p.grad

    def _updated(self, p: Tensor) -> Tensor:
        """The tensor the update writes (its moments are shaped and typed like it)."""
        return p

    def _tensors(self, p: Tensor, state: dict) -> tuple[Tensor, ...]:
        """(updated tensor, gradient, exp_avg, exp_avg_sq[, its copy in the compute dtype])."""
        return p, p.grad, state["exp_avg"], state["exp_avg_sq"]

    def _launch_tensor(self, tensors: tuple[Tensor, ...], coefs: Tensor, scale: Tensor | None, scalars: dict) -> None:
        k, (p, g, m, v), copy = self.kernel, tensors[:4], tensors[4] if len(tensors) > 4 else None
        grid = (_cdiv(p.numel(), k.block * k.iters),)
        self._triton.adamw_tensor_kernel[grid](
            p, g, m, v, p if copy is None else copy, p.numel(), coefs, coefs if scale is None else scale,
            HAS_SCALE=scale is not None, HAS_COPY=copy is not None, BLOCK=k.block, ITERS=k.iters,
            num_warps=k.num_warps, enable_fp_fusion=False, **scalars)

    def _launch_table(self, device: torch.device, members: list[tuple[Tensor, ...]], coefs: Tensor,
                      scale: Tensor | None, aligned: bool, scalars: dict) -> None:
        k, kern = self.kernel, self._triton
        per_program = k.block * k.iters
        rows, counts, first = [], [], 0
        for p, g, m, v, *copy in members:
            counts.append(_cdiv(p.numel(), per_program))
            rows += [p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel(), first,
                     copy[0].data_ptr() if copy else 0]
            first += counts[-1]
        table = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        map_key = (device, tuple(t[0].numel() for t in members), per_program)
        if map_key not in self._block_maps:
            self._block_maps[map_key] = torch.repeat_interleave(
                torch.arange(len(members), dtype=torch.int32), torch.tensor(counts)).to(device)
        p, g, m, v, *w = (kern.TL_DTYPES[t.dtype] for t in members[0])
        kern.adamw_table_kernel[(first,)](
            table, self._block_maps[map_key], coefs, coefs if scale is None else scale, P_DTYPE=p, G_DTYPE=g,
            M_DTYPE=m, V_DTYPE=v, W_DTYPE=w[0] if w else p, HAS_SCALE=scale is not None, HAS_COPY=bool(w),
            ALIGNED=aligned, BLOCK=k.block, ITERS=k.iters, num_warps=k.num_warps, enable_fp_fusion=False, **scalars)


def _reference_group(opt: TritonAdamW, group: dict, grad_scale: Tensor | None) -> None:
    """torch's single-tensor AdamW on each updated tensor (its operations in its order, in fp32), the moments
    rounded into their stored dtype after each update, then the compute-dtype copy written where there is one."""
    from torch.distributed.tensor import DTensor

    lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    beta1, beta2 = (float(b) for b in group["betas"])
    for p in group["params"]:
        if opt._grad(p) is None:
            continue
        state = opt.state[p]
        if not state:
            state.update(opt._new_state(p))
        updated, grad, exp_avg_stored, exp_avg_sq_stored, *copy = (
            t.to_local() if isinstance(t, DTensor) else t for t in opt._tensors(p, state))
        g = grad.float() if grad_scale is None else grad.float() * grad_scale.to(grad.device, torch.float32)
        exp_avg, exp_avg_sq = exp_avg_stored.float(), exp_avg_sq_stored.float()  # the fp32 tensors themselves if fp32
        step_t = state["step"]
        step_t += 1
        if wd != 0:
            updated.mul_(1 - lr * wd)
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step = step_t.item()
        bias_correction1, bias_correction2 = 1 - beta1**step, 1 - beta2**step
        denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
        updated.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
        if exp_avg is not exp_avg_stored:
            exp_avg_stored.copy_(exp_avg)
            exp_avg_sq_stored.copy_(exp_avg_sq)
        if copy:
            copy[0].copy_(updated)


def _coefficients(steps: list[Tensor], lr: float, beta1: float, beta2: float) -> Tensor:
    """[n, 2] float32: (-lr / bias_correction1, sqrt(bias_correction2)) of each tensor's step, in float64 first as
    torch's AdamW computes them on the host."""
    s = torch.stack(steps).double()
    return torch.stack([-lr / (1 - beta1**s), (1 - beta2**s).sqrt()], dim=1).float()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check(tensors: tuple[Tensor, ...]) -> None:
    """The kernels read flat contiguous memory of supported float dtypes, all of one size on one device."""
    p = tensors[0]
    for name, t in zip(("param", "grad", "exp_avg", "exp_avg_sq", "compute copy"), tensors, strict=False):
        if t.dtype not in KERNEL_DTYPES:
            raise ValueError(f"TritonAdamW: {name} dtype {t.dtype} is not one of float32, bfloat16, float16")
        if t.shape != p.shape or t.device != p.device or not t.is_contiguous():
            raise ValueError(f"TritonAdamW: {name} must be contiguous with the parameter's shape and device; got "
                             f"shape {tuple(t.shape)} on {t.device} (contiguous {t.is_contiguous()}), parameter "
                             f"{tuple(p.shape)} on {p.device}")
