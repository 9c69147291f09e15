"""The checkpoint boundary: PyTree inputs/outputs, grad modes, gradients, RNG, hooks, structure errors."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from typing import NamedTuple, TypedDict

import pytest
import torch
from torch import nn

from spartron.checkpointing import (
    CheckpointOptions,
    CheckpointRegion,
    CheckpointReplayError,
    build_policy,
    checkpoint,
)

MODES = [(True, "full"), (True, "selective"), (False, "full"), (False, "selective")]
IDS = ["reentrant-full", "reentrant-selective", "nonreentrant-full", "nonreentrant-selective"]


def region(reentrant: bool = True, mode: str = "full", **kw) -> CheckpointRegion:
    return CheckpointRegion(CheckpointOptions(policy=build_policy(mode), reentrant=reentrant, **kw))


@dataclasses.dataclass
class BlockSettings:  # an opaque, non-tensor leaf
    scale: float


class Pair(NamedTuple):
    left: torch.Tensor
    right: torch.Tensor


class BlockOut(TypedDict):
    hidden: torch.Tensor
    aux: torch.Tensor
    ids: torch.Tensor
    note: str
    count: int
    nothing: None


class Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, inputs: dict, pair: Pair, *, settings: BlockSettings, tag: str, extra: list,
                maybe=None) -> BlockOut:
        h = inputs["x"] + inputs["nested"][0] * pair.left - pair.right
        h = self.b(torch.nn.functional.gelu(self.a(self.norm(h)))) * settings.scale + extra[1]["bias"]
        aux = (h * h).mean()
        return BlockOut(hidden=h, aux=aux, ids=h.argmax(-1), note=tag, count=len(tag), nothing=maybe)


def make_inputs(requires_grad: bool = True):
    g = torch.Generator().manual_seed(3)
    t = lambda *s: torch.randn(*s, generator=g).requires_grad_(requires_grad)
    return ({"x": t(4, 8), "nested": [t(4, 8), 7]}, Pair(t(4, 8), t(4, 8))), dict(
        settings=BlockSettings(0.5), tag="blk", extra=[None, {"bias": t(8)}], maybe=None)


def grads(module: nn.Module, tensors) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()] + [t.grad.clone() for t in tensors]


def input_tensors(args, kwargs) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    return [x for x in leaves if isinstance(x, torch.Tensor)]


@pytest.mark.parametrize("reentrant,mode", MODES, ids=IDS)
@pytest.mark.parametrize("loss_fields", [("hidden", "aux"), ("aux",)])
def test_pytree_inputs_and_typeddict_outputs_give_bitwise_equal_grads(reentrant, mode, loss_fields):
    torch.manual_seed(0)
    block = Block()
    args, kwargs = make_inputs()
    ref = block(*args, **kwargs)
    sum(ref[f].sum() for f in loss_fields).backward()
    expected = grads(block, input_tensors(args, kwargs))
    block.zero_grad()

    args, kwargs = make_inputs()
    out = region(reentrant, mode)(block, *args, **kwargs)
    assert isinstance(out, dict) and set(out) == set(ref)
    assert (out["note"], out["count"], out["nothing"]) == ("blk", 3, None)
    assert torch.equal(out["ids"], ref["ids"]) and torch.equal(out["hidden"], ref["hidden"])
    sum(out[f].sum() for f in loss_fields).backward()
    got = grads(block, input_tensors(args, kwargs))
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


class GradModeRecorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[bool] = []

    def forward(self, x):
        self.seen.append(torch.is_grad_enabled())
        return self.lin(x)


@pytest.mark.parametrize("reentrant,expected", [(True, [False, True]), (False, [True, True])])
def test_original_pass_without_grad_and_replay_with_grad(reentrant, expected):
    m = GradModeRecorder()
    region(reentrant)(m, torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert m.seen == expected


@pytest.mark.parametrize("reentrant", [True, False])
def test_parameters_get_grads_when_every_input_is_detached(reentrant):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    m(x).pow(2).sum().backward()
    expected = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    out = region(reentrant)(lambda inp: m(inp["x"]), {"x": x})  # dict input, detached tensor
    assert out.requires_grad
    out.pow(2).sum().backward()
    for p, e in zip(m.parameters(), expected, strict=True):
        assert torch.equal(p.grad, e)


def test_functional_checkpoint_passes_every_keyword_to_fn():
    seen = {}

    def fn(x, **kwargs):
        seen.update(kwargs)
        return x * 2

    x = torch.ones(2, requires_grad=True)
    opts = dict(function=1, preserve_rng_state=False, context_fn="c", use_reentrant=True, policy="p", fn=3)
    checkpoint(fn, x, **opts).sum().backward()
    assert seen == opts and torch.equal(x.grad, torch.full((2,), 2.0))


def test_outer_saved_tensors_hooks_see_nested_positional_and_keyword_inputs():
    packed: list[int] = []

    def pack(t):
        packed.append(t.data_ptr())
        return t

    block = Block()
    args, kwargs = make_inputs()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = region(True)(block, *args, **kwargs)
    tensors = input_tensors(args, kwargs)
    assert len(tensors) == 5
    for t in tensors:
        assert t.data_ptr() in packed
    out["hidden"].sum().backward()


class DropoutProbe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5)
        self.masks: list[torch.Tensor] = []

    def forward(self, x):
        y = self.drop(self.lin(x))
        self.masks.append((y == 0).detach().clone())
        return y


def _check_dropout_replay(device: str, reentrant: bool) -> None:
    torch.manual_seed(0)
    m = DropoutProbe().to(device)
    x = torch.randn(8, 16, device=device, requires_grad=True)
    torch.manual_seed(1)
    m(x).sum().backward()
    expected = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m.masks.clear()
    torch.manual_seed(1)
    region(reentrant)(m, x).sum().backward()
    assert len(m.masks) == 2 and torch.equal(m.masks[0], m.masks[1]) and m.masks[0].any()
    for p, e in zip(m.parameters(), expected, strict=True):
        assert torch.equal(p.grad, e)


@pytest.mark.parametrize("reentrant", [True, False])
def test_dropout_masks_identical_on_replay_cpu(reentrant):
    _check_dropout_replay("cpu", reentrant)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: CUDA RNG state preservation")
@pytest.mark.parametrize("reentrant", [True, False])
def test_dropout_masks_identical_on_replay_cuda(reentrant):
    _check_dropout_replay("cuda", reentrant)


@pytest.mark.parametrize("reentrant", [True, False])
def test_replay_with_different_output_structure_names_both(reentrant):
    calls = []

    def fn(x):
        calls.append(1)
        return {"a": x.sin()} if len(calls) == 1 else {"a": x.sin(), "b": x}

    out = region(reentrant)(fn, torch.ones(2, requires_grad=True))
    with pytest.raises(CheckpointReplayError, match=r"(?s)different output structure.*original:.*'a'.*"
                                                    r"replay:.*'a', 'b'"):
        out["a"].sum().backward()


class FrozenThenTrainable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(4, 4).requires_grad_(False)
        self.train_me = nn.Linear(4, 4)
        self.frozen_out_requires_grad: list[bool] = []

    def forward(self, x):
        f = self.frozen(x)
        self.frozen_out_requires_grad.append(f.requires_grad)
        return self.train_me(torch.relu(f))


@pytest.mark.parametrize("reentrant", [True, False])
def test_frozen_submodule_builds_no_replay_edges(reentrant):
    m = FrozenThenTrainable()
    region(reentrant)(m, torch.randn(2, 4)).sum().backward()
    assert m.frozen_out_requires_grad[-1] is False  # replay: no graph through the frozen module
    assert m.frozen.weight.grad is None and m.frozen.bias.grad is None
    assert m.train_me.weight.grad is not None


@pytest.mark.parametrize("reentrant", [True, False])
def test_fully_frozen_region_with_detached_inputs_never_replays(reentrant):
    frozen = nn.Linear(4, 4).requires_grad_(False)
    head = nn.Linear(4, 1)
    r = region(reentrant)
    y = r(frozen, torch.randn(2, 4))
    assert not y.requires_grad
    head(y).sum().backward()
    assert r.last_stats.replay_count == 0 and head.weight.grad is not None


def test_no_grad_runs_plainly():
    r = region()
    with torch.no_grad():
        y = r(lambda x: x + 1, torch.zeros(2))
    assert torch.equal(y, torch.ones(2)) and r.last_stats is None


def test_region_with_only_non_tensor_outputs():
    x = torch.ones(2, requires_grad=True)
    assert checkpoint(lambda t: {"n": int(t.numel()), "s": "x"}, x) == {"n": 2, "s": "x"}


@pytest.mark.parametrize("reentrant", [True, False])
def test_no_leak_over_100_steps(reentrant):
    lin = nn.Linear(4, 4)
    r = region(reentrant, "selective")

    def fn(inputs, *, scale):
        h = lin(inputs["x"]).relu() * scale
        return {"hidden": h, "aux": h.mean(), "tag": "s"}

    def step():
        x = torch.randn(2, 4, requires_grad=True)
        out = r(fn, {"x": x}, scale=2.0)
        (out["hidden"].sum() + out["aux"]).backward()
        return weakref.ref(x), weakref.ref(out["hidden"])

    for _ in range(10):
        step()
    gc.collect()
    before = len(gc.get_objects())
    refs = [step() for _ in range(100)]
    gc.collect()
    assert all(a() is None and b() is None for a, b in refs)
    del refs
    gc.collect()
    after = len(gc.get_objects())
    assert after - before <= 5, f"{after - before} objects accumulated over 100 steps"


@pytest.mark.parametrize("reentrant", [True, False])
def test_on_call_sees_every_call_of_a_region_run_twice(reentrant):
    # a block that runs twice per step (the shared MTP block): last_stats keeps the second call only
    r = region(reentrant)
    seen = []
    r.on_call = seen.append
    x = torch.randn(3, requires_grad=True)
    y = r(lambda t: (t * 2).sin(), x)
    z = r(lambda t: t.cos() + 1, y)
    z.sum().backward()
    assert len(seen) == 2 and seen[1] is r.last_stats and seen[0] is not seen[1]
    # mul + sin, then cos + add: each call's original pass recorded (and its replay compared) 2 ops
    assert [(s.ops_original, s.replay_count) for s in seen] == [(2, 1), (2, 1)]
    with torch.no_grad():  # a call that runs plainly keeps no stats: not observed
        r(lambda t: t + 1, x)
    assert len(seen) == 2
