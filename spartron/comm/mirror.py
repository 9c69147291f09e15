"""A mirrored process group: one rank of an N-rank run, alone, with every collective answered locally.

Why: `spartron rehearse` runs rank R's true-shape part of an N-rank job on one device. Its collectives
must return tensors of their true shapes and finite values without a peer. The mirror's rule is exact,
not approximate: every answer is what a REAL N-rank run returns when every rank holds identical data
(identical shards, identical tokens, so identical routing). That fixes each collective:

- all-gather: every slot is the local input (every rank's shard is this one);
- reduce-scatter / all-reduce: SUM is N x the local chunk, AVG the local chunk, PREMUL_SUM(f) f x N x the
  chunk, MAX / MIN the chunk (what summing N identical values gives; FSDP2's divide factors then make
  the mean). Values stay finite: bf16 / fp32 hold N x a finite gradient for any N a job has;
- broadcast: the local tensor (the source holds the same); barrier: nothing to wait for;
- all-to-all: every source j sends this rank what this rank sends itself (its own chunk R), so the
  received split sizes are `[input_split_sizes[R]] * N` (what exchanging the counts returns). A caller
  that asks for other sizes (the MoE combine, returning rows to the ranks they came from) gets each
  chunk filled with rows of chunk R taken cyclically (of the whole input if chunk R is empty): true
  shapes and finite values, but not the peers' values, which were computed by experts this rank does
  not hold. So a mirrored forward equals a real identical-data one exactly where no MoE combine crosses
  ranks (EP = 1); with EP > 1 its shapes, bytes and costs are the real ones. With `balanced=True` the receive side is
  evened instead (a symmetric routing whose per-expert loads are the mean of what this rank sends,
  spread over every slot): integer all-to-alls (the MoE per-expert counts) return the mean count in
  every slot (remainders to the first slots, so totals are kept), and data all-to-alls (rows of any dtype, the
  FP8 wire's uint8 rows included) fill each chunk with rows taken cyclically from the input.
  Only the identical rule equals a real run.

Every call is recorded in a `CommLedger` (kind, group description and size, bytes in the nccl-tests
sense, purpose) so the rehearsal can model what the collectives would cost on a real cluster. The purpose
is what the caller says the collective is for (`labelled`): the group cannot tell, since identical rank
sets share one group (with fsdp = 1, CP's KV all-gathers and FSDP2's parameter all-gathers run on the same
group object). Every collective the project issues in a step names its purpose; what is left unlabelled
is what torch issues on the project's behalf (FSDP2's parameter all-gathers, gradient reduce-scatters and
HSDP gradient all-reduces). Point-to-point
and DeepEP's / the copy-engine exchange's peer-memory buffers have no mirrored meaning: they are
refused (spartron.comm.transport checks `is_mirrored`).

The backend is registered once per process through torch.distributed's public `Backend.register_backend`; a
Python subclass of `ProcessGroup` is returned as the group itself (no C++ backend). Its creator holds no world:
the default group of a world makes the world's ledger (and takes `balanced` from its `MirrorOptions`), every
later group of that world shares the default group's.

Several worlds in one process (rehearsals one after another): DTensor caches its sharding propagation and
redistribution plans by DeviceMesh equality, which compares the mesh's ranks and names but not which rank this
process is, nor its groups. A second world whose mesh equals the first one's got the first world's DeviceMesh
back from those caches (through `to_empty`'s DTensor op): rank 0 of a second 16-rank world held a mesh whose
coordinate was the first world's rank 13, so `materialize_` sliced a [0, 64] chunk for its [1, 64] shard, and
its collectives went to the first world's destroyed groups. `mirrored_world` clears those caches as it starts
and ends (what torch's own DTensor tests do between worlds).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from itertools import groupby

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ReduceOp

BACKEND = "spartron_mirror"


class MirrorError(RuntimeError):
    """A collective that a mirrored rank cannot answer (point-to-point, peer memory)."""


@dataclass
class CollectiveRecord:
    """One collective kind on one group: calls and bytes (nccl-tests' size: the all-gather's output,
    the reduce-scatter's input, the all-reduce's buffer, the all-to-all's input, per rank)."""

    kind: str
    group: str
    size: int
    ranks: tuple[int, ...]
    calls: int = 0
    bytes: int = 0
    reduce_ops: tuple[str, ...] = ()  # the reductions asked for (SUM, AVG, PREMUL_SUM, ...), in first-seen order
    purpose: str = ""  # what the caller said the collective is for (`labelled`); "" when it said nothing


@dataclass
class CommLedger:
    """Every mirrored collective of one world, keyed by (kind, group description, purpose). `enabled` False:
    calls are answered but not counted (set-up traffic a step does not repeat). `purpose`: the label of the
    calls made now (`labelled`), "" outside any."""

    records: dict[tuple[str, str, str], CollectiveRecord] = field(default_factory=dict)
    enabled: bool = True
    purpose: str = ""

    @contextmanager
    def labelled(self, purpose: str) -> Iterator[None]:
        """Record the collectives called inside as `purpose` (the innermost label wins)."""
        outer, self.purpose = self.purpose, purpose
        try:
            yield
        finally:
            self.purpose = outer

    def add(self, kind: str, pg: MirroredProcessGroup, nbytes: int, op: ReduceOp | None = None) -> None:
        if not self.enabled:
            return
        key = (kind, pg.description, self.purpose)
        rec = self.records.get(key)
        if rec is None:
            rec = self.records[key] = CollectiveRecord(kind, pg.description, pg.size(), pg.global_ranks,
                                                       purpose=self.purpose)
        rec.calls += 1
        rec.bytes += int(nbytes)
        if op is not None and _kind(op).name not in rec.reduce_ops:
            rec.reduce_ops += (_kind(op).name,)

    def take(self) -> list[CollectiveRecord]:
        """The records so far, and a fresh start (one step's records at a time)."""
        out = sorted(self.records.values(), key=lambda r: (r.group, r.kind, r.purpose))
        self.records = {}
        return out


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _kind(op: ReduceOp) -> ReduceOp.RedOpType:
    """The RedOpType of a ReduceOp (what options carry) or of a bare RedOpType (ReduceOp.SUM is one: it passes
    isinstance(..., ReduceOp) but has no `.op`)."""
    return getattr(op, "op", op)


def _reduced(x: Tensor, op: ReduceOp, n: int) -> Tensor:
    """What reducing n identical copies of x gives (finite for finite x)."""
    kind = _kind(op)
    if kind == ReduceOp.RedOpType.SUM:
        return x * n
    if kind == ReduceOp.RedOpType.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if factor is None:
            raise MirrorError("mirrored reduce: PREMUL_SUM without a readable factor in this torch")
        return x * (float(factor) * n)
    if kind in (ReduceOp.RedOpType.AVG, ReduceOp.RedOpType.MAX, ReduceOp.RedOpType.MIN):
        return x
    raise MirrorError(f"mirrored reduce: {kind} is not mirrored (SUM, AVG, PREMUL_SUM, MAX and MIN are)")


class _Done(dist.Work):
    """A finished collective: the mirror answers synchronously."""

    def __init__(self, result: object = None) -> None:
        super().__init__()
        self._future = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout: timedelta | None = None) -> bool:  # noqa: ARG002
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


class MirroredProcessGroup(dist.ProcessGroup):
    """Rank `rank` of a group of `size` whose other members mirror it (module docstring)."""

    def __init__(self, rank: int, size: int, ledger: CommLedger, global_ranks: Sequence[int], balanced: bool):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self.ledger, self.balanced = ledger, balanced
        self.global_ranks = tuple(global_ranks)
        self._name, self._desc = "", ""

    # torch reads a group's name and description from its C++ backend, which a Python group has none of
    def _set_group_name(self, name: str) -> None:
        self._name = name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_name(self) -> str:
        return self._name

    @property
    def group_desc(self) -> str:
        return self._desc

    @property
    def description(self) -> str:
        """The group's description without the project prefix (fsdp_cp, ep, ...), else its ranks."""
        desc = self._desc
        return desc.removeprefix("spartron_") if desc and desc != "undefined" else f"group{list(self.global_ranks)}"

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def _get_backend(self, device: torch.device) -> MirroredProcessGroup:  # noqa: ARG002
        return self  # the group answers every device itself

    # ---- gathers -------------------------------------------------------------------------------
    def _gather_into(self, out: Tensor, x: Tensor) -> None:
        self.ledger.add("all_gather", self, _nbytes(out))
        out.view(self._size, -1).copy_(x.reshape(1, -1).expand(self._size, -1))

    def _allgather_base(self, out: Tensor, x: Tensor, opts: object = None) -> _Done:  # noqa: ARG002
        self._gather_into(out, x)
        return _Done([out])

    def all_gather_single(self, out: Tensor, x: Tensor, opts: object = None) -> _Done:  # noqa: ARG002
        self._gather_into(out, x)
        return _Done([out])

    def allgather_into_tensor_coalesced(self, outs: list[Tensor], xs: list[Tensor], opts: object = None) -> _Done:  # noqa: ARG002
        for out, x in zip(outs, xs, strict=True):
            self._gather_into(out, x)
        return _Done(outs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def allgather(self, out_lists: list[list[Tensor]], xs: list[Tensor], opts: object = None) -> _Done:  # noqa: ARG002
        for outs, x in zip(out_lists, xs, strict=True):
            self.ledger.add("all_gather", self, _nbytes(x) * self._size)
            for out in outs:
                out.copy_(x)
        return _Done(out_lists)

    # ---- reductions ----------------------------------------------------------------------------
    def _scatter_into(self, out: Tensor, x: Tensor, op: ReduceOp) -> None:
        self.ledger.add("reduce_scatter", self, _nbytes(x), op)
        out.copy_(_reduced(x.reshape(self._size, -1)[self._rank].view(out.shape), op, self._size))

    def _reduce_scatter_base(self, out: Tensor, x: Tensor, opts: dist.ReduceScatterOptions) -> _Done:
        self._scatter_into(out, x, opts.reduceOp)
        return _Done([out])

    def reduce_scatter_single(self, out: Tensor, x: Tensor, opts: dist.ReduceScatterOptions) -> _Done:
        self._scatter_into(out, x, opts.reduceOp)
        return _Done([out])

    def reduce_scatter_tensor_coalesced(self, outs: list[Tensor], xs: list[Tensor],
                                        opts: dist.ReduceScatterOptions) -> _Done:
        for out, x in zip(outs, xs, strict=True):
            self._scatter_into(out, x, opts.reduceOp)
        return _Done(outs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def reduce_scatter(self, outs: list[Tensor], in_lists: list[list[Tensor]],
                       opts: dist.ReduceScatterOptions) -> _Done:
        for out, ins in zip(outs, in_lists, strict=True):
            self.ledger.add("reduce_scatter", self, sum(_nbytes(t) for t in ins), opts.reduceOp)
            out.copy_(_reduced(ins[self._rank], opts.reduceOp, self._size))
        return _Done(outs)

    def allreduce(self, xs: list[Tensor], opts: object = None) -> _Done:
        op = getattr(opts, "reduceOp", ReduceOp.SUM)
        for x in xs:
            self.ledger.add("all_reduce", self, _nbytes(x), op)
            x.copy_(_reduced(x, op, self._size))
        return _Done(xs)

    allreduce_coalesced = allreduce

    def reduce(self, xs: list[Tensor], opts: object) -> _Done:
        return self.allreduce(xs, opts)

    def broadcast(self, xs: list[Tensor], opts: object = None) -> _Done:  # noqa: ARG002
        for x in xs:
            self.ledger.add("broadcast", self, _nbytes(x))
        return _Done(xs)

    def barrier(self, opts: object = None) -> _Done:  # noqa: ARG002
        return _Done()

    # ---- all-to-all ----------------------------------------------------------------------------
    def _fill_received(self, out: Tensor, x: Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        """Write into ``out`` the rows every source sends here (module docstring), in source order.

        Filled in place: a mirrored all-to-all of the dispatch rows must cost no more memory than the real one,
        whose only buffer is ``out`` (a rehearsal must not die of its own copies), and in few contiguous copies,
        since the rehearsal counts their time as compute: per run of sources with equal counts, the first part
        then doubling copies (a broadcast copy of the run ran 3.5x slower than memcpys on the H100).
        """
        chunks = list(torch.split(x, in_splits)) if in_splits else list(x.chunk(self._size))
        mine = chunks[self._rank]
        if self.balanced and _is_counts(x):  # per-expert counts: the mean in every slot
            total = torch.stack(list(x.view(self._size, -1))).sum(dim=0)
            base, rest = total // self._size, total % self._size
            slot = torch.arange(self._size, device=x.device).view(-1, 1)
            out.copy_((base.unsqueeze(0) + (slot < rest.unsqueeze(0)).to(x.dtype)).reshape(out.shape))
            return
        source = mine if mine.shape[0] else x
        rows = out.view(-1, *x.shape[1:])
        start = 0
        for n, run in groupby(out_splits):  # a run of sources sending equally many rows: contiguous in `out`
            count = len(list(run))
            region = rows[start:start + count * n]
            if source.shape[0] == 0:
                region.zero_()
            else:
                for offset in range(0, n, source.shape[0]):  # the first source's part: this rank's rows, cyclic
                    take = min(source.shape[0], n - offset)
                    region[offset:offset + take].copy_(source[:take])
                done = n
                while done < count * n:  # then doubling: each copy contiguous (a memcpy), log2(count) of them
                    take = min(done, count * n - done)
                    region[done:done + take].copy_(region[:take])
                    done += take
            start += count * n

    def alltoall_base(self, out: Tensor, x: Tensor, out_splits: list[int], in_splits: list[int],
                      opts: object = None) -> _Done:  # noqa: ARG002
        self.ledger.add("all_to_all", self, _nbytes(x))
        out_splits = list(out_splits) or [out.shape[0] // self._size] * self._size
        in_splits = list(in_splits) or [x.shape[0] // self._size] * self._size
        self._fill_received(out, x, out_splits, in_splits)
        return _Done([out])

    all_to_all_single = alltoall_base

    def alltoall(self, outs: list[Tensor], xs: list[Tensor], opts: object = None) -> _Done:  # noqa: ARG002
        self.ledger.add("all_to_all", self, sum(_nbytes(t) for t in xs))
        for out in outs:
            out.copy_(xs[self._rank])
        return _Done(outs)

    # ---- what has no mirrored meaning ----------------------------------------------------------
    def _refuse(self, what: str) -> None:
        raise MirrorError(f"{what} on a mirrored process group: a mirrored rank has no peer to send to or "
                          "receive from (only collectives are mirrored)")

    def send(self, *args: object) -> None:  # noqa: ARG002
        self._refuse("send")

    def recv(self, *args: object) -> None:  # noqa: ARG002
        self._refuse("recv")

    def recv_anysource(self, *args: object) -> None:  # noqa: ARG002
        self._refuse("recv_anysource")

    def gather(self, *args: object) -> None:  # noqa: ARG002
        self._refuse("gather")

    def scatter(self, *args: object) -> None:  # noqa: ARG002
        self._refuse("scatter")


def is_mirrored(group: dist.ProcessGroup | None) -> bool:
    """True for a mirrored group (or the default group of a mirrored world when `group` is None)."""
    if group is None:
        group = dist.group.WORLD if dist.is_initialized() else None
    return isinstance(group, MirroredProcessGroup)


@contextmanager
def labelled(purpose: str, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Collectives called inside on `group` (None: the world) are recorded as `purpose` when the group is
    mirrored (a rehearsal); elsewhere this does nothing. Callers label what they know a collective is for
    (the loss normalisation, the gradient norm, ...) so the rehearsal report need not guess it from the
    group, which identical rank sets share."""
    if group is None:
        group = dist.group.WORLD if dist.is_initialized() else None
    if not isinstance(group, MirroredProcessGroup):
        yield
        return
    with group.ledger.labelled(purpose):
        yield


@dataclass(frozen=True)
class MirrorOptions:
    """The default group's options (init_process_group's pg_options): how the world's all-to-alls answer."""

    balanced: bool = False


def _is_counts(x: Tensor) -> bool:
    """An all-to-all of per-expert counts (one integer per expert slot), which `balanced` evens; rows of any
    dtype are data, the FP8 dispatch wire's uint8 rows included (evened as counts they were byte means: NaN
    scales, a V3 rehearsal's grad norm NaN at step 1)."""
    return x.dim() == 1 and x.dtype in (torch.int32, torch.int64)


def _create(opts: object, pg_options: object) -> MirroredProcessGroup:
    """The backend's creator: the default group starts the world's ledger, later groups share it."""
    ranks = opts.global_ranks_in_group or range(opts.group_size)
    if not dist.is_initialized():  # the default group of a new world
        balanced = pg_options.balanced if isinstance(pg_options, MirrorOptions) else False
        return MirroredProcessGroup(opts.group_rank, opts.group_size, CommLedger(), ranks, balanced)
    world = dist.group.WORLD
    if not isinstance(world, MirroredProcessGroup):
        raise MirrorError(f"a {BACKEND} group needs a mirrored world (spartron.comm.mirror.mirrored_world)")
    return MirroredProcessGroup(opts.group_rank, opts.group_size, world.ledger, ranks, world.balanced)


def _forget_dtensor_caches() -> None:
    """Drop DTensor's caches keyed by DeviceMesh equality, which ignores this process's rank and groups (module
    docstring): the sharding propagation (Python and, where this torch has one, C++ fast path; torch's debug
    helper clears both) and, where this torch caches them, the redistribution plans."""
    from torch.distributed.tensor import _redistribute as redistribute
    from torch.distributed.tensor import debug

    debug._clear_sharding_prop_cache()
    transforms = getattr(redistribute, "_gen_transform_infos", None)
    if hasattr(transforms, "cache_clear"):
        transforms.cache_clear()
    planners = getattr(redistribute, "clear_redistribute_planner_cache", None)
    if planners is not None:
        planners()


@contextmanager
def mirrored_world(rank: int, world_size: int, balanced: bool = False,
                   timeout: timedelta = timedelta(minutes=30)) -> Iterator[CommLedger]:
    """torch.distributed initialised as rank `rank` of a mirrored world of `world_size` for the duration;
    yields the ledger every group of that world records into. `balanced`: see the module docstring."""
    if dist.is_initialized():
        raise MirrorError("mirrored_world: torch.distributed is already initialised in this process")
    if not 0 <= rank < world_size:
        raise MirrorError(f"rank {rank} is outside a world of {world_size}")
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    _forget_dtensor_caches()
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=world_size, timeout=timeout,
                            pg_options=MirrorOptions(balanced))
    try:
        yield dist.group.WORLD.ledger
    finally:
        dist.destroy_process_group()
        _forget_dtensor_caches()
