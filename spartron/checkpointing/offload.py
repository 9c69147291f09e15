"""Offload windows: the saved inputs of checkpoint regions go to host memory between forward and backward.

One rule, written once here:
- `offload_window(config, n_regions)` says which regions are in the window (the region indices are
  the positions `checkpoint_regions(model)` returns: assigned once by apply, in call order, the same
  with or without intra-layer micro-batching, since micro-batches run inside one region call).
- An `ActivationOffloader` lives for the whole run: the window, the host-buffer pool (reused across
  steps, bounded, reported) and the D2H / H2D side streams. `offloader.session()` opens the state of
  ONE training step; the step enters it around its forward and backward passes and closes it at the
  end. There is no process-wide state and no "the block index went down" inference: what belongs to
  a step is what ran inside its session.
- While a session is open every region runs its calls under `saved_tensors_hooks`. The reentrant
  boundary saves its inputs with `ctx.save_for_backward` (and torch's non-reentrant checkpoint saves
  its floating inputs the same way), so the pack hook sees exactly those tensors: matching is by
  tensor identity, never by shared storage. A compiled region (CheckpointRegion.compile) runs under
  the same hooks, outside its graph: what its pack hook sees is what the compiled graph saves for
  backward (its inputs and the outputs its policy keeps). A tensor of a region in the window, on the offload
  device, of at least `min_bytes` (floating point; integer index tensors such as the DSA top-k ids
  too with `what = "inputs_and_dsa_ids"`) is copied into a pooled host buffer on the D2H stream and
  the hook keeps no reference to the device tensor: the caching allocator frees it once the copy
  (recorded on the D2H stream) completes. No `storage().resize_(0)`, so views other code holds stay
  valid. The same tensor saved by several regions (the ids a DSA source hands to its consumers) is
  copied once.
- In backward, the first unpack of region call c means its backward has started: the session
  copies back the offloaded tensors of calls c, c-1, ..., c-prefetch_depth on the H2D stream; the
  unpack makes the compute stream wait for that copy's event. Host buffers return to the pool when
  their last user has unpacked, guarded by the H2D event so the next D2H never overwrites them early.
- On CPU the same code runs with plain host copies (no pinning, no streams), so every rule is tested
  in CI; the session's own accounting (`stats.peak_device_bytes`) stands in for allocator stats.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from spartron.checkpointing.boundary import CheckpointRegion
from spartron.checkpointing.config import OffloadConfig


class OffloadSetupError(ValueError):
    """An offload config that cannot work with this model (raised before the first step)."""


def offload_window(config: OffloadConfig, n_regions: int) -> frozenset[int]:
    """THE window rule: indices of the regions whose saved inputs are offloaded."""
    if not config.enabled:
        return frozenset()
    if n_regions == 0:
        raise OffloadSetupError("offload.enabled is true but the model has no checkpoint regions "
                                "(set ac.mode to 'full' or 'selective')")
    if config.window == "all_but_last":
        if config.keep_last >= n_regions:
            raise OffloadSetupError(
                f"offload.keep_last = {config.keep_last} keeps every one of the {n_regions} checkpoint "
                "regions on device, so the window is empty; lower offload.keep_last or disable offload")
        return frozenset(range(n_regions - config.keep_last))
    bad = sorted(i for i in config.window if not 0 <= i < n_regions)
    if bad:
        raise OffloadSetupError(f"offload.window names regions {bad}, but the model has {n_regions} "
                                f"checkpoint regions (indices 0..{n_regions - 1})")
    if not config.window or len(set(config.window)) != len(config.window):
        raise OffloadSetupError(f"offload.window must be a non-empty list of distinct region indices, "
                                f"got {config.window}")
    return frozenset(config.window)


def checkpoint_regions(model_or_regions: nn.Module | Sequence[CheckpointRegion]) -> list[CheckpointRegion]:
    """The regions of a model in module order (= call order of the decoder stack, then MTP)."""
    if isinstance(model_or_regions, nn.Module):
        from spartron.checkpointing.apply import checkpoint_region_of

        found = (checkpoint_region_of(m) for m in model_or_regions.modules())
        return [r for r in found if r is not None]
    return list(model_or_regions)


# ---------------------------------------------------------------------------------------------- pool

@dataclass
class PoolStats:
    buffers: int = 0  # host buffers ever allocated
    allocated_bytes: int = 0  # their total size (never shrinks: the pool keeps them for the next step)
    acquisitions: int = 0
    reuses: int = 0  # acquisitions served by a free buffer
    refused: int = 0  # acquisitions refused because pool_max_bytes would be exceeded
    in_use_bytes: int = 0
    peak_in_use_bytes: int = 0


class HostBufferPool:
    """Flat uint8 host buffers keyed by byte size, pinned when the offload device is CUDA.

    A released buffer carries the event of the last copy that reads it; the next user's copy stream
    waits on it. Allocation stops at `max_bytes` (the caller then keeps its tensor on device).
    """

    def __init__(self, max_bytes: int, pin: bool) -> None:
        self.max_bytes = max_bytes
        self.pin = pin
        self.free: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        self.stats = PoolStats()

    def acquire(self, nbytes: int) -> tuple[torch.Tensor, Any] | None:
        s = self.stats
        s.acquisitions += 1
        free = self.free.get(nbytes)
        if free:
            s.reuses += 1
            entry = free.pop()
        elif s.allocated_bytes + nbytes > self.max_bytes:
            s.refused += 1
            return None
        else:
            entry = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin), None)
            s.buffers += 1
            s.allocated_bytes += nbytes
        s.in_use_bytes += nbytes
        s.peak_in_use_bytes = max(s.peak_in_use_bytes, s.in_use_bytes)
        return entry

    def release(self, buffer: torch.Tensor, last_read: Any = None) -> None:
        self.stats.in_use_bytes -= buffer.numel()
        self.free.setdefault(buffer.numel(), []).append((buffer, last_read))


# ------------------------------------------------------------------------------------------ offloader

@dataclass
class _Streams:
    d2h: Any
    h2d: Any


class ActivationOffloader:
    """Run-long offload state for one model: window, host-buffer pool, side streams."""

    def __init__(self, regions: Sequence[CheckpointRegion], config: OffloadConfig,
                 device: torch.device | str) -> None:
        self.regions = list(regions)
        self.config = config
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.window = offload_window(config, len(self.regions))
        self.pool = HostBufferPool(config.pool_max_bytes, pin=self.device.type == "cuda")
        self.streams = (_Streams(torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
                        if self.device.type == "cuda" else None)

    @classmethod
    def for_model(cls, model: nn.Module, config: OffloadConfig,
                  device: torch.device | str | None = None) -> ActivationOffloader:
        if device is None:
            device = next(model.parameters()).device
        return cls(checkpoint_regions(model), config, device)

    def session(self, on_region_backward: Callable[[int], None] | None = None,
                on_region_forward: Callable[[int], None] | None = None) -> OffloadSession:
        """The state of one step. The optional observers (diagnostics: benchmarks/offload.py's memory
        by phase) get the region index when a region call starts (`on_region_forward`) and when its
        backward starts (`on_region_backward`, before its restores are issued)."""
        return OffloadSession(self, on_region_backward, on_region_forward)


@contextlib.contextmanager
def offload_session(model_or_regions: nn.Module | Sequence[CheckpointRegion], config: OffloadConfig,
                    device: torch.device | str | None = None) -> Iterator[OffloadSession]:
    """One-off session with its own offloader (tests, scripts). A training loop builds one
    ActivationOffloader and opens `offloader.session()` per step, so host buffers are reused."""
    if device is None:
        if isinstance(model_or_regions, nn.Module):
            device = next(model_or_regions.parameters()).device
        else:
            device = "cpu"
    offloader = ActivationOffloader(checkpoint_regions(model_or_regions), config, device)
    with offloader.session() as session:
        yield session


# ------------------------------------------------------------------------------------------- session

@dataclass
class SessionStats:
    region_calls: int = 0
    offloaded_tensors: int = 0
    offloaded_bytes: int = 0  # device bytes copied to host (deduplicated tensors counted once)
    deduplicated_tensors: int = 0  # saves of a tensor another region of this step already offloaded
    kept_tensors: int = 0  # saved tensors left on device (outside the window, small, other device, ...)
    kept_bytes: int = 0
    restored_tensors: int = 0
    prefetched_ahead: int = 0  # restores issued before their region's backward started
    device_bytes: int = 0  # device bytes currently held through this session's saved-tensor handles
    peak_device_bytes: int = 0

    def _add_device(self, nbytes: int) -> None:
        self.device_bytes += nbytes
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)


@dataclass
class _HostCopy:
    """One host copy of one device tensor; several handles share it when regions save the same tensor."""

    buffer: torch.Tensor
    host: torch.Tensor  # buffer viewed with the source's dtype, shape and strides
    d2h_done: Any  # CUDA event, None on CPU
    d2h_started: Any  # CUDA event (timing: benchmarks/offload.py), None on CPU
    source_id: int  # id() of the device tensor (identity key while it is alive)
    users: int = 0


@dataclass
class _Handle:
    call: _RegionCallRecord
    nbytes: int
    tensor: torch.Tensor | None = None  # kept on device, or the restored copy once prefetched
    host: _HostCopy | None = None
    device_ref: weakref.ref | None = None  # the device tensor handed to autograd (or restored): alive until
    # its region's backward has finished
    h2d_done: Any = None
    unpacked: bool = False


@dataclass
class _RegionCallRecord:
    index: int  # call order in the session
    key: int  # region index (the window's key)
    in_window: bool
    handles: list[_Handle] = field(default_factory=list)
    backward_started: bool = False


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense (any dim order): its bytes are one block a strided view can address."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class OffloadSession:
    """The offload state of one training step. Enter it around the step's forward and backward."""

    def __init__(self, offloader: ActivationOffloader,
                 on_region_backward: Callable[[int], None] | None = None,
                 on_region_forward: Callable[[int], None] | None = None) -> None:
        self.offloader = offloader
        self.on_region_backward = on_region_backward
        self.on_region_forward = on_region_forward
        self.config = offloader.config
        self.stats = SessionStats()
        self.calls: list[_RegionCallRecord] = []
        self._by_identity: dict[int, tuple[weakref.ref, _HostCopy]] = {}
        self._open = False

    # -- lifetime -----------------------------------------------------------------------------
    def __enter__(self) -> OffloadSession:
        regions = self.offloader.regions
        if any(r.saved_inputs_scope is not None for r in regions):
            raise RuntimeError("a checkpoint region is already attached to another open offload session; "
                               "close the previous step's session first")
        for key, region in enumerate(regions):
            region.saved_inputs_scope = functools.partial(self._region_scope, key)
        self._open = True
        return self

    def __exit__(self, *exc: object) -> None:
        for region in self.offloader.regions:
            region.saved_inputs_scope = None
        self._open = False
        # Host copies whose regions never ran backward (a graph dropped without backward) go back.
        for call in self.calls:
            for handle in call.handles:
                if handle.host is not None and not handle.unpacked:
                    handle.unpacked = True
                    self._release_host(handle.host)
                handle.tensor = None
        self._by_identity.clear()

    # -- forward ------------------------------------------------------------------------------
    def _region_scope(self, key: int) -> contextlib.AbstractContextManager:
        if self.on_region_forward is not None:
            self.on_region_forward(key)
        call = _RegionCallRecord(len(self.calls), key, key in self.offloader.window)
        self.calls.append(call)
        self.stats.region_calls += 1
        return torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, call), self._unpack)

    def _wants(self, call: _RegionCallRecord, t: torch.Tensor) -> bool:
        nbytes = t.numel() * t.element_size()
        if not call.in_window or nbytes == 0 or nbytes < self.config.min_bytes:
            return False
        if t.device != self.offloader.device or t.layout != torch.strided or type(t) is not torch.Tensor:
            return False
        if not (t.is_floating_point() or t.is_complex()) and self.config.what != "inputs_and_dsa_ids":
            return False
        return _dense(t)

    def _pack(self, call: _RegionCallRecord, t: torch.Tensor) -> _Handle:
        nbytes = t.numel() * t.element_size()
        handle = _Handle(call, nbytes)
        call.handles.append(handle)
        if self._wants(call, t):
            handle.host = self._host_copy_of(t)
        if handle.host is None:
            handle.tensor = t
            self.stats.kept_tensors += 1
            self.stats.kept_bytes += nbytes
            self.stats._add_device(nbytes)
        else:
            handle.host.users += 1
        return handle

    def _host_copy_of(self, t: torch.Tensor) -> _HostCopy | None:
        with _disable_current_modes():  # the window's copies are not the region's ops (policy, replay check)
            return self._host_copy_unseen(t)

    def _host_copy_unseen(self, t: torch.Tensor) -> _HostCopy | None:
        known = self._by_identity.get(id(t))
        if known is not None and known[0]() is t:
            self.stats.deduplicated_tensors += 1
            return known[1]
        nbytes = t.numel() * t.element_size()
        entry = self.offloader.pool.acquire(nbytes)
        if entry is None:
            return None
        buffer, last_read = entry
        host = buffer.view(t.dtype).as_strided(t.shape, t.stride())
        streams = self.offloader.streams
        self.stats._add_device(nbytes)
        if streams is None:
            host.copy_(t.detach())
            done = started = None
        else:
            compute = torch.cuda.current_stream(t.device)
            streams.d2h.wait_stream(compute)  # the producer of t has finished writing it
            with torch.cuda.stream(streams.d2h):
                if last_read is not None:
                    streams.d2h.wait_event(last_read)  # the buffer's previous H2D read is done
                started = torch.cuda.Event(enable_timing=True)
                started.record(streams.d2h)
                host.copy_(t.detach(), non_blocking=True)
                done = torch.cuda.Event(enable_timing=True)
                done.record(streams.d2h)
            t.record_stream(streams.d2h)  # its memory is reused only after the copy completes
        copy = _HostCopy(buffer, host, done, started, id(t))
        self._by_identity[id(t)] = (weakref.ref(t), copy)
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += nbytes
        self.stats._add_device(-nbytes)  # the handle holds no reference to t
        return copy

    # -- backward -----------------------------------------------------------------------------
    def _unpack(self, handle: _Handle) -> torch.Tensor:
        if handle.unpacked:
            raise RuntimeError(f"offloaded input of region {handle.call.key} unpacked twice; backward twice "
                               "through an offloaded region (retain_graph) is not supported")
        if not self._open:
            raise RuntimeError(f"region {handle.call.key} ran backward after its offload session closed; "
                               "keep the step's forward and backward inside one session")
        call = handle.call
        if not call.backward_started:
            call.backward_started = True
            if self.on_region_backward is not None:
                self.on_region_backward(call.key)
            for ahead in self.calls[max(0, call.index - self.config.prefetch_depth): call.index + 1]:
                self._restore(ahead, ahead is not call)
        handle.unpacked = True
        tensor, handle.tensor = handle.tensor, None
        handle.device_ref = weakref.ref(tensor)
        self.stats._add_device(-handle.nbytes)
        if handle.host is not None:
            if handle.h2d_done is not None:
                compute = torch.cuda.current_stream(tensor.device)
                compute.wait_event(handle.h2d_done)
                tensor.record_stream(compute)
            self._release_host(handle.host)
        return tensor

    def _restore(self, call: _RegionCallRecord, ahead: bool) -> None:
        """Issue the host->device copies of one region call's offloaded tensors (once)."""
        with _disable_current_modes():  # not ops of the region replaying now
            self._restore_unseen(call, ahead)

    def _restore_unseen(self, call: _RegionCallRecord, ahead: bool) -> None:
        call.backward_started = call.backward_started or not ahead
        for handle in call.handles:
            if handle.host is None or handle.unpacked or handle.tensor is not None:
                continue
            host = handle.host.host
            streams = self.offloader.streams
            if streams is None:
                handle.tensor = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype).copy_(host)
            else:
                with torch.cuda.stream(streams.h2d):
                    if handle.host.d2h_done is not None:
                        streams.h2d.wait_event(handle.host.d2h_done)
                    handle.tensor = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype,
                                                        device=self.offloader.device)
                    handle.tensor.copy_(host, non_blocking=True)
                    handle.h2d_done = torch.cuda.Event()
                    handle.h2d_done.record(streams.h2d)
            handle.device_ref = weakref.ref(handle.tensor)
            self.stats._add_device(handle.nbytes)
            self.stats.restored_tensors += 1
            self.stats.prefetched_ahead += int(ahead)

    def _release_host(self, copy: _HostCopy) -> None:
        copy.users -= 1
        if copy.users > 0:
            return
        known = self._by_identity.get(copy.source_id)
        if known is not None and known[1] is copy:
            del self._by_identity[copy.source_id]
        last_read = None
        if self.offloader.streams is not None:
            last_read = torch.cuda.Event()
            last_read.record(self.offloader.streams.h2d)  # after every H2D that read this buffer
        self.offloader.pool.release(copy.buffer, last_read)

    def offloaded_still_referenced(self) -> list[tuple[int, int]]:
        """(region call index, bytes) of offloaded tensors whose device memory something else still
        holds. The window frees nothing for these until that reference goes: for example a caller
        that keeps the first layer's input in a local variable for the whole forward."""
        out = []
        for call in self.calls:
            for handle in call.handles:
                known = self._by_identity.get(handle.host.source_id) if handle.host is not None else None
                if known is not None and known[1] is handle.host and known[0]() is not None:
                    out.append((call.index, handle.nbytes))
        return out

    def live_restored(self) -> list[tuple[int, int]]:
        """(region call index, bytes) of every restored device copy still alive. A copy lives from
        its restore until its region's backward has finished (autograd then frees the saved input);
        a copy alive after that would keep offloaded bytes on device and defeat the window."""
        return [(call.index, handle.nbytes) for call in self.calls for handle in call.handles
                if handle.host is not None and handle.device_ref is not None and handle.device_ref() is not None]

    def held_device_bytes(self) -> int:
        """Device bytes of this step's saved region tensors alive right now: kept on device and not yet
        used, or restored / handed to a backward that has not finished."""
        return sum(h.nbytes for call in self.calls for h in call.handles
                   if h.tensor is not None or (h.device_ref is not None and h.device_ref() is not None))

    def host_copies(self) -> list[_HostCopy]:
        """This step's distinct host copies (for timing their D2H events)."""
        seen: dict[int, _HostCopy] = {}
        for call in self.calls:
            for handle in call.handles:
                if handle.host is not None:
                    seen[id(handle.host)] = handle.host
        return list(seen.values())

    def summary(self) -> dict[str, Any]:
        """Stats of this step and of the run's pool (for metrics / benchmarks)."""
        return {"session": dict(vars(self.stats)), "pool": dict(vars(self.offloader.pool.stats)),
                "window": sorted(self.offloader.window)}
