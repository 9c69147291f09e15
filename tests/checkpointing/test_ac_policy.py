"""The operator policy: mandatory vs targets, namespaces, op-sequence checks, FLOPs, config errors."""

from __future__ import annotations

import collections
import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import spartron.layers  # noqa: F401  (registers the spartron namespaces)
from spartron.checkpointing import (
    DEFAULT_TARGETS,
    MANDATORY,
    ACConfig,
    CheckpointOptions,
    CheckpointRegion,
    CheckpointReplayError,
    build_policy,
)
from spartron.layers.moe.telemetry import record_routing_stats
from spartron.layers.moe.topk import moe_topk
from spartron.runtime.config import ConfigError, load_config

REENTRANT = pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "nonreentrant"])

# --- test-only custom ops that count their own executions --------------------------------------
EXECUTIONS: collections.Counter = collections.Counter()


@torch.library.custom_op("spartron_test::scaled", mutates_args=())
def _scaled(x: Tensor, w: Tensor) -> Tensor:
    EXECUTIONS["scaled"] += 1
    return x * w


@torch.library.custom_op("spartron_test::shifted", mutates_args=())
def _shifted(x: Tensor) -> Tensor:
    EXECUTIONS["shifted"] += 1
    return x + 1


@_scaled.register_fake
def _(x, w):
    return torch.empty_like(x)


@_shifted.register_fake
def _(x):
    return torch.empty_like(x)


def _scaled_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _scaled_backward(ctx, grad):
    x, w = ctx.saved_tensors
    return grad * w, grad * x


_scaled.register_autograd(_scaled_backward, setup_context=_scaled_setup)
_shifted.register_autograd(lambda ctx, grad: grad, setup_context=lambda ctx, inputs, output: None)


class OpCounter(TorchDispatchMode):
    """Counts every dispatched op (outside the region's own mode: sees what really executes)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


def region(reentrant=True, mode="full", targets=None, **kw) -> CheckpointRegion:
    return CheckpointRegion(CheckpointOptions(policy=build_policy(mode, targets, **kw), reentrant=reentrant))


def custom_fn(x: Tensor, w: Tensor) -> Tensor:
    return torch.ops.spartron_test.shifted(torch.ops.spartron_test.scaled(x, w).sin()).cos()


def run_step(r, fn, *args) -> None:
    EXECUTIONS.clear()
    r(fn, *args).sum().backward()


# --- the table ------------------------------------------------------------------------------------

def test_mandatory_table_and_defaults_are_the_documented_ones():
    assert [entry for entry, _ in MANDATORY] == ["spartron::record_routing_stats", "spartron::moe_topk",
                                                "spartron::kl_dense", "spartron_collectives::splits_to_host",
                                                "spartron_deepep", "spartron_symm", "spartron_ac::reused"]
    for name in ["aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm",
                 "aten::_scaled_dot_product_flash_attention_for_cpu", "spartron::sparse_mla",
                 "spartron::kl_sparse_target", "spartron::kl_selected_scores", "spartron_collectives"]:
        assert name in DEFAULT_TARGETS
    table = build_policy("selective", ["aten::mm"]).describe()
    assert table["targets"] == ["aten::mm"] and "spartron_deepep" in table["mandatory"]


def test_device_to_host_rule():
    policy = build_policy("full")
    aten = torch.ops.aten
    dev, host = torch.empty(2, device="meta"), torch.empty(2)
    assert policy.decide(aten._to_copy.default, (dev,), {"device": torch.device("cpu")}) == "mandatory"
    assert policy.decide(aten._to_copy.default, (host,), {"device": torch.device("cpu")}) is None
    assert policy.decide(aten._to_copy.default, (dev,), {"dtype": torch.float16}) is None
    assert policy.decide(aten.copy_.default, (host, dev), {}) == "mandatory"
    assert policy.decide(aten.copy_.default, (dev, host), {}) is None
    assert policy.decide(aten._local_scalar_dense.default, (dev,), {}) == "mandatory"
    assert policy.decide(aten._local_scalar_dense.default, (host,), {}) is None


# --- saved vs recomputed --------------------------------------------------------------------------

@REENTRANT
@pytest.mark.parametrize("mode,targets,scaled,shifted", [
    ("full", None, 2, 2),
    ("selective", ["spartron_test::scaled"], 1, 2),
    ("selective", ["spartron_test"], 1, 1),  # a namespace matches every op in it
    ("selective", [], 2, 2),
])
def test_custom_op_executions_per_step(reentrant, mode, targets, scaled, shifted):
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    custom_fn(x, w).sum().backward()
    expected = [x.grad.clone(), w.grad.clone()]
    x.grad = w.grad = None
    r = region(reentrant, mode, targets)
    run_step(r, custom_fn, x, w)
    assert (EXECUTIONS["scaled"], EXECUTIONS["shifted"]) == (scaled, shifted)
    assert torch.equal(x.grad, expected[0]) and torch.equal(w.grad, expected[1])
    assert r.last_stats.ops_saved == (2 - scaled) + (2 - shifted)


@REENTRANT
def test_extra_mandatory_ops_run_once_even_in_full_mode(reentrant):
    r = region(reentrant, "full", extra_mandatory=["spartron_test::shifted"])
    run_step(r, custom_fn, torch.randn(3, 4, requires_grad=True), torch.randn(4))
    assert (EXECUTIONS["scaled"], EXECUTIONS["shifted"]) == (2, 1)


def routed(x: Tensor, router: Tensor, counts: Tensor) -> Tensor:
    scores = x @ router
    ids = moe_topk(scores.softmax(-1), top_k=2)
    record_routing_stats(ids, counts)
    return (scores.gather(-1, ids).sigmoid() * x[:, :2]).sum(-1)


@REENTRANT
@pytest.mark.parametrize("mode,targets", [("full", None), ("selective", []), ("selective", ["aten::mm"])])
def test_real_routing_ops_are_mandatory_and_run_once(reentrant, mode, targets):
    torch.manual_seed(0)
    x, router = torch.randn(6, 4, requires_grad=True), torch.randn(4, 5, requires_grad=True)
    counts = torch.zeros(5, dtype=torch.int64)
    routed(x, router, counts).sum().backward()
    expected = (counts.clone(), x.grad.clone(), router.grad.clone())
    counts.zero_()
    x.grad = router.grad = None
    with OpCounter() as seen:
        region(reentrant, mode, targets)(routed, x, router, counts).sum().backward()
    assert seen.counts["spartron::moe_topk"] == 1 and seen.counts["spartron::record_routing_stats"] == 1
    assert seen.counts["aten::mm"] > (1 if targets == ["aten::mm"] else 2)  # backward mms (+ replay)
    assert torch.equal(counts, expected[0]) and counts.sum() == 12
    assert torch.equal(x.grad, expected[1]) and torch.equal(router.grad, expected[2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: device->host copies")
@REENTRANT
def test_device_to_host_copies_run_once_on_cuda(reentrant):
    def fn(x):
        splits = x.sum(-1).cpu()
        n = int(x.abs().max().item() * 0 + 1)
        return x.sin() * n * splits.sum().to(x.device)

    x = torch.randn(4, 4, device="cuda", requires_grad=True)
    r = region(reentrant, "full")
    r(fn, x).sum().backward()  # (stats, not an outer mode: CUDA backward runs on another thread)
    stats = r.last_stats
    assert stats.saved_by_op == {"aten::_to_copy": 1, "aten::_local_scalar_dense": 1}
    assert stats.recomputed_by_op["aten::_to_copy"] == 1  # host -> device is replayed
    assert "aten::_local_scalar_dense" not in stats.recomputed_by_op


# --- replay validation ----------------------------------------------------------------------------

@REENTRANT
def test_replay_naming_the_first_differing_saved_op(reentrant):
    passes = []

    def fn(x, w):
        passes.append(1)
        y = x @ w if len(passes) == 1 else (x.unsqueeze(0) @ w.unsqueeze(0)).squeeze(0)
        return y.sin()

    y = region(reentrant, "selective")(fn, torch.randn(3, 4, requires_grad=True), torch.randn(4, 4))
    with pytest.raises(CheckpointReplayError, match=r"diverged from the original pass at op #0: the original "
                                                    r"pass ran aten::mm, the replay dispatched aten::bmm "
                                                    r"\(inputs \[1, 3, 4\], \[1, 4, 4\]\)$"):
        y.sum().backward()


@REENTRANT
def test_replay_that_stops_early_counts_the_ops_it_replayed(reentrant):
    passes = []

    def fn(x, w):
        passes.append(1)
        y = x @ w
        return (y @ w if len(passes) == 1 else y).sin()  # the replay dispatches 1 of the 2 saved mm

    r = region(reentrant, "selective")
    y = r(fn, torch.randn(3, 4, requires_grad=True), torch.randn(4, 4))
    with pytest.raises(CheckpointReplayError) as err:
        y.sum().backward()
    assert str(err.value) == (f"region {r.last_stats.name!r}: the replay diverged from the original pass at op "
                              "#1: the original pass ran aten::mm, the replay dispatched aten::sin (inputs [3, 4])")


@REENTRANT
def test_replay_only_profiler_markers_are_ignored(reentrant):
    passes = []

    def fn(x, w):
        passes.append(1)
        if len(passes) == 1:
            return (x @ w).sin()
        with torch.profiler.record_function("replay only"):
            return (x @ w).sin()

    policy = build_policy("selective", ["aten::mm"])
    policy = dataclasses.replace(policy, target_namespaces=frozenset({"profiler"}))  # even if targeted
    r = CheckpointRegion(CheckpointOptions(policy=policy, reentrant=reentrant))
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 4)
    r(fn, x, w).sum().backward()
    assert torch.equal(x.grad, torch.cos(x.detach() @ w) @ w.T)
    assert r.last_stats.recomputed_by_op["profiler::_record_function_enter_new"] == 1


@REENTRANT
def test_saved_output_modified_in_place_raises(reentrant):
    def fn(x, w):
        y = x @ w
        y.mul_(2)
        return y.sin()

    y = region(reentrant, "selective")(fn, torch.randn(3, 4, requires_grad=True), torch.randn(4, 4))
    with pytest.raises(CheckpointReplayError, match=r"saved output of aten::mm \(#0\) was modified in place"):
        y.sum().backward()


# --- a transformer-like block ---------------------------------------------------------------------

class TinyTransformerBlock(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, sdpa: bool = True) -> None:
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.sdpa:
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # matmul attention: FlopCounterMode counts no CPU flash-attention FLOPs
            scores = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
            mask = torch.ones(s, s, dtype=torch.bool).triu(1)
            att = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def _block_and_input(sdpa: bool = True):
    torch.manual_seed(0)
    return TinyTransformerBlock(sdpa=sdpa), torch.randn(2, 16, 32, requires_grad=True)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "nonreentrant"])
@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("sdpa", [True, False], ids=["sdpa", "matmul-attention"])
def test_block_grads_bitwise_equal_to_no_checkpointing(reentrant, mode, sdpa):
    block, x = _block_and_input(sdpa)
    block(x).square().sum().backward()
    expected = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    block.zero_grad()
    x.grad = None
    r = region(reentrant, mode)
    r(block, x).square().sum().backward()
    got = [p.grad for p in block.parameters()] + [x.grad]
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    if mode == "selective":
        stats = r.last_stats
        assert stats.saved_by_op["aten::addmm"] == 4
        attention = "aten::_scaled_dot_product_flash_attention_for_cpu" if sdpa else "aten::bmm"
        assert stats.saved_by_op[attention] == (1 if sdpa else 2)
        assert stats.bytes_saved > 0 and stats.replay_count == 1


def test_backward_flops_decrease_full_selective_none():
    def backward_flops(r) -> int:
        block, x = _block_and_input(sdpa=False)
        y = r(block, x) if r is not None else block(x)
        with FlopCounterMode(display=False) as counter:
            y.sum().backward()
        return counter.get_total_flops()

    none = backward_flops(None)
    full = backward_flops(region(True, "full"))
    projections = backward_flops(region(True, "selective", ["aten::addmm"]))  # attention bmm replays
    default = backward_flops(region(True, "selective"))  # saves every matmul: nothing counted replays
    assert full > projections > default == none


# --- config -----------------------------------------------------------------------------------------

def test_targets_must_name_registered_ops_or_namespaces():
    ACConfig(mode="selective", targets=["aten::mm", "spartron_collectives", "spartron::moe_topk"])
    ACConfig(mode="selective", targets=[])
    with pytest.raises(ValidationError, match="'aten::not_an_op' names no registered operator"):
        ACConfig(mode="selective", targets=["aten::mm", "aten::not_an_op"])
    with pytest.raises(ValidationError, match="'no_such_namespace' names no registered operator namespace"):
        ACConfig(mode="selective", targets=["no_such_namespace"])
    with pytest.raises(ValidationError, match="replay-only marker"):
        ACConfig(mode="selective", targets=["profiler"])
    with pytest.raises(ValidationError, match="only used by ac.mode = 'selective'"):
        ACConfig(mode="full", targets=["aten::mm"])


def test_run_config_names_the_dotted_key():
    with pytest.raises(ConfigError, match=r"ac\.targets.*aten::nope"):
        load_config("configs/tiny.toml", ["ac.mode=selective", "ac.targets=['aten::nope']"])


def test_debug_summary_is_logged(caplog):
    opts = CheckpointOptions(policy=build_policy("selective"), debug_summary=True, name="block 3")
    block, x = _block_and_input()
    with caplog.at_level(logging.INFO, logger="spartron.checkpointing"):
        CheckpointRegion(opts)(block, x).sum().backward()
    assert "checkpoint region 'block 3'" in caplog.text and "replays 1" in caplog.text


def test_saved_attention_ops_compute_their_logsumexp_even_without_grad():
    # A reentrant original pass runs without grad, so SDPA asks its kernels for no logsumexp; a SAVED
    # attention output must carry it, because the replay's backward reads it (NaN grads otherwise).
    from spartron.checkpointing.saved_ops import with_backward_outputs

    q = torch.empty(1, 1, 4, 8, device="meta")
    for op in (torch.ops.aten._scaled_dot_product_efficient_attention.default,
               torch.ops.aten._scaled_dot_product_cudnn_attention.default):
        args, kwargs = with_backward_outputs(op, (q, q, q, None, False), {"scale": 0.5})
        assert args[4] is True and kwargs == {"scale": 0.5}
        args, kwargs = with_backward_outputs(op, (q, q, q, None), {"compute_log_sumexp": False})
        assert kwargs["compute_log_sumexp"] is True
    untouched = (q, q)
    assert with_backward_outputs(torch.ops.aten.mm.default, untouched, {}) == (untouched, {})


def test_keeps_output_answers_by_name_or_namespace_as_decide_does():
    from spartron.checkpointing.policy import keeps_output

    assert keeps_output("aten::mm") and keeps_output("spartron::sparse_mla_absorbed")  # default targets
    assert not keeps_output("spartron::absorb_query")  # not a default target
    assert keeps_output("spartron::absorb_query", ["spartron"])  # a namespace keeps all its ops
    assert keeps_output("aten::mm", ["aten::mm.default"])  # an overload suffix names the op
    assert not keeps_output("aten::bmm", ["aten::mm"]) and not keeps_output("aten::mm", [])
