"""The copy-engine token exchange (`spartron_symm::exchange`, model.moe.all_to_all_transport).

CPU: the protocol runs for real on gloo ranks over `HostSharedMemory` (process-shared receive
buffers created before the ranks fork, gloo barriers): the same offsets, copies, barriers, autograd
and checkpoint behaviour as on CUDA, where only the memory (symmetric, peer-mapped) differs. The
exchange must move exactly the rows NCCL/gloo's all-to-all moves, so every comparison is exact.
GPU (marked `gpu`): the same MoE parity on 2 CUDA ranks with torch symmetric memory.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401  (custom ops import it lazily: seconds in every forked rank otherwise)
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from spartron.checkpointing import ACConfig, apply_activation_checkpointing, build_policy
from spartron.comm import collectives
from spartron.comm.copy_engine import (
    ExchangeBuffer,
    HostSharedMemory,
    exchange,
    exchange_plan,
    transpose_counts,
)
from spartron.comm.transport import EPTransport
from spartron.layers.config import ModelConfig, MoEConfig
from spartron.layers.model import build_model
from spartron.layers.moe import MoELayer, build_dispatcher
from spartron.layers.moe.dispatch import AllToAllDispatcher, CopyEngineDispatcher
from spartron.testing import run_distributed

DIM = 64


def _shared_buffers(world: int, nbytes: int = 1 << 20) -> list[torch.Tensor]:
    return [torch.zeros(nbytes, dtype=torch.uint8).share_memory_() for _ in range(world)]


def model_cfg(transport: str, dtype: str = "float32", **moe) -> ModelConfig:
    base = {"n_routed_experts": 8, "n_shared_experts": 1, "top_k": 3, "moe_inter_dim": 32,
            "score_func": "sigmoid", "dispatcher": "all_to_all", "all_to_all_transport": transport}
    return ModelConfig.model_validate({"dim": DIM, "init_std": 0.3, "dtype": dtype, "moe": base | moe})


# --------------------------------------------------------------------------------------------
# The plan (pure arithmetic) and the config
# --------------------------------------------------------------------------------------------

def test_plan_offsets_for_three_ranks():
    # rows s sends to r: rank 0 -> [1, 2, 0], rank 1 -> [3, 0, 4], rank 2 -> [5, 6, 7]
    counts = [1, 2, 0, 3, 0, 4, 5, 6, 7]
    plan = exchange_plan(counts, 3, 1)
    assert plan.send_sizes == [3, 0, 4] and plan.send_offsets == [0, 3, 3]
    assert plan.recv_sizes == [2, 0, 6] and plan.recv_offsets == [0, 2, 2]
    # in rank r's buffer my rows follow rank 0's rows for r: 1 for rank 0, 2 for rank 1, 0 for rank 2
    assert plan.remote_offsets == [1, 2, 0]
    assert plan.max_rows_received == 11  # column sums 9, 8, 11
    assert transpose_counts(counts, 3) == [1, 3, 5, 2, 0, 6, 0, 4, 7]


def test_plan_rejects_bad_counts():
    with pytest.raises(ValueError, match=r"counts has 3 entries, expected 2 x 2"):
        exchange_plan([1, 2, 3], 2, 0)
    with pytest.raises(ValueError, match=r"counts must be non-negative"):
        exchange_plan([1, -2, 3, 4], 2, 0)


def test_transport_applies_to_all_to_all_only():
    with pytest.raises(ValueError, match=r"model.moe.all_to_all_transport = 'copy_engine' applies to "
                                         r"model.moe.dispatcher = 'all_to_all', not 'deepep'"):
        MoEConfig(dispatcher="deepep", all_to_all_transport="copy_engine")
    with pytest.raises(ValueError, match="all_to_all_transport"):
        MoEConfig(all_to_all_transport="nvshmem")
    with pytest.raises(ValueError, match=r"model.moe.copy_engine_sync = 'stream_wait' applies to "
                                         r"model.moe.all_to_all_transport = 'copy_engine', not 'nccl'"):
        MoEConfig(copy_engine_sync="stream_wait")
    assert MoEConfig(all_to_all_transport="copy_engine", copy_engine_sync="stream_wait").copy_engine_sync == \
        "stream_wait"


def test_build_model_takes_the_sync_from_the_config():
    def worker(rank, world):
        from spartron.parallel.dims import ParallelDims
        from spartron.parallel.groups import ParallelGroups

        groups = ParallelGroups.build(ParallelDims(world, fsdp=world, ep=world), "cpu")
        cfg = model_cfg("copy_engine", copy_engine_sync="stream_wait").model_copy(update={"first_k_dense": 0})
        dispatcher = next(iter(build_model(cfg, groups).moe_layers())).dispatcher
        try:
            ExchangeBuffer(dist.group.WORLD, sync="spin")
        except ValueError as err:
            return dispatcher.buffer.sync, str(err)
        return dispatcher.buffer.sync, "no error"

    assert run_distributed(worker, 2) == [("stream_wait", "model.moe.copy_engine_sync must be one of "
                                                          "('barrier', 'stream_wait'), got 'spin'")] * 2


def test_policy_always_saves_the_exchange():
    for mode in ("full", "selective"):
        policy = build_policy(mode)
        assert policy.decide(torch.ops.spartron_symm.exchange.default, (), {}) == "mandatory", mode


def test_fake_impl_gives_the_received_rows():
    def worker(rank, world):
        buffer = ExchangeBuffer(dist.group.WORLD, HostSharedMemory(shared, dist.group.WORLD))
        with FakeTensorMode():
            x = torch.empty(5, DIM)
            out = exchange(buffer, x, [2, 3, 4, 1])  # rank 0 receives 2 + 4, rank 1 3 + 1
        return tuple(out.shape), buffer.exchanges

    shared = _shared_buffers(2)
    assert run_distributed(worker, 2) == [((6, DIM), 0), ((4, DIM), 0)]  # no real exchange ran


# --------------------------------------------------------------------------------------------
# The exchange against the all-to-all, on 3 gloo ranks
# --------------------------------------------------------------------------------------------

def _exchange_worker(rank, world, shared):
    group = dist.group.WORLD
    buffer = ExchangeBuffer(group, HostSharedMemory(shared, group))
    results = []
    for seed in range(3):  # reused buffer, different (uneven, some empty) splits each time
        g = torch.Generator().manual_seed(seed)
        counts = torch.randint(0, 5, (world * world,), generator=g)
        counts[seed] = 0
        counts = counts.tolist()
        plan = exchange_plan(counts, world, rank)
        x = torch.randn(sum(plan.send_sizes), DIM, generator=torch.Generator().manual_seed(10 * seed + rank))
        x_ref = x.clone().requires_grad_()
        x_ce = x.clone().requires_grad_()
        ref = collectives.all_to_all(x_ref, plan.recv_sizes, plan.send_sizes, group)
        got = exchange(buffer, x_ce, counts)
        weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(99 + rank))
        (ref * weights).sum().backward()
        (got * weights).sum().backward()
        results.append((torch.equal(got, ref), torch.equal(x_ce.grad, x_ref.grad), got.shape[0]))
    return results, buffer.exchanges


def test_exchange_moves_exactly_what_all_to_all_moves_and_back():
    world = 3
    for results, exchanges in run_distributed(_exchange_worker, world, _shared_buffers(world)):
        assert [r[:2] for r in results] == [(True, True)] * 3
        assert exchanges == 6  # 3 forward + 3 backward (the transposed exchange)


def _too_small_worker(rank, world, shared):
    buffer = ExchangeBuffer(dist.group.WORLD, HostSharedMemory(shared, dist.group.WORLD))
    x = torch.randn(40, DIM)
    try:
        exchange(buffer, x, [20, 20, 20, 20])
    except ValueError as err:
        return str(err)
    return "no error"


def test_exchange_larger_than_the_given_memory_fails_on_every_rank_before_any_copy():
    slot = 40 * DIM * 4  # 40 float32 rows received per rank
    shared = _shared_buffers(2, nbytes=2 * slot - 1)  # two slots, less one byte
    for message in run_distributed(_too_small_worker, 2, shared):
        assert message == f"exchange needs two {slot}-byte receive slots, the given memory holds {2 * slot - 1} bytes"


def test_default_memory_is_cuda_only():
    def worker(rank, world):
        buffer = ExchangeBuffer(dist.group.WORLD)
        try:
            exchange(buffer, torch.randn(2, DIM), [1, 1, 1, 1])
        except ValueError as err:
            return str(err)
        return "no error"

    assert run_distributed(worker, 2) == ["model.moe.all_to_all_transport = 'copy_engine' moves CUDA tensors, "
                                          "got cpu"] * 2


# --------------------------------------------------------------------------------------------
# The MoE layer: copy engines vs NCCL/gloo all-to-all, every AC and micro-batch mode, EP=2
# --------------------------------------------------------------------------------------------

MODES = ["none", "full", "selective", "none-experts2", "selective-experts2"]


def _train_once(layer, x, g, mode):
    base, _, chunks = mode.partition("-")
    if base != "none":
        apply_activation_checkpointing(layer, ACConfig(mode=base))
    x = x.clone().requires_grad_()
    out = layer(x)["hidden_states"]
    (out.float() * g).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def _layer_parity_worker(rank, world, device_kind, shared, modes, sync="barrier"):
    gpu = device_kind == "cuda"
    if gpu:
        torch.cuda.set_device(rank)
        device, group = torch.device("cuda", rank), dist.new_group(list(range(world)), backend="nccl")
        memory, dtype = None, "bfloat16"  # torch symmetric memory
    else:
        device, group = torch.device("cpu"), dist.group.WORLD
        memory, dtype = HostSharedMemory(shared, group), "float32"
    torch.manual_seed(100 + rank)
    x = torch.randn(4, 8, DIM, device=device, dtype=getattr(torch, dtype))
    g = torch.randn(x.shape, device=device)
    report = {}
    for mode in modes:
        layers = {}
        for transport in ("nccl", "copy_engine"):
            torch.manual_seed(0)
            extra = {"copy_engine_sync": sync} if transport == "copy_engine" else {}
            buffers = EPTransport(group, sync, memory=memory) if transport == "copy_engine" else EPTransport(group)
            layers[transport] = MoELayer(model_cfg(transport, dtype, **extra), buffers, device=device,
                                         micro_batches=2 if mode.endswith("experts2") else 1)
        ce = layers["copy_engine"].dispatcher
        assert isinstance(ce, CopyEngineDispatcher) and type(layers["nccl"].dispatcher) is AllToAllDispatcher
        ref, got = (_train_once(layers[t], x, g, mode) for t in ("nccl", "copy_engine"))
        assert torch.equal(got[0], ref[0]), f"{mode}: output"
        assert torch.equal(got[1], ref[1]), f"{mode}: input grad"
        for name, grad in ref[2].items():
            assert torch.equal(got[2][name], grad), f"{mode}: grad of {name}"
        chunks = 2 if mode.endswith("experts2") else 1
        # dispatch + combine per chunk, and their backwards; never replayed under AC (mandatory save)
        assert ce.buffer.exchanges == 4 * chunks, (mode, ce.buffer.exchanges)
        report[mode] = "ok"
    return report


def test_ep2_moe_layer_matches_all_to_all_exactly_in_every_mode():
    results = run_distributed(_layer_parity_worker, 2, "cpu", _shared_buffers(2, 4 << 20), MODES, timeout=120)
    assert results == [{m: "ok" for m in MODES}] * 2


def _build_model_worker(rank, world):
    from spartron.parallel.dims import ParallelDims
    from spartron.parallel.groups import ParallelGroups

    groups = ParallelGroups.build(ParallelDims(world, fsdp=world, ep=world), "cpu")
    cfg = model_cfg("copy_engine").model_copy(update={"n_layers": 3, "first_k_dense": 0})
    model = build_model(cfg, groups)
    dispatchers = [m.dispatcher for m in model.moe_layers()]
    return (len(dispatchers), all(isinstance(d, CopyEngineDispatcher) for d in dispatchers),
            len({id(d.buffer) for d in dispatchers}), dispatchers[0].buffer is model.transport.exchange_buffer(),
            model.close())  # nothing allocated before the first exchange: nothing to release


def test_build_model_shares_one_exchange_buffer_per_ep_group():
    assert run_distributed(_build_model_worker, 2) == [(3, True, 1, True, 0)] * 2


def test_single_rank_needs_no_exchange():
    assert type(build_dispatcher(model_cfg("copy_engine").moe, None)).__name__ == "LocalDispatcher"
    assert type(build_dispatcher(model_cfg("copy_engine").moe, EPTransport(None))).__name__ == "LocalDispatcher"


# --------------------------------------------------------------------------------------------
# GPU: torch symmetric memory on 2 CUDA ranks (run on the lent 2 x H200 machine)
# --------------------------------------------------------------------------------------------

def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA: the copy-engine exchange uses torch symmetric memory between GPUs"
    if torch.cuda.device_count() < 2:
        return f"needs 2 CUDA GPUs for EP=2, found {torch.cuda.device_count()}"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip_reason() is not None, reason=str(_gpu_skip_reason()))
@pytest.mark.parametrize("sync", ["barrier", "stream_wait"])
def test_ep2_moe_layer_matches_nccl_exactly_gpu(sync):
    results = run_distributed(_layer_parity_worker, 2, "cuda", None, MODES, sync, timeout=600, start_method="spawn")
    assert results == [{m: "ok" for m in MODES}] * 2
