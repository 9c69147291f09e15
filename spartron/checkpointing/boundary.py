"""The checkpoint boundary: one PyTree-aware region, reentrant by default, non-reentrant on request.

A region runs ``fn(*args, **kwargs)`` once without keeping its activations (the original pass) and
runs it again during backward (the replay) to rebuild them. What the replay may take from the
original pass instead of recomputing is decided by the operator policy (``saved_ops.PolicyMode``)
and by replay frames (``reuse_during_recompute``); both are attached to the region call, never to
globals.

Reentrant mode (the default): the original pass runs under ``torch.no_grad`` inside a custom
autograd.Function whose inputs are every tensor leaf of (args, kwargs), flattened with
torch.utils._pytree, so tensors nested anywhere in the inputs are saved with
``ctx.save_for_backward`` and an outer ``saved_tensors_hooks`` (an offloader) sees them. A dummy
anchor that requires grad goes through the Function so its backward, and with it parameter
gradients, runs even when every input is detached. Outputs come back as the same PyTree.

Non-reentrant mode: torch.utils.checkpoint's non-reentrant implementation carries the autograd
plumbing; the region supplies the policy and frames through its ``context_fn``.

Compiled mode (``CheckpointRegion.compile``, train.compile): a non-reentrant region runs as one
compiled graph of torch's checkpoint whose selective-checkpoint policy is the same operator table,
so compile and eager save the same ops; the region's eager frame (offload hooks) stays outside it.

Options are bound when the region is built (``CheckpointRegion(options)``), so every call-time
keyword argument, whatever its name, goes to ``fn``.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from spartron.checkpointing.policy import OpPolicy, build_policy
from spartron.checkpointing.replay import ReplayFrame, active_frame
from spartron.checkpointing.saved_ops import CheckpointReplayError, PolicyMode, RegionStats, SavedOps, log


@dataclass(frozen=True)
class CheckpointOptions:
    """How a region checkpoints. ``name`` identifies the region in errors, summaries and (later)
    offload windows."""

    policy: OpPolicy = field(default_factory=lambda: build_policy("full"))
    reentrant: bool = True
    preserve_rng_state: bool = True
    debug_summary: bool = False
    name: str | None = None


def _owning_module(fn: Callable[..., Any]) -> nn.Module | None:
    if isinstance(fn, nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


def _needs_anchor(fn: Callable[..., Any]) -> bool:
    """Whether parameters inside the region may need gradients (unknown for plain functions)."""
    module = _owning_module(fn)
    return module is None or any(p.requires_grad for p in module.parameters())


class _RNGState:
    """CPU and accelerator RNG states at the start of the original pass, restored for the replay."""

    def __init__(self, tensors: Sequence[torch.Tensor], enabled: bool) -> None:
        self.enabled = enabled
        if not enabled:
            return
        self.cpu = torch.get_rng_state()
        self.cuda_devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        if not self.cuda_devices and torch.cuda.is_available() and torch.cuda.is_initialized():
            self.cuda_devices = [torch.cuda.current_device()]
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        with torch.random.fork_rng(devices=self.cuda_devices, device_type="cuda"):
            torch.set_rng_state(self.cpu)
            for device, state in zip(self.cuda_devices, self.cuda, strict=True):
                torch.cuda.set_rng_state(state, device)
            yield


class _AutocastState:
    """Autocast settings of the original pass, re-entered exactly for the reentrant replay."""

    def __init__(self) -> None:
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        self.settings = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices]
        self.cache = torch.is_autocast_cache_enabled()

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for device, enabled, dtype in self.settings:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled,
                                                   cache_enabled=self.cache))
            yield


class _RegionCall:
    """State of one call of one region: inputs layout, saved ops, replay frame, stats."""

    def __init__(self, options: CheckpointOptions, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        self.options = options
        self.fn = fn
        self.name = options.name or getattr(fn, "__qualname__", type(fn).__name__)
        leaves, self.in_spec = tree_flatten((args, kwargs))
        self.tensor_slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.leaves = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self.inputs: list[torch.Tensor] = [leaves[i] for i in self.tensor_slots]
        self.stats = RegionStats(self.name)
        self.saved = SavedOps(options.policy, self.stats)
        self.frame = ReplayFrame(self.name)
        self.out_spec: TreeSpec | None = None
        self.out_leaves: list[Any] = []
        self.out_tensor_slots: list[int] = []
        self.replayed = False

    def call_fn(self, tensors: Sequence[torch.Tensor]) -> Any:
        leaves = list(self.leaves)
        for slot, tensor in zip(self.tensor_slots, tensors, strict=True):
            leaves[slot] = tensor
        args, kwargs = tree_unflatten(leaves, self.in_spec)
        return self.fn(*args, **kwargs)

    @contextlib.contextmanager
    def original_pass(self) -> Iterator[None]:
        with active_frame(self.frame, "original"), PolicyMode(self.saved, "original", self.frame):
            yield

    @contextlib.contextmanager
    def replay_pass(self) -> Iterator[None]:
        if self.replayed:
            raise CheckpointReplayError(
                f"region {self.name!r} is replayed a second time; backward twice through a checkpoint "
                "region (retain_graph) is not supported")
        self.replayed = True
        try:
            with active_frame(self.frame, "replay"), PolicyMode(self.saved, "replay", self.frame):
                yield
            self.saved.finish_replay()
            self.frame.check_consumed()
        finally:
            self.saved.release()
            self.frame.clear()
        self.stats.replay_count += 1
        self.stats.results_reused = self.frame.reused
        if self.options.debug_summary:
            log.info(self.stats.summary())

    def record_outputs(self, out: Any) -> list[torch.Tensor]:
        leaves, self.out_spec = tree_flatten(out)
        self.out_tensor_slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.out_leaves = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        return [leaves[i] for i in self.out_tensor_slots]

    def check_replay_outputs(self, out: Any) -> list[torch.Tensor]:
        leaves, spec = tree_flatten(out)
        if spec != self.out_spec:
            raise CheckpointReplayError(
                f"region {self.name!r}: the replay returned a different output structure than the original "
                f"pass.\n  original: {self.out_spec}\n  replay:   {spec}")
        return [leaves[i] for i in self.out_tensor_slots]

    def rebuild_outputs(self, tensors: Sequence[torch.Tensor]) -> Any:
        leaves = list(self.out_leaves)
        for slot, tensor in zip(self.out_tensor_slots, tensors, strict=True):
            leaves[slot] = tensor
        return tree_unflatten(leaves, self.out_spec)

    def release(self) -> None:
        self.inputs = []
        self.leaves = []
        self.saved.release()
        self.frame.clear()


class _ReentrantRegion(torch.autograd.Function):
    """Original pass without grad in forward; replay with grad, then its backward, in backward."""

    @staticmethod
    def forward(ctx, call: _RegionCall, anchor: torch.Tensor | None, *tensors: torch.Tensor):
        ctx.call = call
        ctx.rng = _RNGState(tensors, call.options.preserve_rng_state)
        ctx.autocast = _AutocastState()
        ctx.save_for_backward(*tensors)
        call.stats.bytes_inputs = sum(t.numel() * t.element_size() for t in tensors)
        call.inputs = []  # the Function owns them now (saved tensors, visible to outer hooks)
        with call.original_pass():
            outputs = call.record_outputs(call.call_fn(tensors))
        ctx.mark_non_differentiable(*[o for o in outputs if not (o.is_floating_point() or o.is_complex())])
        ctx.set_materialize_grads(False)
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        call: _RegionCall = ctx.call
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad(), ctx.rng.restored(), ctx.autocast.restored(), call.replay_pass():
            outputs = call.check_replay_outputs(call.call_fn(inputs))
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        call.release()
        ctx.call = None
        return (None, None, *(t.grad if t.requires_grad else None for t in inputs))


def _run_reentrant(call: _RegionCall) -> Any:
    anchor = torch.empty(0, requires_grad=True) if _needs_anchor(call.fn) else None
    outputs = _ReentrantRegion.apply(call, anchor, *call.inputs)
    return call.rebuild_outputs(outputs)


def _run_non_reentrant(call: _RegionCall) -> Any:
    # Only differentiable tensors go through torch's checkpoint (which version-checks what it
    # saves); integer tensors such as a caller-owned counts buffer that a mandatory op updates in
    # place are held by the call itself, as a reentrant region would hold them.
    inputs, call.inputs = call.inputs, []
    through = [i for i, t in enumerate(inputs) if t.is_floating_point() or t.is_complex()]

    def run(*tensors: torch.Tensor) -> Any:
        merged = list(inputs_held)
        for slot, tensor in zip(through, tensors, strict=True):
            merged[slot] = tensor
        out = call.call_fn(merged)
        if call.frame.phase == "original":
            call.record_outputs(out)
        else:
            call.check_replay_outputs(out)
        return out

    inputs_held = [None if i in through else t for i, t in enumerate(inputs)]
    call.stats.bytes_inputs = 0  # kept by torch's saved-tensor hooks, not by the region
    return torch_checkpoint.checkpoint(
        run, *[inputs[i] for i in through], use_reentrant=False,
        preserve_rng_state=call.options.preserve_rng_state,
        context_fn=lambda: (call.original_pass(), call.replay_pass()), early_stop=False)


def compile_own(fn: Callable[..., Any], backend: str | Callable[..., Any], fullgraph: bool) -> Callable[..., Any]:
    """torch.compile over a copy of `fn` with its own code object.

    Dynamo keeps compiled graphs per code object and guards only what the traced code reads: every
    function made by one `def` would share one cache, so a second model in the process (another AC
    policy, whose selective-checkpoint contexts dynamo does not guard) would silently run the first
    model's graphs, and a few models would exceed the recompile limit. A copy's cache is its own."""
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__ = fn.__kwdefaults__
    return torch.compile(own, backend=backend, fullgraph=fullgraph)


def _compiled_body(options: CheckpointOptions) -> Callable[..., Any]:
    """The function a compiled region traces: torch's checkpoint with the policy's SAC contexts."""
    policy_fn = options.policy.sac_policy_fn()

    def contexts() -> tuple[Any, Any]:
        return torch_checkpoint.create_selective_checkpoint_contexts(policy_fn)

    def body(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=contexts,
                                           preserve_rng_state=options.preserve_rng_state, **kwargs)

    return body


class CheckpointRegion:
    """A checkpoint boundary with its options bound: ``region(fn, *args, **kwargs)``.

    ``last_stats`` is the RegionStats of the most recent call (filled in as it replays).
    """

    def __init__(self, options: CheckpointOptions | None = None) -> None:
        self.options = options or CheckpointOptions()
        self.last_stats: RegionStats | None = None  # eager calls only: a compiled call keeps none
        # Called with each eager call's RegionStats when the call starts (filled in as it runs and
        # replays): how a benchmark sees every call of a block that runs several times per step.
        self.on_call: Callable[[RegionStats], None] | None = None
        self._compiled: Callable[..., Any] | None = None
        # Set only while an offload session (checkpointing/offload.py) of the current step is open:
        # a factory of the saved_tensors_hooks context each call runs under, so the tensors the
        # region saves for backward (its inputs) are seen by exact identity.
        self.saved_inputs_scope: Callable[[], contextlib.AbstractContextManager] | None = None

    def __call__(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        scope = self.saved_inputs_scope() if self.saved_inputs_scope is not None else contextlib.nullcontext()
        if self._compiled is not None:  # also without grad (eval): its own compiled graph, not eager
            # Host split sizes (MoE expert counts, all-to-all splits) trace as unbacked SymInts, not
            # as a graph break or a recompile per new split pattern.
            with scope, torch._dynamo.config.patch(capture_scalar_outputs=True):
                return self._compiled(fn, *args, **kwargs)
        if not torch.is_grad_enabled():  # nothing will replay: run plainly (eval / inference)
            return fn(*args, **kwargs)
        call = _RegionCall(self.options, fn, args, kwargs)
        self.last_stats = call.stats
        if self.on_call is not None:
            self.on_call(call.stats)
        with scope:
            return _run_reentrant(call) if self.options.reentrant else _run_non_reentrant(call)

    def compile(self, backend: str | Callable[..., Any] = "inductor", fullgraph: bool = True,
                shared: dict | None = None) -> None:
        """Run every later call as one compiled graph: torch's non-reentrant checkpoint with its
        selective-checkpoint contexts, driven by this region's policy table (``OpPolicy.sac_policy_fn``),
        so the partitioner saves the ops an eager region saves (mandatory ones included) and
        recomputes the rest inside the compiled backward. What compiled mode checks instead of the
        eager op-by-op replay validation: the replay is the traced backward graph itself, so it cannot
        run a different op sequence; a Python-level change (other shapes, branches, module state) fails
        dynamo's guards and retraces, or raises under ``fullgraph``. The region boundary (offload
        hooks, FSDP's hooks) stays outside the graph, in eager code.

        Reentrant regions cannot compile exactly: their policy is a Python dispatch mode around an
        autograd.Function, which dynamo neither traces nor lets see inside a compiled graph.

        ``shared``: a dict shared by the regions of one model; regions with the same policy and RNG
        option then run one compiled callable (one dynamo cache, no recompile per layer)."""
        if self.options.reentrant:
            raise ValueError(f"checkpoint region {self.options.name!r}: a reentrant region cannot be compiled "
                             "(its operator policy is a Python dispatch mode that compiled graphs bypass); "
                             "use a non-reentrant region (ac.reentrant = false)")
        shared = {} if shared is None else shared
        key = ("region", self.options.policy, self.options.preserve_rng_state, backend, fullgraph)
        if key not in shared:
            shared[key] = compile_own(_compiled_body(self.options), backend, fullgraph)
        self._compiled = shared[key]


def checkpoint(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` in a checkpoint region with default options (reentrant, full,
    RNG preserved). Every keyword argument goes to ``fn``; bind options with ``CheckpointRegion``."""
    return CheckpointRegion()(fn, *args, **kwargs)
