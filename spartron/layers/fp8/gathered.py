"""The unsharded FP8 weights of model.fp8.param_gather, as the FP8 modules read them.

After FSDP2's all-gather of a weight's E4M3 shards (spartron.layers.fp8.param_gather) the module's parameter
is a `GatheredFP8Weight`: a tensor with the bf16 weight's shape and dtype and no bf16 storage, pointing at
its `JointBlocks`, the quantised operand of one GEMM: [q, s, q^T, s^T] of the weights concatenated along N
(the experts' and the FFN's [w1; w3] pair, or one weight), in gemms.weight_blocks' layout, so they reach the
FP8 ops through the weight cache's `cached` list and the GEMM ops stay as they are. A 128x128 block
transposes exactly (same scale, transposed values): q^T is a copy of the gathered values, never a
re-quantisation. The FP8 op receives `stand_in(w)` (a zero-stride tensor of w's shape: the ops read only its
shape and dtype once `cached` is given), whose backward hands the weight gradient to the parameter
unchanged, so FSDP2 reduce-scatters the same gradient as without the option.

q and q^T are FSDP2's "inner tensors" of the parameters (their storage freed at reshard and re-allocated and
refilled at the next all-gather, as the bf16 unsharded weight's is): a GEMM's autograd context that holds
them from forward to backward holds no bytes in between. Reading a gathered weight's values any other way is
an error naming the option.
"""

from __future__ import annotations

import torch
from torch import Tensor

from spartron.layers.fp8.quant import FP8

aten = torch.ops.aten


class JointBlocks:
    """[q, s, q^T, s^T] of the weights of `shapes` ([..., N_i, K] each) concatenated along N. `scales` (the
    full block grid of each weight, persistent: set once per optimizer step) and `write` (each weight's
    gathered E4M3 values, at every all-gather) fill it."""

    def __init__(self, shapes: list[torch.Size]) -> None:
        self.shapes = [torch.Size(s) for s in shapes]
        self.starts = [sum(s[-2] for s in self.shapes[:i]) for i in range(len(self.shapes))]
        self.total = sum(s[-2] for s in self.shapes)  # N of the joint operand
        self.q: Tensor | None = None
        self.qt: Tensor | None = None
        self.s: Tensor | None = None
        self._scales: list[Tensor | None] = [None] * len(self.shapes)

    def set_scales(self, index: int, scales: Tensor) -> None:
        self._scales[index] = scales
        if all(s is not None for s in self._scales):
            self.s = self._scales[0] if len(self._scales) == 1 else torch.cat(self._scales, dim=-2)

    def write(self, index: int, q: Tensor) -> list[Tensor]:
        """Place weight `index`'s gathered values `q` [..., N_i, K] (E4M3); returns the tensors whose storage
        FSDP2 frees at reshard and re-allocates before the next write (the caller's inner tensors)."""
        *lead, n, k = self.shapes[index]
        if self.qt is None:
            self.qt = torch.empty(*lead, k, self.total, dtype=FP8, device=q.device)
        start, joint = self.starts[index], len(self.shapes) > 1
        if joint and self.q is None:
            self.q = torch.empty(*lead, self.total, k, dtype=FP8, device=q.device)
        if q.is_cuda:  # one Triton kernel: q read once, both places written in tiles
            from spartron.layers.fp8 import triton_backend
            triton_backend.place_gathered(q, self.q if joint else None, self.qt, start)
        else:
            self.qt[..., :, start:start + n].copy_(q.transpose(-2, -1))
            if joint:
                self.q[..., start:start + n, :].copy_(q)
        if not joint:
            self.q = q  # the all-gather's own output: no copy
            return [self.qt]
        return [self.q, self.qt]

    def blocks(self, lead: bool = False) -> list[Tensor]:
        """[q, s, q^T, s^T] (gemms.weight_blocks' layout: s^T a view of s); `lead`: with a leading group dim of 1
        (a dense weight [N, K] as the ops' one-group form [1, N, K])."""
        if self.q is None or self.s is None:
            raise RuntimeError("model.fp8.param_gather: the FP8 weight was read before its all-gather")
        q, s, qt = (t.unsqueeze(0) for t in (self.q, self.s, self.qt)) if lead else (self.q, self.s, self.qt)
        # s^T a view of the (lead) scales: a group's stride is then its whole grid, as DeepGEMM requires of it
        # (unsqueezing the transposed view gave stride K/128 there, an assertion in DeepGEMM's dgrad)
        return [q, s, qt, s.transpose(-2, -1)]


class GatheredFP8Weight(torch.Tensor):
    """The unsharded parameter of an FP8-gathered weight: shape and dtype of the bf16 weight, no storage of
    its own; `joint` holds its GEMM's FP8 blocks."""

    joint: JointBlocks
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, shape: torch.Size, dtype: torch.dtype, device: torch.device, joint: JointBlocks):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        t.joint = joint
        return t

    def __repr__(self) -> str:
        return f"GatheredFP8Weight(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        w = args[0]
        if func in (aten.detach.default, aten.alias.default):
            return cls(w.shape, w.dtype, w.device, w.joint)
        if func is aten.as_strided.default and tuple(args[1]) == tuple(w.shape) and not (args[3:] and args[3]):
            return cls(w.shape, w.dtype, w.device, w.joint)  # FSDP2's view of the unsharded parameter
        if func in (aten.zeros_like.default, aten.empty_like.default):  # FSDP2's zero gradient of an unused one
            return func(torch.empty((), dtype=w.dtype, device=w.device).expand(w.shape), **kwargs)
        raise RuntimeError(f"model.fp8.param_gather: {func} reads a gathered FP8 weight's values (only the FP8 "
                           "modules read it, through its blocks); set model.fp8.param_gather = false to read the "
                           "bf16 weight")


class _StandIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w: Tensor) -> Tensor:  # noqa: ANN001
        return torch.empty((), dtype=w.dtype, device=w.device).expand(w.shape)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # noqa: ANN001
        return grad


def stand_in(w: Tensor) -> Tensor:
    """A zero-stride tensor of w's shape and dtype for an FP8 op given w's blocks through `cached`; its
    gradient is w's."""
    return _StandIn.apply(w)


def gathered_operands(weights: list[Tensor], lead: bool = False) -> tuple[list[Tensor], list[Tensor]]:
    """What an FP8 module hands its ops for `weights` (one module's, in GEMM order): when they are FP8-gathered,
    their stand-ins and the blocks of each of their GEMMs' JointBlocks in turn (the ops' `cached` list; `lead`
    as in JointBlocks.blocks); otherwise the weights themselves and []. A mix of both is an error."""
    kinds = {isinstance(w, GatheredFP8Weight) for w in weights}
    if len(kinds) > 1:
        raise RuntimeError("model.fp8.param_gather: one module's weights are partly FP8-gathered")
    if kinds != {True}:
        return list(weights), []
    joints = dict.fromkeys(w.joint for w in weights)  # a pair's weights share one JointBlocks
    return [stand_in(w) for w in weights], [t for joint in joints for t in joint.blocks(lead)]
