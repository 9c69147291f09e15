"""fp32 master weights held by the optimizer (`model.master_weights = "optimizer"`, with model.master_dtype =
"float32" and model.dtype = "bfloat16"): the fast fp32-master path on one rank.

Why: under `model.master_weights = "fsdp"` the parameters are fp32 and FSDP2 casts them to bf16 before every
block's forward and casts, copies and divides the gradients after its backward, on one rank too (its copies
cost ~78 ms of a 310 ms dsv3-12l step on the H200, issue 38). The math needs none of that traffic:

- The model's parameters ARE the bf16 compute weights; each holds its fp32 master as ``p.main_param``.
- Gradients: a post-accumulate-grad hook takes each bf16 gradient off ``p.grad`` as autograd produces it.
  With one micro-batch it stays as it is, in ``p.main_grad`` (bf16): the update reads it into fp32 registers,
  exactly what FSDP2's fp32 cast of the same bf16 gradient holds. From the second micro-batch on,
  ``p.main_grad`` is an fp32 sum (fp32(g1) + g2 + ...), Megatron's main_grad: the accumulation FSDP2 does
  in its reduce dtype, never a bf16 sum. (An fp32 buffer for a single micro-batch would add 2 bytes per
  parameter and a cast, and change no bit.)
- `MasterAdamW` updates the master from ``p.main_grad`` with torch's AdamW formula and writes ``p`` =
  bf16(master), rounded to nearest even, in the same pass: on CUDA the Triton kernel of
  spartron.runtime.adamw_triton (one read of grad, master, moments; writes of master, moments and the bf16
  weight); elsewhere, or with train.adamw_kernel = "torch", a torch reference that follows torch's
  single-tensor AdamW operation by operation (what the CPU tests compare with the FSDP path). The clip
  coefficient is applied as the gradient is read (`step(grad_scale=...)`), so a bf16 gradient is never
  rescaled in bf16; the trainer's 1/micro-steps loss scaling is in the graph, as on the FSDP path.
- Saved state: the model's state_dict holds the fp32 masters under the parameters' names (a state-dict
  hook), and loading one fills the masters and rounds them into the bf16 parameters; the optimizer's state
  is torch AdamW's (step, fp32 exp_avg / exp_avg_sq, or bf16 ones with train.adamw_moments_dtype) keyed by
  the same parameters. A step saved on this
  path therefore resumes on the FSDP path and the other way round, and `spartron convert --to-hf` exports
  the masters.

One rank only: under FSDP2 the gradients would come back in the parameters' bf16 dtype after an fp32
reduce-scatter (spartron.layers.config.master_layout_refusal: the launch and the plan refuse a larger world,
naming the key).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from spartron.runtime.adamw_triton import AdamWKernelConfig, TritonAdamW


def has_master(p: Tensor) -> bool:
    return hasattr(p, "main_param")


def grad_of(p: Tensor) -> Tensor | None:
    """The gradient clipping and the update read: ``p.main_grad`` on this path, else ``p.grad``."""
    return p.main_grad if has_master(p) else p.grad


def attach_master_weights(model: nn.Module, compute_dtype: torch.dtype) -> None:
    """Make `model`'s fp32 parameters bf16 compute weights with fp32 masters (module docstring); in place,
    before its optimizer is built. Parameter names and state_dict keys stay; buffers keep their dtypes."""
    named = dict(model.named_parameters())  # one name per tensor (tied weights once)
    if any(has_master(p) for p in named.values()):
        raise ValueError("attach_master_weights: the model's parameters already have fp32 masters")
    for name, p in named.items():
        if p.dtype != torch.float32:
            raise ValueError(f"attach_master_weights: parameter {name} is {p.dtype}; the masters are taken from "
                             "float32 parameters (build the model with model.master_dtype = 'float32')")
    for p in named.values():
        p.main_param = p.detach().clone()
        p.main_grad = None
        p.data = p.data.to(compute_dtype)
        if p.requires_grad:  # a stage may freeze it later; a parameter frozen from the start never gets one
            p.register_post_accumulate_grad_hook(_take_grad)
    model.register_state_dict_post_hook(_masters_into_state_dict)
    model.register_load_state_dict_pre_hook(_state_dict_into_masters)


def _take_grad(p: Tensor) -> None:
    """Post-accumulate-grad hook: move this micro-batch's gradient into ``p.main_grad`` (fp32 from the second)."""
    g, p.grad = p.grad, None
    held = p.main_grad
    if held is None:
        p.main_grad = g
    elif held.dtype == torch.float32:
        held.add_(g)
    else:
        p.main_grad = held.float().add_(g)


def _masters_into_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for name, p in module.named_parameters(remove_duplicate=False):
        if prefix + name in state_dict and has_master(p):
            state_dict[prefix + name] = p.main_param


def _state_dict_into_masters(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """Fill the masters from the loaded values; load_state_dict then copies them into the bf16 parameters
    (rounded to nearest even). A value of another shape is left to load_state_dict's own error."""
    with torch.no_grad():
        for name, p in module.named_parameters(remove_duplicate=False):
            value = state_dict.get(prefix + name)
            if has_master(p) and isinstance(value, Tensor) and value is not p.main_param \
                    and value.shape == p.main_param.shape:
                p.main_param.copy_(value)


class MasterAdamW(TritonAdamW):
    """AdamW over fp32 masters that writes the bf16 parameters in the same pass (module docstring).

    Its parameter groups hold the model's (bf16) parameters, so torch.distributed.checkpoint names its state as
    it names TritonAdamW's; the state is ``step`` a float32 0-dim tensor on the device and ``exp_avg`` /
    ``exp_avg_sq`` like the master (fp32), or in `moments_dtype`. `reference` (no CUDA, or train.adamw_kernel =
    "torch"): TritonAdamW's torch implementation, which imports no Triton."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, reference: bool, kernel: AdamWKernelConfig | None = None,
                 moments_dtype: torch.dtype | None = None) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, kernel=kernel,
                         reference=reference, moments_dtype=moments_dtype)
        for group in self.param_groups:
            for p in group["params"]:
                if not has_master(p):
                    raise ValueError(f"MasterAdamW: a parameter of shape {tuple(p.shape)} has no fp32 master "
                                     "(spartron.runtime.master_weights.attach_master_weights)")

    def _grad(self, p: Tensor) -> Tensor | None:
        # p.grad: torch.distributed.checkpoint initialises a fresh optimizer's state by a step on zero p.grad
        return p.main_grad if p.main_grad is not None else p.grad

    def _updated(self, p: Tensor) -> Tensor:
        return p.main_param

    def _tensors(self, p: Tensor, state: dict) -> tuple[Tensor, ...]:
        return p.main_param, self._grad(p), state["exp_avg"], state["exp_avg_sq"], p

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Also the main gradients: dropped, or zeroed in place when kept (train.keep_grad_buffers) and fp32 (a
        bf16 one is autograd's own gradient of a single micro-batch: there is no buffer to keep)."""
        super().zero_grad(set_to_none)
        for p in self._params():
            held = p.main_grad
            if held is not None:
                if set_to_none or held.dtype != torch.float32:
                    p.main_grad = None
                else:
                    held.zero_()

    def _state_dtype(self, name: str) -> torch.dtype:
        """Every state tensor fp32 like the master (the moments in `moments_dtype` when set), never the bf16
        parameter's dtype."""
        return super()._state_dtype(name) or torch.float32
