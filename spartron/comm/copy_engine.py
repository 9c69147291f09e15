"""The MoE token exchange over the copy engines: `spartron_symm::exchange` (one host, NVLink/P2P).

Why: NCCL's all-to-all runs as kernels that hold SMs while they move data, so an exchange
overlapped with the experts' GEMMs slows them by about what it hides; copy engines move bytes without
SMs, so this exchange is about half hidden behind the same GEMMs (docs/KERNEL_NOTES.md).

The protocol, on the caller's stream, per exchange (every rank of the group, same order), with two
receive slots per rank used in turn (exchange k uses slot k % 2):
    copy        my rows for rank p -> p's receive slot at the offset of my rows there (peer
                memory: cudaMemcpyAsync over NVLink, a copy engine); my rows for me -> the output
    arrive+wait every rank's rows have landed in every receive slot (a barrier, or epoch signals:
                model.moe.copy_engine_sync, see CudaSymmetricMemory)
    copy out    the other ranks' rows: my receive slot -> the output (a fresh tensor)
Two slots make one synchronisation per exchange enough: before I write into p's slot again
(exchange k + 2), p has copied exchange k out of it, because p's copy-out of k precedes its arrival
at k + 1 on its stream, and my wait at k + 1 (which precedes my copies of k + 2 on mine) waits for
that arrival. The barrier is a kernel spinning on one SM; with one slot a second barrier would be
needed, and the measured grouped GEMMs slow while a barrier spins beside them (one barrier instead
of two: micro-batch 1 463 -> 459 ms), so the second slot is worth its memory.
The receive slot uses the output's layout (rows in source-rank order), so the offset of rank s's
rows in rank r's buffer is the sum of what ranks before s send to r: every rank needs the whole
count matrix (`counts`, row-major [ep, ep], counts[s * ep + r] = rows s sends to r), which the MoE
dispatcher all-gathers anyway. Backward is the same exchange with the matrix transposed.

The buffer (`ExchangeBuffer`) belongs to the EP group's transport (spartron.comm.transport); the op
takes it as the opaque reference `ExchangeBuffer.ref` and autograd keeps that on the node, as
`spartron_deepep` does, so torch.compile passes it into the graph (a ContextVar scope around the
call, the earlier design, is a graph break dynamo cannot trace). It grows collectively: every rank
derives the same size from `counts`.
An event after each exchange orders the next one after it whatever stream it runs on. The checkpoint
policy saves the op (mandatory): a replay would run barriers and peer copies a second time.

Memory: CUDA symmetric memory (torch.distributed._symmetric_memory) by default. `HostSharedMemory`
(process-shared CPU tensors, gloo barriers) runs the same protocol on CPU so every rule here is
tested without a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch._library.opaque_object import register_opaque_type
from torch._opaque_base import OpaqueBase  # torch >= 2.11: opaque types derive from it

from spartron.comm.collectives import resolve_group

NAMESPACE = "spartron_symm"
OPS: tuple[str, ...] = (f"{NAMESPACE}::exchange",)
SYNCS = ("barrier", "stream_wait")  # model.moe.copy_engine_sync: see CudaSymmetricMemory
SIGNAL_BYTES = 256  # "stream_wait": the epoch signals ahead of the receive slots (one uint32 per rank)
GROWTH_QUANTUM = 64 * 2**20  # receive buffers grow in steps of this many bytes (with 25% headroom)


@dataclass(frozen=True)
class ExchangePlan:
    """Where each rank's rows go, for one rank (`rank`) of one exchange."""

    send_sizes: list[int]  # rows I send to each rank
    send_offsets: list[int]  # where they start in my input
    recv_sizes: list[int]  # rows I receive from each rank
    recv_offsets: list[int]  # where they start in my output (and my receive buffer)
    remote_offsets: list[int]  # where my rows start in each rank's receive buffer
    max_rows_received: int  # the most rows any rank receives: the receive buffer size, in rows


def _prefix(sizes: Sequence[int]) -> list[int]:
    out, total = [], 0
    for n in sizes:
        out.append(total)
        total += n
    return out


def exchange_plan(counts: Sequence[int], ep: int, rank: int) -> ExchangePlan:
    """The plan of rank `rank` for the count matrix `counts` (row-major [ep, ep], rows s sends to r)."""
    if len(counts) != ep * ep:
        raise ValueError(f"exchange: counts has {len(counts)} entries, expected {ep} x {ep}")
    if min(counts, default=0) < 0:
        raise ValueError(f"exchange: counts must be non-negative, got {list(counts)}")
    matrix = [list(counts[s * ep:(s + 1) * ep]) for s in range(ep)]
    column = [[matrix[s][r] for s in range(ep)] for r in range(ep)]
    recv = column[rank]
    return ExchangePlan(send_sizes=matrix[rank], send_offsets=_prefix(matrix[rank]), recv_sizes=recv,
                        recv_offsets=_prefix(recv),
                        remote_offsets=[sum(column[p][:rank]) for p in range(ep)],
                        max_rows_received=max(sum(c) for c in column))


def transpose_counts(counts: Sequence[int], ep: int) -> list[int]:
    """The count matrix of the reverse exchange (what s sent to r, r sends back to s)."""
    return [counts[s * ep + r] for r in range(ep) for s in range(ep)]


class SymmetricMemory(Protocol):
    """Per-rank receive buffers every rank of the group can write into, and a group synchronisation."""

    capacity_bytes: int

    def view(self, rank: int, offset_bytes: int, rows: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """Rank `rank`'s buffer from `offset_bytes` on as [rows, *row_shape] of dtype (writable from here)."""

    def arrive_and_wait(self) -> None:
        """Every rank's copies issued before this (in stream order on CUDA) are complete after it."""


def _bytes_as(buffer: Tensor, offset_bytes: int, rows: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """`rows` rows of `dtype` in the uint8 `buffer`, from `offset_bytes` on (a view)."""
    nbytes = rows * math.prod(row_shape) * dtype.itemsize
    return buffer[offset_bytes:offset_bytes + nbytes].view(dtype).view(rows, *row_shape)


class CudaSymmetricMemory:
    """torch symmetric memory: one allocation per rank, mapped into every peer (NVLink/P2P).

    `sync` (model.moe.copy_engine_sync) is how `arrive_and_wait` orders the ranks:
    - "barrier": torch's symmetric-memory barrier, a kernel that spins on one SM until every peer
      has arrived (measured);
    - "stream_wait": no kernel. The first SIGNAL_BYTES of the allocation hold one uint32 per source
      rank; each rank writes the exchange's epoch into its entry in every peer's signals
      (cuStreamWriteValue32, which fences the copies before it), and the stream then waits in its
      front end until all its own entries reach the epoch (cuStreamWaitValue32, CUDA driver API via
      ctypes: torch has the write but not the wait). Exact on the H200, but slower there than
      "barrier" (more host issue time and GPU idle time; docs/KERNEL_NOTES.md).
    """

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device, sync: str = "barrier"):
        """`sync` is one of SYNCS (ExchangeBuffer, the one constructor of this class, checks it)."""
        header = SIGNAL_BYTES if sync == "stream_wait" else 0
        try:
            import torch.distributed._symmetric_memory as symm_mem

            self._local = symm_mem.empty(header + nbytes, dtype=torch.uint8, device=device)
            self._handle = symm_mem.rendezvous(self._local, group.group_name)
        except Exception as err:  # noqa: BLE001 - the one message that says what is needed
            raise RuntimeError(
                f"model.moe.all_to_all_transport = 'copy_engine' needs torch symmetric memory over the EP "
                f"group (all EP ranks on one host, GPUs with peer access; torch {torch.__version__}): "
                f"{type(err).__name__}: {err}") from err
        self.rank, self.ep = dist.get_rank(group), dist.get_world_size(group)
        self.capacity_bytes = nbytes
        self.sync, self._header, self._epoch = sync, header, 0
        if sync == "stream_wait":
            if self.ep * 4 > SIGNAL_BYTES:
                raise ValueError(f"model.moe.copy_engine_sync = 'stream_wait' supports up to {SIGNAL_BYTES // 4} "
                                 f"EP ranks, the group has {self.ep}")
            self._wait_value32 = _cu_stream_wait_value32()
            self._signals = [self._handle.get_buffer(r, (self.ep,), torch.uint32) if r != self.rank
                             else self._local[:self.ep * 4].view(torch.uint32) for r in range(self.ep)]
            self._signals[self.rank].zero_()
            self._handle.barrier(channel=0)  # every rank's signals are zero before anyone writes one

    def view(self, rank: int, offset_bytes: int, rows: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        offset_bytes += self._header
        if rank == self.rank:
            return _bytes_as(self._local, offset_bytes, rows, row_shape, dtype)
        return self._handle.get_buffer(rank, (rows, *row_shape), dtype, offset_bytes // dtype.itemsize)

    def arrive_and_wait(self) -> None:
        if self.sync == "barrier":
            self._handle.barrier(channel=0)
            return
        from torch._C._distributed_c10d import _SymmetricMemory

        self._epoch += 1
        for peer in range(self.ep):
            if peer != self.rank:
                _SymmetricMemory.stream_write_value32(self._signals[peer], self.rank, self._epoch)
        stream = torch.cuda.current_stream(self._local.device).cuda_stream
        mine = self._signals[self.rank].data_ptr()
        for source in range(self.ep):
            if source != self.rank:
                self._wait_value32(stream, mine + 4 * source, self._epoch)


def _cu_stream_wait_value32():
    """cuStreamWaitValue32 (GEQ) from the CUDA driver, as fn(stream handle, device address, value)."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
        fn = driver.cuStreamWaitValue32_v2
    except (OSError, AttributeError) as err:
        raise RuntimeError("model.moe.copy_engine_sync = 'stream_wait' needs the CUDA driver's "
                           f"cuStreamWaitValue32_v2 (libcuda.so.1, CUDA >= 11.7): {err}") from err
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def wait(stream: int, address: int, value: int) -> None:
        rc = fn(stream, address, value, 0)  # 0 = CU_STREAM_WAIT_VALUE_GEQ
        if rc != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed with CUresult {rc}")

    return wait


class HostSharedMemory:
    """CPU stand-in for tests: `buffers[r]` is rank r's receive buffer (uint8 tensors in shared
    memory, created before the ranks fork), barriers are the group's (gloo). Fixed capacity."""

    def __init__(self, buffers: Sequence[Tensor], group: dist.ProcessGroup | None = None):
        self.buffers, self.group = list(buffers), group
        self.capacity_bytes = min(b.numel() for b in self.buffers)

    def view(self, rank: int, offset_bytes: int, rows: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return _bytes_as(self.buffers[rank], offset_bytes, rows, row_shape, dtype)

    def arrive_and_wait(self) -> None:
        dist.barrier(group=self.group)


class ExchangeBufferRef(OpaqueBase):
    """What `spartron_symm::exchange` takes: the buffer, as an opaque reference (module docstring)."""

    __slots__ = ("buffer",)

    def __init__(self, buffer: ExchangeBuffer):
        self.buffer = buffer


register_opaque_type(ExchangeBufferRef, typ="reference")


class ExchangeBuffer:
    """The receive buffers of one EP group and the exchange protocol over them (module docstring)."""

    def __init__(self, group: dist.ProcessGroup, memory: SymmetricMemory | None = None, sync: str = "barrier"):
        """`memory` None: CUDA symmetric memory, allocated (collectively) at the first exchange and
        regrown when an exchange needs more, ordered by `sync` (CudaSymmetricMemory). Given: used as is
        (its capacity, two slots, is a hard limit)."""
        if sync not in SYNCS:
            raise ValueError(f"model.moe.copy_engine_sync must be one of {SYNCS}, got {sync!r}")
        self.sync = sync
        self.group = group
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.memory = memory
        self.grows = memory is None
        self.exchanges = 0
        self._last: torch.cuda.Event | None = None
        self.ref = ExchangeBufferRef(self)  # what the op takes (one per buffer: compiled graphs guard on it)

    @property
    def allocated(self) -> bool:
        """Holds symmetric memory it allocated itself (what `destroy` releases)."""
        return self.grows and self.memory is not None

    def destroy(self) -> None:
        """Release the memory this buffer allocated (every rank of the group calls it, like the
        allocation); memory given to the constructor stays the caller's. A later exchange allocates anew."""
        if self.allocated:
            torch.cuda.synchronize()  # no queued copy still reads or writes the buffers
            self.memory, self._last = None, None

    def _reserve(self, slot_bytes: int, device: torch.device) -> SymmetricMemory:
        """Memory holding two receive slots of `slot_bytes` (aligned to 256 bytes)."""
        slot_bytes = -(-slot_bytes // 256) * 256
        nbytes = 2 * slot_bytes
        if self.memory is not None and self.memory.capacity_bytes >= nbytes:
            return self.memory
        if not self.grows:
            raise ValueError(f"exchange needs two {slot_bytes}-byte receive slots, the given memory holds "
                             f"{self.memory.capacity_bytes} bytes")
        if device.type != "cuda":
            raise ValueError(f"model.moe.all_to_all_transport = 'copy_engine' moves CUDA tensors, got {device}")
        if self.memory is not None:
            torch.cuda.synchronize(device)  # no queued copy still reads or writes the old buffers
        size = math.ceil(nbytes * 1.25 / GROWTH_QUANTUM) * GROWTH_QUANTUM  # same on every rank
        self.memory = None  # free the old allocation before the new one
        self.memory = CudaSymmetricMemory(self.group, size, device, self.sync)
        return self.memory

    def exchange(self, x: Tensor, counts: Sequence[int]) -> Tensor:
        """Rows of `x` (in destination-rank order, `counts` row-major [ep, ep]) -> rows received, in
        source-rank order. Every rank of the group calls it with the same `counts`."""
        plan = exchange_plan(counts, self.ep, self.rank)
        if sum(plan.send_sizes) != x.shape[0]:
            raise ValueError(f"exchange: counts say this rank sends {sum(plan.send_sizes)} rows, x has "
                             f"{x.shape[0]}")
        x = x.contiguous()
        row_shape = tuple(x.shape[1:])
        memory = self._reserve(plan.max_rows_received * math.prod(row_shape) * x.element_size(), x.device)
        # byte offset of this exchange's slot: 0 or half the memory (256-aligned, >= the slot: _reserve)
        slot = (self.exchanges % 2) * (memory.capacity_bytes // 2 // 256 * 256)
        rows_out = sum(plan.recv_sizes)
        out = x.new_empty(rows_out, *row_shape)
        cuda = x.device.type == "cuda"
        if cuda and self._last is not None:
            torch.cuda.current_stream(x.device).wait_event(self._last)
        for p in range(self.ep):
            n, src = plan.send_sizes[p], plan.send_offsets[p]
            if n == 0:
                continue
            if p == self.rank:
                out[plan.recv_offsets[p]:plan.recv_offsets[p] + n].copy_(x[src:src + n])
            else:
                dest = memory.view(p, slot, plan.remote_offsets[p] + n, row_shape, x.dtype)
                dest[plan.remote_offsets[p]:].copy_(x[src:src + n])
        memory.arrive_and_wait()
        mine = memory.view(self.rank, slot, rows_out, row_shape, x.dtype)
        lo = plan.recv_offsets[self.rank]
        hi = lo + plan.recv_sizes[self.rank]
        if lo > 0:
            out[:lo].copy_(mine[:lo])
        if hi < rows_out:
            out[hi:].copy_(mine[hi:])
        if cuda:
            self._last = torch.cuda.Event()
            self._last.record(torch.cuda.current_stream(x.device))
        self.exchanges += 1
        return out


def _buffer_of(ref: ExchangeBufferRef, group_name: str) -> ExchangeBuffer:
    if not isinstance(ref, ExchangeBufferRef):
        raise TypeError(f"spartron_symm::exchange takes an ExchangeBuffer's `ref` (ExchangeBufferRef), "
                        f"got {type(ref).__name__}")
    buffer = ref.buffer
    if buffer.group.group_name != group_name:
        raise RuntimeError(f"spartron_symm::exchange for group {group_name!r}, but its buffer serves "
                           f"{buffer.group.group_name!r}")
    return buffer


@torch.library.custom_op(f"{NAMESPACE}::exchange", mutates_args=())
def _exchange(buffer: ExchangeBufferRef, x: Tensor, counts: list[int], group_name: str) -> Tensor:
    return _buffer_of(buffer, group_name).exchange(x, counts)


@_exchange.register_fake
def _(buffer, x, counts, group_name):
    group = resolve_group(group_name)
    ep, rank = group.size(), group.rank()
    if any(isinstance(c, torch.SymInt) for c in counts):  # compiled: sizes from the host copy of the counts
        if len(counts) != ep * ep:
            raise ValueError(f"exchange: counts has {len(counts)} entries, expected {ep} x {ep}")
        return x.new_empty(sum(counts[s * ep + rank] for s in range(ep)), *x.shape[1:])
    plan = exchange_plan(counts, ep, rank)
    return x.new_empty(sum(plan.recv_sizes), *x.shape[1:])


def _setup(ctx, inputs, output):
    ctx.buffer, _, ctx.counts, ctx.group_name = inputs


def _grad(ctx, grad):
    ep = resolve_group(ctx.group_name).size()
    return None, _exchange(ctx.buffer, grad.contiguous(), transpose_counts(ctx.counts, ep), ctx.group_name), None, None


_exchange.register_autograd(_grad, setup_context=_setup)


def exchange(buffer: ExchangeBuffer, x: Tensor, counts: Sequence[int]) -> Tensor:
    """Differentiable exchange of `x`'s rows over `buffer`'s group (see the module docstring)."""
    # bad counts: the op's plan raises before any copy or synchronisation; compiled, they are SymInts
    counts = list(counts) if torch.compiler.is_compiling() else [int(c) for c in counts]
    return _exchange(buffer.ref, x, counts, buffer.group.group_name)
