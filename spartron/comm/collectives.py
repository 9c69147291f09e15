"""Collectives as `spartron_collectives` custom ops: one boundary seen by autograd, AC and compile.

Why custom ops instead of calling torch.distributed directly: the checkpoint policy classifies
operators by name (`[ac] targets = ["spartron_collectives"]`), torch.compile traces them through
their fake impls without graph breaks, and autograd uses the registered backward (all-to-all <->
reverse all-to-all, all-gather <-> reduce-scatter). The ops take a *group name* (a string, which
every tracer handles) and resolve the ProcessGroup inside; the Python wrappers below take a
ProcessGroup (None = world), validate everything that can be checked locally, and raise ValueError
before any rank enters a collective that could hang.

Split-size tensors (the MoE dispatch counts) are moved to the host through
`spartron_collectives::splits_to_host`, a separate op so the checkpoint policy can mark it
mandatory: a replay reuses the saved host copy instead of synchronising with the device again.
Under torch.compile(fullgraph=True), list splits are constants (a new split pattern recompiles);
tensor splits need `torch._dynamo.config.capture_scalar_outputs = True` and become unbacked
SymInts, with the local checks turned into runtime asserts (torch._check).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

NAMESPACE = "spartron_collectives"

OPS: tuple[str, ...] = (
    f"{NAMESPACE}::all_to_all",
    f"{NAMESPACE}::all_gather",
    f"{NAMESPACE}::reduce_scatter",
    f"{NAMESPACE}::splits_to_host",
)

Splits = Sequence[int] | Tensor | None

# torch 2.13 renamed the flat collectives (the old names warn); torch 2.11 only has the old ones.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The ProcessGroup registered under `group_name`; ValueError naming it when there is none."""
    try:
        return _resolve_process_group(group_name)
    except (ValueError, RuntimeError, KeyError) as err:
        raise ValueError(f"spartron_collectives: no process group named {group_name!r} "
                         f"(is torch.distributed initialised and the group created on this rank?)") from err


def _front(x: Tensor, dim: int) -> Tensor:
    """`x` with `dim` moved to the front, contiguous: the layout the flat collectives work on."""
    return x.movedim(dim, 0).contiguous()


# ---------------------------------------------------------------------------------------------
# The ops: schemas, real impls, fake impls, autograd. Registered through torch.library.Library
# rather than @custom_op: same schemas, fake impls and autograd, but the dispatcher calls the impls
# directly instead of through custom_op's per-call Python wrappers (~10 µs a call on the host).
# ---------------------------------------------------------------------------------------------

_LIB = torch.library.Library(NAMESPACE, "DEF")
_SCHEMAS = {
    "all_to_all": "(Tensor x, SymInt[] output_split_sizes, SymInt[] input_split_sizes, str group_name) -> Tensor",
    "all_gather": "(Tensor x, SymInt dim, str group_name) -> Tensor",
    "reduce_scatter": "(Tensor x, SymInt dim, str group_name) -> Tensor",
    "splits_to_host": "(Tensor splits) -> Tensor",
}
for _name, _schema in _SCHEMAS.items():
    _LIB.define(_name + _schema, tags=(torch.Tag.pt2_compliant_tag,))

_all_to_all = torch.ops.spartron_collectives.all_to_all.default
_all_gather = torch.ops.spartron_collectives.all_gather.default
_reduce_scatter = torch.ops.spartron_collectives.reduce_scatter.default
_splits_to_host = torch.ops.spartron_collectives.splits_to_host.default


def _all_to_all_impl(x: Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
                     group_name: str) -> Tensor:
    return _all_to_all_on(resolve_group(group_name), x, output_split_sizes, input_split_sizes)


def _all_to_all_on(pg: dist.ProcessGroup, x: Tensor, output_split_sizes: list[int],
                   input_split_sizes: list[int]) -> Tensor:
    # The ProcessGroup's own entry point, as dist.all_to_all_single ends up calling: the same NCCL /
    # gloo transport without that wrapper's Python checks, which the public wrapper below already did.
    out = x.new_empty(sum(output_split_sizes), *x.shape[1:])  # varargs: parsed faster than a tuple
    try:
        work = pg.alltoall_base(out, x.contiguous(), output_split_sizes, input_split_sizes,
                                dist.AllToAllOptions())
    except RuntimeError:  # a group without a backend for x's device fails here, locally, before any exchange
        _check_backend(x, pg, "all_to_all", compiling=False)
        raise
    work.wait()
    return out


def _all_to_all_fake(x, output_split_sizes, input_split_sizes, group_name):
    return x.new_empty((sum(output_split_sizes), *x.shape[1:]))


def _all_to_all_grad(grad: Tensor, output_split_sizes, input_split_sizes, group_name: str) -> Tensor:
    """The backward rule: the reverse all-to-all (output and input splits swapped)."""
    return _run(ALL_TO_ALL, grad, list(input_split_sizes), list(output_split_sizes), group_name)


def _all_gather_impl(x: Tensor, dim: int, group_name: str) -> Tensor:
    pg = resolve_group(group_name)
    front = _front(x, dim)
    out = front.new_empty((pg.size() * front.shape[0], *front.shape[1:]))
    _all_gather_flat(out, front, group=pg)
    return out.movedim(0, dim).contiguous()


def _all_gather_fake(x, dim, group_name):
    shape = list(x.shape)
    shape[dim] *= resolve_group(group_name).size()
    return x.new_empty(shape)


def _reduce_scatter_impl(x: Tensor, dim: int, group_name: str) -> Tensor:
    pg = resolve_group(group_name)
    front = _front(x, dim)
    out = front.new_empty((front.shape[0] // pg.size(), *front.shape[1:]))
    _reduce_scatter_flat(out, front, op=dist.ReduceOp.SUM, group=pg)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter_fake(x, dim, group_name):
    shape = list(x.shape)
    shape[dim] //= resolve_group(group_name).size()
    return x.new_empty(shape)


def _splits_to_host_impl(splits: Tensor) -> Tensor:
    return splits.to(device="cpu", dtype=torch.int64, copy=True)


def _splits_to_host_fake(splits):
    return torch.empty(splits.shape, dtype=torch.int64, device="cpu")


@dataclass(frozen=True)
class _Collective:
    """One differentiable op: the registered op, its real impl and its backward rule (grad, *args) -> grad_x."""

    op: object
    impl: Callable[..., Tensor]
    grad: Callable[..., Tensor]


ALL_TO_ALL = _Collective(_all_to_all, _all_to_all_impl, _all_to_all_grad)
ALL_GATHER = _Collective(_all_gather, _all_gather_impl,
                         lambda grad, dim, group_name: _run(REDUCE_SCATTER, grad, dim, group_name))
REDUCE_SCATTER = _Collective(_reduce_scatter, _reduce_scatter_impl,
                             lambda grad, dim, group_name: _run(ALL_GATHER, grad, dim, group_name))


def _register(name: str, impl, fake, collective: _Collective | None = None) -> None:
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
    if collective is not None:
        torch.library.register_autograd(
            f"{NAMESPACE}::{name}", lambda ctx, grad: (collective.grad(grad, *ctx.args), *[None] * len(ctx.args)),
            setup_context=_save_args, lib=_LIB)


def _save_args(ctx, inputs, output):
    ctx.args = inputs[1:]


_register("all_to_all", _all_to_all_impl, _all_to_all_fake, ALL_TO_ALL)
_register("all_gather", _all_gather_impl, _all_gather_fake, ALL_GATHER)
_register("reduce_scatter", _reduce_scatter_impl, _reduce_scatter_fake, REDUCE_SCATTER)
_register("splits_to_host", _splits_to_host_impl, _splits_to_host_fake)


# ---------------------------------------------------------------------------------------------
# How a wrapper enters an op. The op is the boundary for three observers: autograd, dispatch modes
# (the checkpoint policy, FakeTensorMode) and the compiler. Eager calls take the cheapest entry
# that keeps every observer present on this call seeing the op; each skipped layer costs several
# µs of host time a call (benchmarks/results/collectives.json), which MoE dispatch pays per layer.
# ---------------------------------------------------------------------------------------------

class _Differentiable(torch.autograd.Function):
    """Eager autograd for the wrappers: the op's own backward rule through one autograd.Function.

    Same graph as the op's registered autograd (which torch.ops callers and compiled graphs use),
    at about half its per-call host cost (register_autograd's Python kernel runs on every call).
    """

    @staticmethod
    def forward(ctx, x: Tensor, collective: _Collective, *args):
        ctx.collective, ctx.args = collective, args
        return _below_autograd(collective, x, *args)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return (ctx.collective.grad(grad, *ctx.args), None, *[None] * len(ctx.args))


# autograd.Function.apply without its Python prologue (default-argument binding for setup_context, functorch
# wrapper unwrapping; ~2 µs a call): the C++ apply it ends in. Used only when no functorch transform is active.
_differentiable_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _Differentiable)


def _observed(x: Tensor) -> bool:
    """Whether a dispatch or function mode, or a tensor subclass, would see the op's dispatcher entry."""
    return (type(x) is not Tensor or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._is_torch_function_mode_enabled())


def _below_autograd(collective: _Collective, x: Tensor, *args) -> Tensor:
    """The op without its autograd layer; straight to its impl when nothing below autograd is watching."""
    if not _observed(x):
        return collective.impl(x, *args)
    with torch._C._AutoDispatchBelowAutograd():
        return collective.op(x, *args)


def _run(collective: _Collective, x: Tensor, *args, compiling: bool | None = None) -> Tensor:
    """`collective`'s op applied to `x`: traced code calls the op itself; eager code the cheapest entry."""
    if compiling is None:  # the backward rules call without knowing
        compiling = torch.compiler.is_compiling()
    if compiling:
        return collective.op(x, *args)
    if x.requires_grad and torch.is_grad_enabled():
        if torch._C._are_functorch_transforms_active():
            return _Differentiable.apply(x, collective, *args)
        return _differentiable_apply(x, collective, *args)
    return _below_autograd(collective, x, *args)


def _group(group: dist.ProcessGroup | None, compiling: bool) -> dist.ProcessGroup:
    if not dist.is_initialized():
        raise ValueError("spartron_collectives: torch.distributed is not initialised "
                         "(call init_process_group, or pass no group for single-rank code paths)")
    group = dist.group.WORLD if group is None else group
    if not compiling and group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("spartron_collectives: this rank is not a member of the given process group")
    return group


def _check_backend(x: Tensor, group: dist.ProcessGroup, what: str, compiling: bool) -> None:
    if compiling:  # opaque to dynamo; the traced graph runs the same check eagerly
        return
    try:
        group._get_backend(x.device)
    except RuntimeError as err:
        raise ValueError(f"{what}: the process group has no backend for {x.device.type} tensors "
                         f"(use NCCL for CUDA tensors, gloo for CPU tensors)") from err


def splits_to_host(splits: Tensor) -> list[int]:
    """Split sizes held in a tensor as a Python list, copied through the mandatory-save op."""
    return _splits_to_host(splits).tolist()


def _split_list(splits: Splits, x: Tensor, world: int, name: str, compiling: bool) -> list[int]:
    """`splits` as a validated list of `world` non-negative ints (None = even split of dim 0)."""
    if type(splits) is list and not compiling:  # the MoE dispatch's case, twice per all-to-all: fewest checks
        for size in splits:
            if type(size) is not int:
                raise ValueError(f"all_to_all: {name} must be ints, got {splits}")
        if len(splits) == world and min(splits) >= 0:
            return splits.copy()
    if splits is None:
        if x.shape[0] % world:
            raise ValueError(f"all_to_all: {name}=None needs x.size(0)={x.shape[0]} divisible by the "
                             f"group size {world}")
        return [x.shape[0] // world] * world
    if isinstance(splits, Tensor):
        if splits.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"all_to_all: {name} tensor must be int64 (or int32), got {splits.dtype}")
        if splits.dim() != 1:
            raise ValueError(f"all_to_all: {name} tensor must be 1-D, got shape {tuple(splits.shape)}")
        if splits.device.type not in ("cpu", x.device.type):
            raise ValueError(f"all_to_all: {name} tensor is on {splits.device}, expected the host or "
                             f"x's device {x.device}")
        splits = splits_to_host(splits)  # a fresh list of ints: no further type checks needed
    else:
        splits = list(splits)
        if not compiling:  # a plain loop, no generator: this runs twice per MoE all-to-all
            for size in splits:
                if type(size) is not int:
                    raise ValueError(f"all_to_all: {name} must be ints, got {splits}")
    if len(splits) != world:
        raise ValueError(f"all_to_all: {name} has {len(splits)} entries, the group has {world} ranks")
    if compiling:  # sizes may be unbacked SymInts (from a tensor): assert at run time
        for size in splits:
            torch._check(size >= 0, lambda: f"all_to_all: {name} has negative sizes")
    elif min(splits, default=0) < 0:
        raise ValueError(f"all_to_all: {name} has negative sizes: {splits}")
    return splits


def all_to_all(x: Tensor, output_split_sizes: Splits = None, input_split_sizes: Splits = None,
               group: dist.ProcessGroup | None = None) -> Tensor:
    """Differentiable all-to-all along dim 0 with (possibly uneven, possibly zero) split sizes.

    Rank r sends rows `input_split_sizes[j]` to rank j and receives `output_split_sizes[j]` rows
    from rank j, concatenated in rank order. Splits: list of ints, 1-D int tensor, or None (even).
    """
    compiling = torch.compiler.is_compiling()
    group = _group(group, compiling)
    world = group.size()
    if x.dim() == 0:
        raise ValueError("all_to_all: x must have at least one dimension (splits act on dim 0)")
    in_splits = _split_list(input_split_sizes, x, world, "input_split_sizes", compiling)
    if compiling:
        torch._check(sum(in_splits) == x.shape[0],
                     lambda: "all_to_all: input_split_sizes do not sum to x.size(0)")
    elif sum(in_splits) != x.shape[0]:
        raise ValueError(f"all_to_all: input_split_sizes {in_splits} sum to {sum(in_splits)}, "
                         f"but x.size(0) is {x.shape[0]}")
    out_splits = _split_list(output_split_sizes, x, world, "output_split_sizes", compiling)
    if not (compiling or (x.requires_grad and torch.is_grad_enabled()) or _observed(x)):
        # nothing watches this call: straight to the transport (the backend check runs only if it fails)
        return _all_to_all_on(group, x, out_splits, in_splits)
    return _run(ALL_TO_ALL, x, out_splits, in_splits, group.group_name, compiling=compiling)


def exchange_split_sizes(input_split_sizes: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Each rank's output split sizes: the all-to-all of the per-destination counts.

    `input_split_sizes[j]` = rows this rank sends to rank j; the result's entry j = rows rank j
    sends here. Same device as the input (NCCL needs CUDA counts); int64.
    """
    compiling = torch.compiler.is_compiling()
    group = _group(group, compiling)
    world = group.size()
    if input_split_sizes.dtype != torch.int64 or input_split_sizes.shape != (world,):
        raise ValueError(f"exchange_split_sizes: expected an int64 tensor of shape ({world},), got "
                         f"{input_split_sizes.dtype} of shape {tuple(input_split_sizes.shape)}")
    _check_backend(input_split_sizes, group, "exchange_split_sizes", compiling)
    ones = [1] * world
    return _run(ALL_TO_ALL, input_split_sizes, ones, ones, group.group_name, compiling=compiling)


def _check_dim(x: Tensor, dim: int, what: str) -> int:
    if not -x.dim() <= dim < max(x.dim(), 1):
        raise ValueError(f"{what}: dim {dim} is out of range for a {x.dim()}-D tensor")
    return dim % x.dim()


def all_gather(x: Tensor, group: dist.ProcessGroup | None = None, dim: int = 0) -> Tensor:
    """Differentiable all-gather: every rank's `x` concatenated along `dim` in rank order.

    Every rank must pass the same shape. Backward is a reduce-scatter (sum) of the gradient.
    """
    compiling = torch.compiler.is_compiling()
    group = _group(group, compiling)
    dim = _check_dim(x, dim, "all_gather")
    _check_backend(x, group, "all_gather", compiling)
    return _run(ALL_GATHER, x, dim, group.group_name, compiling=compiling)


def reduce_scatter(x: Tensor, group: dist.ProcessGroup | None = None, dim: int = 0) -> Tensor:
    """Differentiable reduce-scatter (sum): rank r gets chunk r along `dim` of the sum over ranks.

    `x.size(dim)` must be divisible by the group size. Backward is an all-gather of the gradient.
    """
    compiling = torch.compiler.is_compiling()
    group = _group(group, compiling)
    world = group.size()
    dim = _check_dim(x, dim, "reduce_scatter")
    if x.shape[dim] % world:
        raise ValueError(f"reduce_scatter: x.size({dim})={x.shape[dim]} is not divisible by the "
                         f"group size {world}")
    _check_backend(x, group, "reduce_scatter", compiling)
    return _run(REDUCE_SCATTER, x, dim, group.group_name, compiling=compiling)
