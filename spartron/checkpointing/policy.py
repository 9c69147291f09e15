"""The operator policy: which dispatched operators a checkpoint region keeps for backward.

One declarative table. Models expose no checkpoint target names; the policy sees operators as they
reach the dispatcher (``aten::mm``, ``spartron::sparse_mla``, ...). Names are strings so this module
imports none of the ops it refers to (they live beside the code that uses them and register themselves).

- MANDATORY: operations that must run exactly once per step whatever the mode: they mutate
  caller-owned state (routing telemetry), make a decision the replay must repeat exactly (top-k),
  talk to other ranks in a way that cannot be replayed (DeepEP), or synchronise the host with the
  device (accelerator -> CPU copies of metadata such as split sizes).
- DEFAULT_TARGETS: what ``mode = "selective"`` additionally keeps unless the user lists targets:
  attention, matrix multiplication, grouped GEMM and distributed communication. Elementwise ops,
  norms, reshapes and RoPE replay.
- REPLAY_ONLY_MARKERS: namespaces whose ops appear on replay only (profiler ranges, FSDP hooks);
  never saved and ignored when the replayed op sequence is checked against the original one.
- SAVE_WITH_BACKWARD_OUTPUTS: saved ops whose backward-only outputs (attention logsumexp) must be
  computed in the original pass even though it runs without grad.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

# --- the table ----------------------------------------------------------------------------------

MANDATORY: tuple[tuple[str, str], ...] = (
    ("spartron::record_routing_stats", "adds per-expert counts into a caller-owned buffer in place"),
    ("spartron::moe_topk", "routing decision: the replay must use the experts chosen in forward"),
    ("spartron::kl_dense", "kl_dense's top-k ids, and a walk over all S x S_kv keys never run twice"),
    ("spartron_collectives::splits_to_host", "device->host copy of all-to-all split sizes (sync)"),
    ("spartron_deepep", "DeepEP dispatch/combine hold communication state that cannot be replayed"),
    ("spartron_symm", "copy-engine exchange: barriers and peer writes on a shared buffer, never run twice"),
    ("spartron_ac::reused", "a reuse_during_recompute result in a compiled region: computed once, saved"),
)
"""(operator name or namespace, why it is saved). Cannot be excluded by any config."""

MANDATORY_DEVICE_TO_HOST: tuple[str, ...] = ("aten::_to_copy", "aten::copy_", "aten::_local_scalar_dense")
"""Ops saved when they move data from an accelerator to the CPU (host sync; metadata such as
split sizes). ``_local_scalar_dense`` is ``Tensor.item()``; its result is a host scalar."""

DEFAULT_TARGETS: tuple[str, ...] = (
    # matrix multiplication, as ``nn.Linear`` / ``matmul`` reach the dispatcher
    "aten::mm",
    "aten::addmm",
    "aten::_addmm_activation",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_grouped_mm",
    "aten::_scaled_mm",
    "spartron::moe_combine",  # the MoE finalize's gate-weighted top-k sum (spartron.layers.moe.combine), a bmm before
    "spartron_fp8::linear",  # blockwise FP8 GEMMs (spartron.layers.fp8.ops): kept like the GEMMs they replace
    "spartron_fp8::grouped_mm",
    "spartron_fp8::grouped_mm_pair",  # the experts' w1 / w3 on one quantisation of x (spartron.layers.fp8.expert_ops)
    "spartron_fp8::swiglu_grouped_mm",  # the experts' w2 on SwiGLU's product quantised where produced
    # Not DSA's absorbed per-head projections (spartron::absorb_query / absorb_output): their outputs are
    # [B, S, H, 576] and [B, S, H, 128] (at 128 heads 9 GiB and 2 GiB per layer at 64k) for a batched product of
    # ~0.15 GFLOP per token to recompute; kept, they made DSA hold more than dense MLA (issue 39).
    # attention
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
    "spartron::sparse_mla",
    "spartron::sparse_mla_absorbed",  # DSA's query-chunked attention: its output is wo's input, as SDPA's is
    # kl_sparse's per-slot KL target and index scores ([B, S, K] float32 each): attention-sized outputs
    # whose recompute costs a walk over every selected key row
    "spartron::kl_sparse_target",
    "spartron::kl_selected_scores",
    # distributed communication
    "spartron_collectives",
)

REPLAY_ONLY_MARKERS: tuple[str, ...] = ("profiler", "fsdp")

SAVE_WITH_BACKWARD_OUTPUTS: dict[str, tuple[str, ...]] = {
    "aten::_scaled_dot_product_efficient_attention": ("compute_log_sumexp",),
    "aten::_scaled_dot_product_cudnn_attention": ("compute_log_sumexp",),
    "aten::_efficient_attention_forward": ("compute_log_sumexp",),
}
"""Bool arguments forced to True when one of these ops is SAVED. SDPA asks for the logsumexp only
when its inputs need grad; a reentrant region's original pass runs without grad, so the saved output
would lack what the replay's backward reads (seen on the H200: NaN gradients with cuDNN attention)."""

Mode = Literal["full", "selective"]


# --- name handling ------------------------------------------------------------------------------

def op_packet_name(func: torch._ops.OpOverload) -> str:
    """``aten::add`` for ``aten.add.Tensor``: targets match every overload of an operator."""
    return func._schema.name


def _registered_names() -> tuple[set[str], set[str]]:
    """(registered ``ns::op`` names without overload, registered namespaces), read from the dispatcher."""
    ops = {name.split(".", 1)[0] for name in torch._C._dispatch_get_all_op_names()}
    return ops, {name.split("::", 1)[0] for name in ops}


def validate_targets(targets: Iterable[str]) -> None:
    """Raise ValueError for a target that names no registered operator or namespace.

    Checks what torch has registered now: call spartron.layers.ops.load_ops() first (RunConfig does).
    """
    ops, namespaces = _registered_names()
    for entry in targets:
        if not isinstance(entry, str) or not entry:
            raise ValueError(f"target {entry!r} must be a non-empty string ('ns::op' or 'ns')")
        base = entry.split(".", 1)[0] if "::" in entry else entry
        namespace = base.split("::", 1)[0]
        if namespace in REPLAY_ONLY_MARKERS:
            raise ValueError(f"target {entry!r} is a replay-only marker namespace and is never saved")
        if "::" in entry:
            if base not in ops:
                raise ValueError(f"target {entry!r} names no registered operator "
                                 f"(is the library that defines it imported?)")
        elif namespace not in namespaces:
            raise ValueError(f"target {entry!r} names no registered operator namespace")


# --- the compiled policy ------------------------------------------------------------------------

def _split(entries: Iterable[str]) -> tuple[frozenset[str], frozenset[str]]:
    """Split entries into (exact ``ns::op`` names, namespaces); an overload suffix is dropped."""
    names = {e.split(".", 1)[0] for e in entries if "::" in e}
    namespaces = {e for e in entries if "::" not in e}
    return frozenset(names), frozenset(namespaces)


def keeps_output(op: str, targets: Sequence[str] | None = None) -> bool:
    """Whether selective AC with `targets` (None: DEFAULT_TARGETS) keeps what operator `op` ('ns::op')
    returns: its exact name or its namespace is listed, the rule `OpPolicy.decide` applies. The memory
    planner asks this instead of matching target lists itself."""
    names, namespaces = _split(DEFAULT_TARGETS if targets is None else targets)
    return op in names or op.split("::", 1)[0] in namespaces


@dataclass(frozen=True)
class OpPolicy:
    """What a region saves: mandatory entries plus targets (names or namespaces).

    ``decide`` answers "mandatory", "target" or None (recompute) for one dispatched call.
    """

    mode: Mode
    mandatory_names: frozenset[str]
    mandatory_namespaces: frozenset[str]
    target_names: frozenset[str]
    target_namespaces: frozenset[str]
    device_to_host: frozenset[str] = frozenset(MANDATORY_DEVICE_TO_HOST)

    def decide(self, func: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
        name = op_packet_name(func)
        namespace = func.namespace
        kept = self._by_name(name, namespace)
        if kept != "mandatory" and namespace not in REPLAY_ONLY_MARKERS and name in self.device_to_host \
                and is_device_to_host(name, args, kwargs):
            return "mandatory"
        return kept

    def _by_name(self, name: str, namespace: str) -> str | None:
        """"mandatory", "target" or None from the operator's name alone (decide adds the device->host copies)."""
        if namespace in REPLAY_ONLY_MARKERS:
            return None
        if name in self.mandatory_names or namespace in self.mandatory_namespaces:
            return "mandatory"
        if name in self.target_names or namespace in self.target_namespaces:
            return "target"
        return None

    def keeps(self, op: str) -> bool:
        """Whether a region under this policy saves what operator `op` ('ns::op') returns, so its replay does
        not run it again: `decide`'s rule for any call of it (the device->host copies, saved or not by their
        arguments, aside). What a cost model asks (spartron.launch.suggest: are the all-to-alls replayed?)."""
        return self._by_name(op, op.split("::", 1)[0]) is not None

    def describe(self) -> dict[str, list[str]]:
        """The effective table, for logs and debug summaries."""
        return {
            "mode": [self.mode],
            "mandatory": sorted(self.mandatory_names | self.mandatory_namespaces)
            + [f"{n} (device->host)" for n in sorted(self.device_to_host)],
            "targets": sorted(self.target_names | self.target_namespaces),
        }

    def sac_policy_fn(self) -> Callable[..., Any]:
        """This table as torch's selective-checkpoint policy (``create_selective_checkpoint_contexts``):
        what ``decide`` keeps is MUST_SAVE, everything else PREFER_RECOMPUTE. Compiled regions use it,
        so the partitioner saves exactly what an eager region saves."""
        from torch.utils.checkpoint import CheckpointPolicy

        def policy_fn(ctx: Any, func: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if self.decide(func, args, kwargs) is None:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE

        return policy_fn


def is_device_to_host(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """True when this call copies from a non-CPU device to the CPU (a host synchronisation)."""
    if name == "aten::_local_scalar_dense":
        return _off_host(args[0])
    if name == "aten::_to_copy":
        target = kwargs.get("device")
        return _off_host(args[0]) and target is not None and torch.device(target).type == "cpu"
    if name == "aten::copy_":
        dst, src = args[0], args[1]
        return isinstance(dst, torch.Tensor) and dst.device.type == "cpu" and _off_host(src)
    return False


def _off_host(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


def replays(op: str, mode: str, targets: Sequence[str] | None = None) -> bool:
    """Whether AC `mode` ("none", "full", "selective", with `targets` as ac.targets) runs operator `op` again
    in backward: never without AC, else unless the region's policy keeps it (OpPolicy.keeps)."""
    return mode != "none" and not build_policy(mode, targets).keeps(op)


def build_policy(mode: Mode, targets: Sequence[str] | None = None,
                 extra_mandatory: Sequence[str] = ()) -> OpPolicy:
    """The policy for ``mode``: full saves MANDATORY only; selective also saves ``targets``.

    ``targets=None`` means DEFAULT_TARGETS; a list replaces them; ``[]`` keeps the mandatory set only.
    ``extra_mandatory`` adds names/namespaces to the mandatory set (used by tests and by libraries
    outside Spartron that own non-replayable ops); it can only add, never remove.
    """
    if mode not in ("full", "selective"):
        raise ValueError(f"ac.mode must be 'full' or 'selective' for a checkpoint region, got {mode!r}")
    if mode == "full" and targets:
        raise ValueError("ac.targets is only used by ac.mode = 'selective'")
    m_names, m_namespaces = _split([entry for entry, _ in MANDATORY] + list(extra_mandatory))
    chosen = () if mode == "full" else (DEFAULT_TARGETS if targets is None else tuple(targets))
    t_names, t_namespaces = _split(chosen)
    return OpPolicy(mode, m_names, m_namespaces, t_names, t_namespaces)
