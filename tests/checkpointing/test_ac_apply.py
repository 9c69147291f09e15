"""Module wrapping: names/state_dict unchanged, every kwarg reaches forward, freq, FSDP2 outside."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from spartron.checkpointing import (
    ACConfig,
    apply_ac_to_blocks,
    apply_activation_checkpointing,
    checkpoint_region_of,
)
from spartron.testing import run_distributed


class KwargBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.GELU())
        self.register_buffer("scale", torch.tensor(2.0))
        self.seen: dict = {}

    def forward(self, x, **kwargs):
        self.seen = dict(kwargs)
        return self.inner(x) * self.scale


def test_names_and_state_dict_keys_are_unchanged():
    block = KwargBlock()
    names = [n for n, _ in block.named_parameters()]
    keys = list(block.state_dict())
    reference = copy.deepcopy(block.state_dict())
    wrapped = apply_activation_checkpointing(block, ACConfig(mode="full"))
    assert wrapped is block and isinstance(block, KwargBlock)
    assert [n for n, _ in block.named_parameters()] == names and list(block.state_dict()) == keys
    block.load_state_dict(reference)  # a checkpoint saved without AC loads as is


def test_every_call_keyword_reaches_forward():
    block = apply_activation_checkpointing(KwargBlock(), ACConfig(mode="selective"))
    opts = dict(function="f", preserve_rng_state=False, context_fn=None, use_reentrant=False,
                policy="p", fn=1, config={"a": 1})
    x = torch.randn(2, 4, requires_grad=True)
    block(x, **opts).sum().backward()
    assert block.seen == opts  # the replay saw them too (seen is overwritten by the replay)
    assert checkpoint_region_of(block).last_stats.replay_count == 1
    assert block.inner[0].weight.grad is not None


@pytest.mark.parametrize("mode,reentrant", [("full", True), ("selective", True), ("full", False)])
def test_wrapped_block_grads_equal_unwrapped(mode, reentrant):
    torch.manual_seed(0)
    plain = KwargBlock()
    wrapped = apply_activation_checkpointing(copy.deepcopy(plain), ACConfig(mode=mode, reentrant=reentrant))
    x = torch.randn(3, 4)
    plain(x).square().sum().backward()
    wrapped(x).square().sum().backward()
    for (n, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), n


def test_mode_none_and_double_wrapping():
    block = KwargBlock()
    assert apply_activation_checkpointing(block, ACConfig(mode="none")) is block
    assert type(block) is KwargBlock and checkpoint_region_of(block) is None
    apply_activation_checkpointing(block, ACConfig(mode="full"))
    with pytest.raises(ValueError, match="already wrapped in a checkpoint region"):
        apply_activation_checkpointing(block, ACConfig(mode="full"))


@pytest.mark.parametrize("container", ["list", "dict"])
def test_apply_to_every_freq_th_block(container):
    blocks = [KwargBlock() for _ in range(5)]
    holder = nn.ModuleList(blocks) if container == "list" else nn.ModuleDict({f"l{i}": b for i, b in
                                                                              enumerate(blocks)})
    wrapped = apply_ac_to_blocks(holder, ACConfig(mode="full", freq=2))
    assert wrapped == (["0", "2", "4"] if container == "list" else ["l0", "l2", "l4"])
    assert [checkpoint_region_of(b) is not None for b in blocks] == [True, False, True, False, True]
    assert checkpoint_region_of(blocks[2]).options.name == ("block 2" if container == "list" else "block l2")


# --- FSDP2 composition on real gloo ranks -----------------------------------------------------------

class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
                                    for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def _fsdp_worker(rank: int, world_size: int, mode: str, reentrant: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    reference = Stack()
    model = copy.deepcopy(reference)
    data = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 + r)) for r in range(world_size)]

    sum(reference(d).square().mean() for d in data).div(world_size).backward()

    config = ACConfig(mode=mode, reentrant=reentrant)
    apply_ac_to_blocks(model.blocks, config)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with pytest.raises(ValueError, match="apply activation checkpointing before fully_shard"):
        apply_activation_checkpointing(model, config)
    model(data[rank]).square().mean().backward()

    errors = {}
    for (name, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        errors[name] = (p.grad.full_tensor() - ref.grad).abs().max().item()
    replays = [checkpoint_region_of(b).last_stats.replay_count for b in model.blocks]
    return errors, replays


@pytest.mark.parametrize("mode,reentrant", [("full", True), ("selective", True), ("full", False)])
def test_fully_shard_outside_the_region_matches_unsharded_grads(mode, reentrant):
    results = run_distributed(_fsdp_worker, 2, mode, reentrant)
    for errors, replays in results:
        assert replays == [1, 1, 1]
        assert max(errors.values()) < 1e-6, errors
