"""Test-only: run megatron-core 0.16.1's training machinery on CPU gloo ranks (never imported by the library).

megatron-core's DDP, optimizer, schedules and dist_checkpointing place a few small bookkeeping tensors
on the GPU by name, although the model and its gradients may live anywhere. `cpu_megatron()` redirects
exactly those device choices to the CPU while it is active, and nothing else:

- `torch.cuda.current_device()` returns 0 instead of raising "Torch not compiled with CUDA". Megatron
  passes it as `device=` (DDP's ParamAndGradBuffer grad/param buffers, GPTModel's and p2p's shape
  tensors), so the device mode below turns it into the CPU.
- A TorchFunctionMode rewrites a CUDA `device=` argument of any torch call (`device="cuda"`, `0`,
  `torch.device("cuda", i)`) to `"cpu"`, and makes `Tensor.cuda()` the identity. Megatron creates with it
  the schedules' `total_num_tokens`, the optimizer's `found_inf` / `_scale_one` / grad-scaler and
  clip_grads' norm tensors, and dist_checkpointing's exchange buffers.
- `Tensor.type()` (no argument) of a CPU tensor answers its CUDA type name ('torch.BFloat16Tensor' ->
  'torch.cuda.BFloat16Tensor'): the optimizer sorts parameters into fp32 / fp16 / bf16 by comparing
  these names with the torch.cuda ones, and refuses any other.
- `torch.cuda.synchronize()` and `torch.cuda.empty_cache()` do nothing (p2p communication, dist_checkpointing
  and DDP call them; a CPU has no queue to wait for).

No value changes: every redirected tensor is created with the same dtype, shape and contents, on the
CPU where the model already is, and a type name is only compared. NOT shimmed: `overlap_grad_reduce`
(CUDA streams), nor anything that moves a model: on a GPU the same Megatron paths run unpatched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode


def _is_cuda(device: object) -> bool:
    if isinstance(device, bool) or device is None:
        return False
    if isinstance(device, int):
        return True  # a bare index means a CUDA device to torch
    try:
        return torch.device(device).type == "cuda"
    except (RuntimeError, TypeError):
        return False


class _CudaDevicesToCpu(TorchFunctionMode):
    """`device=<cuda>` -> `device="cpu"`; `Tensor.cuda()` / `Tensor.to(<cuda>)` -> the tensor itself;
    `Tensor.type()` -> the CUDA type name."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not args[0].is_cuda else name
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_megatron() -> Iterator[None]:
    """Inside: megatron-core's CUDA-named bookkeeping tensors are created on the CPU (module docstring)."""
    with (mock.patch.object(torch.cuda, "current_device", lambda: 0),
          mock.patch.object(torch.cuda, "synchronize", lambda device=None: None),
          mock.patch.object(torch.cuda, "empty_cache", lambda: None),
          _CudaDevicesToCpu()):
        yield
