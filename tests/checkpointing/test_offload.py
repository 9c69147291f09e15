"""Offload windows: the window rule, exact restore, release by identity, pool reuse, DSA ids, errors,
and everything composed (selective/full AC + micro-batch 2 + FSDP2 + EP on 2 gloo ranks + reuse frames)."""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from pydantic import ValidationError
from torch import nn

from spartron.checkpointing import ACConfig, OffloadConfig, apply_activation_checkpointing
from spartron.checkpointing.offload import (
    ActivationOffloader,
    OffloadSetupError,
    checkpoint_regions,
    offload_session,
    offload_window,
)
from spartron.layers.model import build_model
from spartron.layers.parallelize import parallelize
from spartron.parallel.dims import ParallelDims
from spartron.parallel.groups import ParallelGroups
from spartron.runtime.config import ConfigError, load_config
from spartron.testing import run_distributed

ON = OffloadConfig(enabled=True)


class Block(nn.Module):
    """A block that records the inputs it sees (original pass and replay) and uses integer ids."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        self.seen.append(x.detach().clone())
        y = torch.tanh(self.lin(x)) + x
        return y if ids is None else y + ids.to(y.dtype).mean()


def stack(n: int = 4, mode: str = "full", reentrant: bool = True, seed: int = 0) -> tuple[nn.ModuleList, nn.ModuleList]:
    torch.manual_seed(seed)
    plain = nn.ModuleList(Block() for _ in range(n))
    wrapped = copy.deepcopy(plain)
    for block in wrapped:
        apply_activation_checkpointing(block, ACConfig(mode=mode, reentrant=reentrant))
    return plain, wrapped


def run(blocks, x, ids=None):
    for block in blocks:
        x = block(x, ids)
    return x.square().sum()


# ------------------------------------------------------------------------------------- window rule

def test_window_rule_all_but_last_and_explicit_list():
    assert offload_window(OffloadConfig(), 5) == frozenset()  # disabled
    assert offload_window(ON, 5) == {0, 1, 2, 3}
    assert offload_window(OffloadConfig(enabled=True, keep_last=2), 5) == {0, 1, 2}
    assert offload_window(OffloadConfig(enabled=True, keep_last=0), 3) == {0, 1, 2}
    assert offload_window(OffloadConfig(enabled=True, window=[0, 2]), 3) == {0, 2}


@pytest.mark.parametrize("config,n,message", [
    (OffloadConfig(enabled=True, keep_last=4), 4, r"offload.keep_last = 4 keeps every one of the 4 checkpoint"),
    (OffloadConfig(enabled=True, window=[0, 5]), 4, r"offload.window names regions \[5\], but the model has 4"),
    (OffloadConfig(enabled=True, window=[1, 1]), 4, r"offload.window must be a non-empty list of distinct"),
    (OffloadConfig(enabled=True, window=[]), 4, r"offload.window must be a non-empty list"),
    (ON, 0, r"no checkpoint regions"),
])
def test_window_that_cannot_work_is_rejected(config, n, message):
    with pytest.raises(OffloadSetupError, match=message):
        offload_window(config, n)


def test_bad_offload_configs_rejected_at_setup():
    with pytest.raises(ValidationError, match="offload.prefetch_depth must be >= 1 when offload.enabled"):
        OffloadConfig(enabled=True, prefetch_depth=0)
    with pytest.raises(ConfigError, match="offload.enabled needs checkpoint regions"):
        load_config("configs/tiny.toml", ["ac.mode=none", "offload.enabled=true"])
    _, blocks = stack(3)
    with pytest.raises(OffloadSetupError, match="window names regions"):
        ActivationOffloader.for_model(blocks, OffloadConfig(enabled=True, window=[3]))


# ------------------------------------------------------------------------------ exact restore etc.

@pytest.mark.parametrize("mode,reentrant", [("full", True), ("selective", True), ("full", False)])
def test_offloaded_inputs_restored_exactly_and_grads_bit_equal(mode, reentrant):
    plain, blocks = stack(4, mode, reentrant)
    x = torch.randn(8, 16, requires_grad=True)
    run(plain, x).backward()
    x2 = x.detach().clone().requires_grad_()
    with offload_session(blocks, ON) as session:
        run(blocks, x2).backward()
    for a, b in zip(plain.parameters(), blocks.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert torch.equal(x.grad, x2.grad)
    for block in blocks:  # [original pass, replay]: the replay saw bit-identical restored inputs
        assert len(block.seen) == 2 and torch.equal(block.seen[0], block.seen[1])
    s = session.stats
    assert (s.region_calls, s.offloaded_tensors, s.restored_tensors, s.kept_tensors) == (4, 3, 3, 1)
    assert s.offloaded_bytes == 3 * 8 * 16 * 4 and s.device_bytes == 0
    assert session.offloader.pool.stats.in_use_bytes == 0
    assert all(r.saved_inputs_scope is None for r in checkpoint_regions(blocks))  # detached at exit


def test_offloaded_device_tensors_are_released_by_identity():
    """Inputs of regions in the window are freed after forward (the hook keeps no reference);
    the last region's input is kept. A view sharing the storage of an offloaded tensor stays valid."""
    _, blocks = stack(3)
    refs = []
    outputs_view = []

    def forward_only():
        x = torch.randn(4, 16, requires_grad=True)
        h = x
        for block in blocks:
            h = block(h)
            refs.append(weakref.ref(h))
        return h.sum(), x

    for cfg in (OffloadConfig(), ON):
        refs.clear()
        offloader = ActivationOffloader.for_model(blocks, cfg)
        with offloader.session():
            loss, x = forward_only()
            if cfg.enabled:
                keep_view = x[1]  # a view of an offloaded input: offloading must not break it
                outputs_view.append(keep_view.clone())
            gc.collect()
            alive = [r() is not None for r in refs]
            loss.backward()
        # refs[0] = input of block 1, refs[1] = input of block 2 (last region, kept), refs[2] = loss input
        assert alive[:2] == ([True, True] if not cfg.enabled else [False, True])
    assert torch.equal(keep_view, outputs_view[0])


def test_peak_device_bytes_lower_with_the_window_on():
    _, blocks = stack(6)
    x = torch.randn(32, 16, requires_grad=True)
    peaks = {}
    for name, cfg in {"off": OffloadConfig(), "on": ON}.items():
        with offload_session(blocks, cfg) as session:
            run(blocks, x).backward()
        peaks[name] = session.stats.peak_device_bytes
    one = 32 * 16 * 4
    assert peaks == {"off": 6 * one, "on": 2 * one}  # on: the kept last input + one restored input


@pytest.mark.parametrize("mode,reentrant", [("full", True), ("selective", True), ("full", False)])
def test_region_backward_observer_order_and_restored_copies_released_after_their_backward(mode, reentrant):
    """The observer sees each region's backward start, last region first; at that moment no restored
    copy of a region whose backward already ran is alive (only this one's and the prefetched ones)."""
    _, blocks = stack(5, mode, reentrant)
    one = 4 * 16 * 4
    for depth in (1, 2):
        offloader = ActivationOffloader.for_model(blocks, OffloadConfig(enabled=True, prefetch_depth=depth))
        seen: list[tuple[int, list[int], int]] = []

        def observe(key, seen=seen):
            gc.collect()
            seen.append((key, sorted(i for i, _ in session.live_restored()), session.held_device_bytes()))

        forward_seen: list[tuple[int, int]] = []

        def observe_forward(key, forward_seen=forward_seen):
            gc.collect()
            forward_seen.append((key, session.held_device_bytes()))

        with offloader.session(on_region_backward=observe, on_region_forward=observe_forward) as session:
            loss = run(blocks, torch.randn(4, 16, requires_grad=True))
            # each region call starts with nothing of the window on device (inputs copied out and freed)
            assert forward_seen == [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0)]
            held_after_forward = session.held_device_bytes()
            loss.backward()
            gc.collect()
            assert session.live_restored() == [] and session.held_device_bytes() == 0
        assert held_after_forward == one  # only the last region's input (outside the window) is on device
        assert [key for key, _, _ in seen] == [4, 3, 2, 1, 0]
        for key, live, held in seen:
            # prefetched by the region after this one: calls key-depth+1 .. key (within the window 0..3)
            ahead = list(range(max(0, key - depth + 1), min(key, 3) + 1)) if key < 4 else []
            assert live == ahead, (depth, key, live)
            assert held == one * (len(ahead) + (key == 4)), (depth, key, held)  # + the kept input of region 4


def test_prefetch_depth_restores_regions_ahead_of_their_backward():
    _, blocks = stack(5)
    offloader = ActivationOffloader.for_model(blocks, OffloadConfig(enabled=True, prefetch_depth=2))
    restored_when = {}

    def spy(i):
        def hook(module, grad_in, grad_out):
            restored_when[i] = [c.index for c in session.calls
                                if any(h.tensor is not None and h.host is not None for h in c.handles)]
        return hook

    for i, block in enumerate(blocks):
        block.register_full_backward_hook(spy(i))
    with offloader.session() as session:
        run(blocks, torch.randn(4, 16, requires_grad=True)).backward()
    # when block 4 (kept) runs backward, calls 3 and 2 are already on device; block 3 brings 1, ...
    assert restored_when[4] == [2, 3] and restored_when[3] == [1, 2] and restored_when[1] == [0]
    assert session.stats.prefetched_ahead == 4 and session.stats.restored_tensors == 4


def test_pool_is_reused_across_steps_without_growth():
    _, blocks = stack(4)
    offloader = ActivationOffloader.for_model(blocks, ON)
    sizes = []
    for _ in range(4):
        with offloader.session():
            run(blocks, torch.randn(8, 16, requires_grad=True)).backward()
        sizes.append(offloader.pool.stats.allocated_bytes)
    assert sizes == [3 * 8 * 16 * 4] * 4
    p = offloader.pool.stats
    assert p.buffers == 3 and p.acquisitions == 12 and p.reuses == 9 and p.in_use_bytes == 0


def test_pool_bound_keeps_the_rest_on_device_and_stays_exact():
    plain, blocks = stack(4)
    x = torch.randn(8, 16, requires_grad=True)
    run(plain, x).backward()
    with offload_session(blocks, OffloadConfig(enabled=True, pool_max_bytes=8 * 16 * 4)) as session:
        run(blocks, x.detach().requires_grad_()).backward()
    assert session.offloader.pool.stats.refused == 2 and session.stats.offloaded_tensors == 1
    for a, b in zip(plain.parameters(), blocks.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_min_bytes_threshold():
    _, blocks = stack(3)
    with offload_session(blocks, OffloadConfig(enabled=True, min_bytes=4 * 16 * 4 + 1)) as session:
        run(blocks, torch.randn(4, 16, requires_grad=True)).backward()
    assert session.stats.offloaded_tensors == 0 and session.stats.kept_tensors == 3


@pytest.mark.parametrize("what,offloaded", [("inputs", 2), ("inputs_and_dsa_ids", 3)])
def test_dsa_ids_ride_the_window_once_and_come_back_equal(what, offloaded):
    """The same ids tensor saved by two regions is copied once (identity) and restored equal."""
    plain, blocks = stack(3)
    ids = torch.randint(0, 100, (8, 16), dtype=torch.int32)
    x = torch.randn(8, 16, requires_grad=True)
    run(plain, x, ids).backward()
    restored_ids = []
    cfg = OffloadConfig(enabled=True, what=what)
    with offload_session(blocks, cfg) as session:
        loss = run(blocks, x.detach().requires_grad_(), ids)
        for call in session.calls[:2]:
            handle = call.handles[-1]  # ids are the last saved input
            restored_ids.append(handle)
        loss.backward()
    s = session.stats
    assert s.offloaded_tensors == offloaded
    assert s.deduplicated_tensors == (1 if what == "inputs_and_dsa_ids" else 0)
    for a, b in zip(plain.parameters(), blocks.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    if what == "inputs_and_dsa_ids":
        assert all(h.host is not None and torch.equal(h.host.host, ids) for h in restored_ids)
        assert restored_ids[0].host is restored_ids[1].host  # one host copy for both regions


def test_session_lifecycle_errors():
    _, blocks = stack(2)
    offloader = ActivationOffloader.for_model(blocks, ON)
    with offloader.session():
        with pytest.raises(RuntimeError, match="already attached to another open offload session"):
            offloader.session().__enter__()
        loss = run(blocks, torch.randn(2, 16, requires_grad=True))
    with pytest.raises(RuntimeError, match="ran backward after its offload session closed"):
        loss.backward()


# ---------------------------------------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned memory and streams")


@pytest.mark.gpu
@needs_cuda
def test_gpu_pinned_side_streams_and_bit_exact():
    plain, blocks = stack(6)
    plain, blocks = plain.cuda(), blocks.cuda()
    x = torch.randn(256, 16, device="cuda", requires_grad=True)
    run(plain, x).backward()
    offloader = ActivationOffloader.for_model(blocks, OffloadConfig(enabled=True, prefetch_depth=2))
    for _ in range(2):
        blocks.zero_grad()
        with offloader.session() as session:
            run(blocks, x.detach().requires_grad_()).backward()
        torch.cuda.synchronize()
        for a, b in zip(plain.parameters(), blocks.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
    host = [h.host for c in session.calls for h in c.handles if h.host is not None]
    assert host and all(c.buffer.is_pinned() for c in host)
    streams = offloader.streams
    compute = torch.cuda.current_stream()
    assert streams.d2h != compute and streams.h2d != compute and streams.d2h != streams.h2d
    assert all(c.d2h_done is not None for c in host)
    assert offloader.pool.stats.reuses >= 5


class SlowBlock(nn.Module):
    """A GPU-bound block: the host runs regions ahead of the GPU, as in a real model's forward."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time
        return torch.tanh(self.lin(x)) + x


@pytest.mark.gpu
@needs_cuda
def test_gpu_offloaded_inputs_are_free_while_the_host_runs_ahead():
    """With the host ahead of the GPU, every window region's input is already free (allocator stats)
    when the forward ends on the host: allocated memory is lower by exactly the bytes offloaded, and
    the gradients equal the run without offload."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(SlowBlock(1024) for _ in range(6)).cuda()
    for block in blocks:
        apply_activation_checkpointing(block, ACConfig(mode="full", reentrant=True))
    leaf = torch.randn(4096, 1024, device="cuda", requires_grad=True)  # held by the graph either way

    def step(offloader):
        blocks.zero_grad(set_to_none=True)
        leaf.grad = None
        with offloader.session() if offloader is not None else contextlib.nullcontext() as session:
            x = leaf * 1.0  # 16 MiB per region input, each dropped by this loop once its region is done
            for block in blocks:
                x = block(x)
            loss = x.square().sum()
            allocated = torch.cuda.memory_allocated()  # no synchronize: the host is ahead
            loss.backward()
        torch.cuda.synchronize()
        return allocated, session, leaf.grad.clone()

    offloader = ActivationOffloader.for_model(blocks, ON)
    for _ in range(2):  # first steps allocate workspaces and pinned buffers: compare warm steps
        off, _, grad_off = step(None)
        on, session, grad_on = step(offloader)
    assert session.stats.offloaded_bytes == 5 * 16 * 2**20
    assert off - on == session.stats.offloaded_bytes, (off, on)
    assert torch.equal(grad_on, grad_off)


# ------------------------------------------------------------------------------------ composition

def _sharded_model(cfg, groups, reference):
    ep_rank = groups.rank_in("ep")
    model = build_model(cfg.model, groups, micro_batches=cfg.train.intra_layer_micro_batches,
                        micro_batch_scope=cfg.train.intra_layer_micro_batch_scope)
    model.load_state_dict({name: _expert_slice(name, t, ep_rank) for name, t in reference.state_dict().items()})
    return parallelize(model, groups, cfg.ac)


def _expert_slice(name, t, ep_rank):
    n_local = t.shape[0] // 2
    return t[ep_rank * n_local:(ep_rank + 1) * n_local] if ".experts." in name else t


def _composition_worker(rank, world, ac_mode, scope):
    """Everything on (offload + AC + micro-batch 2 + FSDP2 + EP=2 + DSA reuse frames) vs the same
    two ranks with none of it, and the loss vs one process on the whole batch."""
    common = ["train.seq_len=32", "train.micro_batch_size=2", "model.moe.aux_loss_coeff=0.01"]
    everything = load_config("configs/tiny.toml", [
        *common, "parallel.ep=2", f"ac.mode={ac_mode}", "offload.enabled=true", "offload.what=inputs_and_dsa_ids",
        "offload.prefetch_depth=2", "train.intra_layer_micro_batches=2",
        f"train.intra_layer_micro_batch_scope={scope}"])
    nothing = load_config("configs/tiny.toml", [*common, "parallel.ep=2", "ac.mode=none"])
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, everything.model.vocab_size, (4, 32), generator=g)
    labels = torch.randint(0, everything.model.vocab_size, (4, 32), generator=g)
    torch.manual_seed(0)
    reference = build_model(load_config("configs/tiny.toml", common).model)
    ref_loss = reference(tokens, labels)["loss"].detach()

    groups = ParallelGroups.build(ParallelDims(world, fsdp=2, ep=2), "cpu")
    mine = slice(2 * rank, 2 * rank + 2)
    base = _sharded_model(nothing, groups, reference)
    base_out = base(tokens[mine], labels[mine])
    base_out["loss"].backward()
    model = _sharded_model(everything, groups, reference)
    if scope == "layer":
        assert model.intra_layer_micro_batches == 2
    else:
        assert model.intra_layer_micro_batches == 1 and {m.micro_batches for m in model.moe_layers()} == {2}
    offloader = ActivationOffloader.for_model(model, everything.offload, "cpu")
    with offloader.session() as session:
        out = model(tokens[mine], labels[mine])
        out["loss"].backward()
    torch.testing.assert_close(out["loss"], base_out["loss"], rtol=1e-6, atol=1e-6)
    loss = out["loss"].detach().clone()
    dist.all_reduce(loss)
    torch.testing.assert_close(loss / world, ref_loss, rtol=1e-5, atol=1e-5)
    base_grads = dict(base.named_parameters())
    for name, p in model.named_parameters():
        expected = base_grads[name].grad
        if p.grad is None:
            assert expected is None, name
            continue
        torch.testing.assert_close(p.grad.full_tensor(), expected.full_tensor(), rtol=1e-5, atol=1e-6, msg=name)
    s = session.stats
    groups.destroy()
    return {"regions": len(offloader.regions), "window": sorted(offloader.window),
            "offloaded": s.offloaded_tensors, "restored": s.restored_tensors, "dedup": s.deduplicated_tensors,
            "device_bytes": s.device_bytes}


@pytest.mark.parametrize(("ac_mode", "scope"), [("full", "layer"), ("selective", "layer"), ("selective", "experts")])
def test_offload_ac_microbatch2_fsdp2_ep2_reuse_frames_together(ac_mode, scope):
    results = run_distributed(_composition_worker, 2, ac_mode, scope, timeout=120)
    for r in results:
        # 4 decoder regions + 1 shared MTP block region (called at 2 depths): window = all but the last
        assert r["regions"] == 5 and r["window"] == [0, 1, 2, 3]
        assert r["offloaded"] > 0 and r["restored"] >= r["offloaded"] and r["device_bytes"] == 0
        assert r["dedup"] > 0  # DSA ids shared by source -> consumer regions copied once


@pytest.mark.parametrize("ac_mode", ["full", "selective"])
def test_reference_model_frees_each_offloaded_input_before_the_next_region(ac_mode):
    """Nothing in the model's forward keeps a window region's input alive (the embedding output
    included): when each region call starts, every input offloaded so far is already unreferenced, so
    its device memory is free during the rest of the forward. Checked without the garbage collector."""
    cfg = load_config("configs/tiny.toml", ["device=cpu", f"ac.mode={ac_mode}", "offload.enabled=true"])
    torch.manual_seed(0)
    model = parallelize(build_model(cfg.model), None, cfg.ac)
    offloader = ActivationOffloader.for_model(model, cfg.offload, "cpu")
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len))
    with offloader.session():  # warm: a first call's lazy imports keep their frames for a while
        model(tokens, tokens)["loss"].backward()
    held: list[tuple[int, list]] = []
    gc.collect()
    gc.disable()
    try:
        with offloader.session(on_region_forward=lambda key: held.append((key, session.offloaded_still_referenced()))
                               ) as session:
            model(tokens, tokens)["loss"].backward()
    finally:
        gc.enable()
    assert [key for key, _ in held] == [call.key for call in session.calls] and len(held) >= 5
    assert session.stats.offloaded_tensors == len(offloader.window) and all(refs == [] for _, refs in held), held
