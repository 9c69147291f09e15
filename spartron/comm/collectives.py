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

all_gather and reduce_scatter carry a `purpose` (a string, "" for none): what the caller gathers for (CP's
sequence, EP's counts). The transport does nothing with it but label the call on a mirrored group
(spartron.comm.mirror.labelled), so a rehearsal tells CP's KV exchange from FSDP2's parameter traffic when
the two share a group; the backward's collective carries the forward's purpose.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import AllgatherOptions, ReduceScatterOptions, _resolve_process_group

from spartron.comm.mirror import labelled

NAMESPACE = "spartron_collectives"

OPS: tuple[str, ...] = (
    f"{NAMESPACE}::all_to_all",
    f"{NAMESPACE}::all_gather",
    f"{NAMESPACE}::reduce_scatter",
    f"{NAMESPACE}::splits_to_host",
)

Splits = Sequence[int] | Tensor | None

def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The ProcessGroup registered under `group_name`; ValueError naming it when there is none."""
    try:
        return _resolve_process_group(group_name)
    except (ValueError, RuntimeError, KeyError) as err:
        raise ValueError(f"spartron_collectives: no process group named {group_name!r} "
                         f"(is torch.distributed initialised and the group created on this rank?)") from err


# ---------------------------------------------------------------------------------------------
# The ops: schemas, real impls, fake impls, autograd. Registered through torch.library.Library
# rather than @custom_op: same schemas, fake impls and autograd, but the dispatcher calls the impls
# directly instead of through custom_op's per-call Python wrappers (~10 µs a call on the host).
# ---------------------------------------------------------------------------------------------

_LIB = torch.library.Library(NAMESPACE, "DEF")
_SCHEMAS = {
    "all_to_all": "(Tensor x, SymInt[] output_split_sizes, SymInt[] input_split_sizes, str group_name) -> Tensor",
    "all_gather": "(Tensor x, SymInt dim, str purpose, str group_name) -> Tensor",
    "reduce_scatter": "(Tensor x, SymInt dim, str purpose, str group_name) -> Tensor",
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


# The transports below call the ProcessGroup's own entry points, as torch.distributed's wrappers end up
# doing, without those wrappers' Python checks (the public wrappers here validate first). asyncOp=False:
# each call is waited at once, so NCCL runs it on the current stream (no event record, stream wait or
# tensor stash per call), exactly as dist.all_to_all_single(async_op=False) does. A group without a
# backend for x's device fails at the entry, locally, before any exchange: only then is the backend checked.

def _all_to_all_on(pg: dist.ProcessGroup, x: Tensor, output_split_sizes: list[int],
                   input_split_sizes: list[int]) -> Tensor:
    out = x.new_empty(sum(output_split_sizes), *x.shape[1:])  # varargs: parsed faster than a tuple
    opts = dist.AllToAllOptions()
    opts.asyncOp = False
    try:
        work = pg.alltoall_base(out, x.contiguous(), output_split_sizes, input_split_sizes, opts)
    except RuntimeError:
        _check_backend(x, pg, "all_to_all")
        raise
    if work is not None:  # NCCL returns none for a synchronous call: it ran on the current stream
        work.wait()
    return out


def _all_to_all_fake(x, output_split_sizes, input_split_sizes, group_name):
    return x.new_empty((sum(output_split_sizes), *x.shape[1:]))


def _all_to_all_backward(grad: Tensor, pg: dist.ProcessGroup, output_split_sizes, input_split_sizes) -> Tensor:
    """The backward rule: the reverse all-to-all (output and input splits swapped)."""
    return _eager(ALL_TO_ALL, grad, pg, list(input_split_sizes), list(output_split_sizes))


def _all_gather_impl(x: Tensor, dim: int, purpose: str, group_name: str) -> Tensor:
    return _all_gather_on(resolve_group(group_name), x, dim, purpose)


def _all_gather_on(pg: dist.ProcessGroup, x: Tensor, dim: int, purpose: str = "") -> Tensor:
    if purpose:  # recorded as `purpose` on a rehearsal's mirrored group (mirror.labelled); "" keeps an outer label
        with labelled(purpose, pg):
            return _all_gather_on(pg, x, dim)
    front = (x.movedim(dim, 0) if dim else x).contiguous()  # the flat collectives work on dim 0
    out = front.new_empty(pg.size() * front.shape[0], *front.shape[1:])
    opts = AllgatherOptions()
    opts.asyncOp = False
    try:
        work = pg._allgather_base(out, front, opts)
    except RuntimeError:
        _check_backend(x, pg, "all_gather")
        raise
    if work is not None:  # NCCL returns none for a synchronous call: it ran on the current stream
        work.wait()
    return out.movedim(0, dim).contiguous() if dim else out


def _all_gather_fake(x, dim, purpose, group_name):
    shape = list(x.shape)
    shape[dim] *= resolve_group(group_name).size()
    return x.new_empty(shape)


def _reduce_scatter_impl(x: Tensor, dim: int, purpose: str, group_name: str) -> Tensor:
    return _reduce_scatter_on(resolve_group(group_name), x, dim, purpose)


def _reduce_scatter_on(pg: dist.ProcessGroup, x: Tensor, dim: int, purpose: str = "") -> Tensor:
    if purpose:  # recorded as `purpose` on a rehearsal's mirrored group (mirror.labelled); "" keeps an outer label
        with labelled(purpose, pg):
            return _reduce_scatter_on(pg, x, dim)
    front = (x.movedim(dim, 0) if dim else x).contiguous()
    out = front.new_empty(front.shape[0] // pg.size(), *front.shape[1:])
    opts = ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    opts.asyncOp = False
    try:
        work = pg._reduce_scatter_base(out, front, opts)
    except RuntimeError:
        _check_backend(x, pg, "reduce_scatter")
        raise
    if work is not None:  # NCCL returns none for a synchronous call: it ran on the current stream
        work.wait()
    return out.movedim(0, dim).contiguous() if dim else out


def _reduce_scatter_fake(x, dim, purpose, group_name):
    shape = list(x.shape)
    shape[dim] //= resolve_group(group_name).size()
    return x.new_empty(shape)


def _splits_to_host_impl(splits: Tensor) -> Tensor:
    return splits.to(device="cpu", dtype=torch.int64, copy=True)


def _splits_to_host_fake(splits):
    return torch.empty(splits.shape, dtype=torch.int64, device="cpu")


@dataclass(frozen=True)
class _Collective:
    """One differentiable op: the registered op (x, *args, group_name), its transport on a resolved
    group (pg, x, *args) and its backward rule (grad, pg, *args) -> grad_x."""

    op: object
    on: Callable[..., Tensor]
    backward: Callable[..., Tensor]


ALL_TO_ALL = _Collective(_all_to_all, _all_to_all_on, _all_to_all_backward)
ALL_GATHER = _Collective(_all_gather, _all_gather_on,
                         lambda grad, pg, dim, purpose="": _eager(REDUCE_SCATTER, grad, pg, dim, purpose))
REDUCE_SCATTER = _Collective(_reduce_scatter, _reduce_scatter_on,
                             lambda grad, pg, dim, purpose="": _eager(ALL_GATHER, grad, pg, dim, purpose))


# ---------------------------------------------------------------------------------------------
# How a wrapper enters an op. The op is the boundary for three observers: autograd, dispatch modes
# (the checkpoint policy, FakeTensorMode) and the compiler. Traced code calls the op itself; eager
# calls take the cheapest entry that keeps every observer present on this call seeing the op: the
# transport when nothing watches, the op below its autograd layer when a dispatch mode or subclass
# does, one autograd.Function when the result needs a gradient. Each skipped layer saves several µs
# of host time a call (docs/KERNEL_NOTES.md), which MoE dispatch pays per layer.
# ---------------------------------------------------------------------------------------------

class _Differentiable(torch.autograd.Function):
    """The ops' autograd: each op's backward rule through one autograd.Function, entered by the eager
    wrappers directly and by the ops' Autograd kernel (torch.ops callers, AOTAutograd's traces)."""

    @staticmethod
    def forward(ctx, x: Tensor, collective: _Collective, pg: dist.ProcessGroup, *args):
        ctx.collective, ctx.pg, ctx.args = collective, pg, args
        if _observed(x):
            with torch._C._AutoDispatchBelowAutograd():
                return collective.op(x, *args, pg.group_name)
        return collective.on(pg, x, *args)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return (ctx.collective.backward(grad, ctx.pg, *ctx.args), None, None, *[None] * len(ctx.args))


# autograd.Function.apply without its Python prologue (default-argument binding for setup_context, functorch
# wrapper unwrapping; ~2 µs a call): the C++ apply it ends in. Used only when no functorch transform is active.
_differentiable_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _Differentiable)


def _observed(x: Tensor) -> bool:
    """Whether a dispatch or function mode, or a tensor subclass, would see the op's dispatcher entry."""
    return (type(x) is not Tensor or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._is_torch_function_mode_enabled())


def _apply(x: Tensor, collective: _Collective, pg: dist.ProcessGroup, *args) -> Tensor:
    """`collective` on `x` with its backward recorded."""
    if torch._C._are_functorch_transforms_active():
        return _Differentiable.apply(x, collective, pg, *args)
    return _differentiable_apply(x, collective, pg, *args)


def _eager(collective: _Collective, x: Tensor, pg: dist.ProcessGroup, *args) -> Tensor:
    """`collective` applied to `x` (already validated) through the cheapest entry its observers allow."""
    if torch.compiler.is_compiling():  # a backward rule traced by the compiler
        return collective.op(x, *args, pg.group_name)
    if x.requires_grad and torch.is_grad_enabled():
        return _apply(x, collective, pg, *args)
    if _observed(x):
        with torch._C._AutoDispatchBelowAutograd():
            return collective.op(x, *args, pg.group_name)
    return collective.on(pg, x, *args)


def _group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The eager wrappers' group: `group`, or the world when None."""
    if group is None:
        group = dist.group.WORLD  # None before init_process_group
        if group is None:
            raise ValueError(_NOT_INITIALISED)
    elif group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("spartron_collectives: this rank is not a member of the given process group")
    return group


_NOT_INITIALISED = ("spartron_collectives: torch.distributed is not initialised "
                    "(call init_process_group, or pass no group for single-rank code paths)")


def _traced_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The group under torch.compile (constant to dynamo; membership is the eager path's check)."""
    if not dist.is_initialized():
        raise ValueError(_NOT_INITIALISED)
    return dist.group.WORLD if group is None else group


def _check_backend(x: Tensor, group: dist.ProcessGroup, what: str) -> None:
    try:
        group._get_backend(x.device)
    except RuntimeError as err:
        raise ValueError(f"{what}: the process group has no backend for {x.device.type} tensors "
                         f"(use NCCL for CUDA tensors, gloo for CPU tensors)") from err


# The ops' Autograd kernel, registered directly rather than through register_autograd, whose Python
# wrapper (and the redispatch to the Python impl behind it) costs several µs on every call, grad or
# not: a compiled graph's forward calls the op through this kernel with autograd off, and unwatched
# it goes straight to the transport. Recording, dispatch modes and subclasses get the paths above.
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset


def _autograd_kernel(collective: _Collective) -> Callable[..., Tensor]:
    def kernel(keyset, x: Tensor, *args) -> Tensor:  # args: the op's (*args, group_name)
        if torch.is_grad_enabled() and x.requires_grad:
            return _apply(x, collective, resolve_group(args[-1]), *args[:-1])
        if _observed(x):
            return collective.op.redispatch(keyset & _AFTER_AUTOGRAD, x, *args)
        return collective.on(resolve_group(args[-1]), x, *args[:-1])
    return kernel


def _register(name: str, impl, fake, collective: _Collective | None = None) -> None:
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
    if collective is not None:
        _LIB.impl(name, _autograd_kernel(collective), "Autograd", with_keyset=True)


_register("all_to_all", _all_to_all_impl, _all_to_all_fake, ALL_TO_ALL)
_register("all_gather", _all_gather_impl, _all_gather_fake, ALL_GATHER)
_register("reduce_scatter", _reduce_scatter_impl, _reduce_scatter_fake, REDUCE_SCATTER)
_register("splits_to_host", _splits_to_host_impl, _splits_to_host_fake)


def splits_to_host(splits: Tensor) -> list[int]:
    """Split sizes held in a tensor as a Python list, copied through the mandatory-save op.

    The op is what a checkpoint policy (a dispatch mode) and the compiler see; with neither watching,
    the same copy without the op's dispatch."""
    if torch.compiler.is_compiling() or _observed(splits):
        return _splits_to_host(splits).tolist()
    return splits.tolist()


def _int_lists(a: Splits, b: Splits, world: int) -> bool:
    """Whether `a` and `b` are lists of `world` non-negative ints: the MoE dispatch's case, one pass."""
    if type(a) is not list or type(b) is not list or len(a) != world or len(b) != world:
        return False
    for size in a + b:
        if type(size) is not int or size < 0:
            return False
    return True


def _split_list(splits: Splits, x: Tensor, world: int, name: str, compiling: bool) -> list[int]:
    """`splits` as a validated list of `world` non-negative ints (None = even split of dim 0)."""
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
        if not compiling:
            for size in splits:
                if type(size) is not int:
                    raise ValueError(f"all_to_all: {name} must be ints, got {splits}")
    if len(splits) != world:
        raise ValueError(f"all_to_all: {name} has {len(splits)} entries, the group has {world} ranks")
    if compiling:  # sizes may be unbacked SymInts (from a tensor): assert at run time
        for size in splits:
            # a message lambda without free variables: dynamo 2.11 cannot extract one that has them
            torch._check(size >= 0, lambda: "all_to_all: split sizes must be non-negative")
    elif min(splits, default=0) < 0:
        raise ValueError(f"all_to_all: {name} has negative sizes: {splits}")
    return splits


def _input_rows_error(in_splits: list[int], x: Tensor) -> ValueError:
    return ValueError(f"all_to_all: input_split_sizes {in_splits} sum to {sum(in_splits)}, "
                      f"but x.size(0) is {x.shape[0]}")


def all_to_all(x: Tensor, output_split_sizes: Splits = None, input_split_sizes: Splits = None,
               group: dist.ProcessGroup | None = None) -> Tensor:
    """Differentiable all-to-all along dim 0 with (possibly uneven, possibly zero) split sizes.

    Rank r sends rows `input_split_sizes[j]` to rank j and receives `output_split_sizes[j]` rows
    from rank j, concatenated in rank order. Splits: list of ints, 1-D int tensor, or None (even).
    """
    if torch.compiler.is_compiling():
        return _traced_all_to_all(x, output_split_sizes, input_split_sizes, group)
    group = _group(group)
    world = group.size()
    try:
        rows = x.shape[0]
    except IndexError:
        raise ValueError("all_to_all: x must have at least one dimension (splits act on dim 0)") from None
    if _int_lists(input_split_sizes, output_split_sizes, world):
        in_splits, out_splits = input_split_sizes, output_split_sizes
        if sum(in_splits) != rows:
            raise _input_rows_error(in_splits, x)
    else:
        in_splits = _split_list(input_split_sizes, x, world, "input_split_sizes", False)
        if sum(in_splits) != rows:
            raise _input_rows_error(in_splits, x)
        out_splits = _split_list(output_split_sizes, x, world, "output_split_sizes", False)
    if x.requires_grad and torch.is_grad_enabled():  # the backward keeps its own copies of the splits
        return _apply(x, ALL_TO_ALL, group, out_splits.copy(), in_splits.copy())
    if _observed(x):
        with torch._C._AutoDispatchBelowAutograd():
            return _all_to_all(x, out_splits, in_splits, group.group_name)
    return _all_to_all_on(group, x, out_splits, in_splits)


def _traced_all_to_all(x: Tensor, output_split_sizes: Splits, input_split_sizes: Splits,
                       group: dist.ProcessGroup | None) -> Tensor:
    """all_to_all under torch.compile: the op, with the checks on SymInt sizes as runtime asserts."""
    group = _traced_group(group)
    world = group.size()
    if x.dim() == 0:
        raise ValueError("all_to_all: x must have at least one dimension (splits act on dim 0)")
    in_splits = _split_list(input_split_sizes, x, world, "input_split_sizes", True)
    torch._check(sum(in_splits) == x.shape[0], lambda: "all_to_all: input_split_sizes do not sum to x.size(0)")
    out_splits = _split_list(output_split_sizes, x, world, "output_split_sizes", True)
    return _all_to_all(x, out_splits, in_splits, group.group_name)


def exchange_split_sizes(input_split_sizes: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Each rank's output split sizes: the all-to-all of the per-destination counts.

    `input_split_sizes[j]` = rows this rank sends to rank j; the result's entry j = rows rank j
    sends here. Same device as the input (NCCL needs CUDA counts); int64.
    """
    compiling = torch.compiler.is_compiling()
    group = _traced_group(group) if compiling else _group(group)
    world = group.size()
    if input_split_sizes.dtype != torch.int64 or input_split_sizes.shape != (world,):
        raise ValueError(f"exchange_split_sizes: expected an int64 tensor of shape ({world},), got "
                         f"{input_split_sizes.dtype} of shape {tuple(input_split_sizes.shape)}")
    ones = [1] * world
    if compiling:  # opaque to dynamo; the traced graph runs the backend check eagerly
        return _all_to_all(input_split_sizes, ones, ones, group.group_name)
    _check_backend(input_split_sizes, group, "exchange_split_sizes")
    return _eager(ALL_TO_ALL, input_split_sizes, group, ones, ones)


def _check_dim(x: Tensor, dim: int, what: str) -> int:
    if not -x.dim() <= dim < max(x.dim(), 1):
        raise ValueError(f"{what}: dim {dim} is out of range for a {x.dim()}-D tensor")
    return dim % x.dim()


def all_gather(x: Tensor, group: dist.ProcessGroup | None = None, dim: int = 0, purpose: str = "") -> Tensor:
    """Differentiable all-gather: every rank's `x` concatenated along `dim` in rank order.

    Every rank must pass the same shape. Backward is a reduce-scatter (sum) of the gradient. `purpose`: what
    the gather is for, recorded by a rehearsal's mirror (module docstring).
    """
    if torch.compiler.is_compiling():
        return _all_gather(x, _check_dim(x, dim, "all_gather"), purpose, _traced_group(group).group_name)
    return _eager(ALL_GATHER, x, _group(group), _check_dim(x, dim, "all_gather"), purpose)


def reduce_scatter(x: Tensor, group: dist.ProcessGroup | None = None, dim: int = 0, purpose: str = "") -> Tensor:
    """Differentiable reduce-scatter (sum): rank r gets chunk r along `dim` of the sum over ranks.

    `x.size(dim)` must be divisible by the group size. Backward is an all-gather of the gradient. `purpose`:
    as all_gather's.
    """
    compiling = torch.compiler.is_compiling()
    group = _traced_group(group) if compiling else _group(group)
    world = group.size()
    dim = _check_dim(x, dim, "reduce_scatter")
    if x.shape[dim] % world:
        raise ValueError(f"reduce_scatter: x.size({dim})={x.shape[dim]} is not divisible by the "
                         f"group size {world}")
    if compiling:
        return _reduce_scatter(x, dim, purpose, group.group_name)
    return _eager(REDUCE_SCATTER, x, group, dim, purpose)
