"""EP transports that hold a buffer (DeepEP, the copy-engine exchange) under torch.compile, on CPU: a
compiled MoE block traces fullgraph (no graph break, one graph for two routings) and equals the same
block eager, bitwise, with AC none / full / selective; the compiled forward graph holds the transport's
forward ops and the compiled backward only their backward ops (the policy saves them: no second
exchange), and the buffer sees the same calls compiled as eager.

Runs on 2 gloo ranks: DeepEP with `deepep_emulator` (the test double of DeepEP's intranode Buffer, next
to this file), the copy engine over `HostSharedMemory`; the ops, their fake impls, autograd and the
buffer refs are the project's, only DeepEP's kernels (and CUDA symmetric memory) are replaced. What this
cannot show: the real kernels under a compiled graph on 2+ GPUs (not lent).
"""

from __future__ import annotations

import deepep_emulator  # test double of DeepEP, next to this file (tests/layers/moe)
import pytest
import torch
import torch.distributed as dist
from functorch.compile import make_boxed_func
from test_moe_deepep import _gpu_skip_reason  # next to this file
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

from spartron.checkpointing import ACConfig, apply_activation_checkpointing, compile_block
from spartron.comm.copy_engine import HostSharedMemory
from spartron.comm.transport import EPTransport
from spartron.layers.config import ModelConfig
from spartron.layers.moe import MoELayer
from spartron.testing import run_distributed

DIM, TOKENS = 32, 12
OPS = {"deepep": ("spartron_deepep.dispatch.", "spartron_deepep.combine.", "spartron_deepep.dispatch_backward.",
                   "spartron_deepep.cached_dispatch."),
       "copy_engine": ("spartron_symm.exchange.",)}


def _cfg(kind: str) -> ModelConfig:
    moe = {"n_routed_experts": 4, "n_shared_experts": 1, "top_k": 2, "moe_inter_dim": 16, "score_func": "sigmoid",
           "bias_update_rate": 0.01}
    moe |= {"dispatcher": "deepep", "deepep_num_sms": 8} if kind == "deepep" else {"all_to_all_transport": kind}
    dtype = "bfloat16" if kind == "deepep" else "float32"  # DeepEP moves bf16 tokens only
    return ModelConfig.model_validate({"dim": DIM, "init_std": 0.3, "dtype": dtype, "moe": moe})


def _graph_op_counts(graphs: list[torch.fx.GraphModule], kind: str) -> list[int]:
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    return [sum(t.startswith(op) for t in targets) for op in OPS[kind]]


def _same(a, b, gpu: bool, what) -> None:
    """Bitwise on CPU; on the GPU (DeepEP's kernels, real NVLink) bf16 tolerance."""
    if not gpu:
        assert torch.equal(a, b), (what, (a.float() - b.float()).abs().max().item())
        return
    scale = max(a.float().abs().max().item(), 1e-6)
    torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2 * scale, msg=lambda m: f"{what}: {m}")


def _compiled_worker(rank, world, mode, kind, shared=None, device_kind="cpu"):
    graphs: dict[str, list] = {"forward": [], "backward": []}
    gpu = device_kind == "cuda"

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    torch._dynamo.reset()
    group, device = dist.group.WORLD, torch.device("cpu")
    if gpu:  # the real deep_ep on 2 CUDA ranks over NCCL
        torch.cuda.set_device(rank)
        group, device = dist.new_group(list(range(world)), backend="nccl"), torch.device("cuda", rank)
    # one buffer for both layers
    transport = EPTransport(group, deepep_library=None if gpu else deepep_emulator) if kind == "deepep" else \
        EPTransport(group, memory=HostSharedMemory(shared, group))
    dtype = torch.bfloat16 if kind == "deepep" else torch.float32
    layers = []
    for compiled in (False, True):
        torch.manual_seed(0)
        layer = MoELayer(_cfg(kind), transport, device=device)
        if mode != "none":
            apply_activation_checkpointing(layer, ACConfig(mode=mode, reentrant=False), name="moe")
        if compiled:
            compile_block(layer, backend)
        layers.append(layer)
    if gpu:  # DeepEP keeps no call counts
        def seen():
            return {}
    elif kind == "deepep":
        runtime = transport.deepep_buffer(2, 4, 8, DIM).runtime()

        def seen():
            return dict(runtime.calls)
    else:
        def seen():
            return {"exchange": transport.exchange_buffer().exchanges}
    counters.clear()
    calls = []
    for step in range(2):  # the second input routes differently: other receive sizes, the same graph
        torch.manual_seed(10 * step + rank)
        x = torch.randn(2, TOKENS // 2, DIM, dtype=dtype).to(device)
        g = torch.randn(2, TOKENS // 2, DIM).to(device)
        outs = []
        for layer in layers:
            before = seen()
            x_in = x.clone().requires_grad_()
            out = layer(x_in)
            (out["hidden_states"].float() * g).sum().backward()
            calls.append({k: v - before.get(k, 0) for k, v in seen().items()})
            outs.append((out["hidden_states"].detach(), x_in.grad, out["tokens_per_expert"]))
        for what, a, b in zip(("output", "input grad", "tokens per expert"), *outs, strict=True):
            _same(a, b, gpu, (step, mode, what))
    for (name, a), b in zip(layers[0].named_parameters(), layers[1].parameters(), strict=True):
        _same(a.grad, b.grad, gpu, (mode, name))
    assert torch.equal(layers[0].step_tokens_per_expert, layers[1].step_tokens_per_expert)
    breaks = sum(counters["graph_break"].values())
    unique = counters["stats"]["unique_graphs"]
    transport.destroy()
    fwd, bwd = (_graph_op_counts(graphs[k], kind) for k in ("forward", "backward"))
    return breaks, unique, fwd, bwd, calls


AC_MODES = [pytest.param("none", marks=pytest.mark.slow), pytest.param("full", marks=pytest.mark.slow), "selective"]


@pytest.mark.parametrize("mode", AC_MODES)
def test_compiled_deepep_moe_block_matches_eager_fullgraph_on_two_emulated_ranks(mode):
    one_step = {"layout": 1, "dispatch": 1, "combine": 2, "cached_dispatch": 1}  # eager, per step
    for breaks, unique, fwd, bwd, calls in run_distributed(_compiled_worker, 2, mode, "deepep", timeout=300):
        assert (breaks, unique) == (0, 1)
        # dispatch + combine in forward; backward: dispatch's backward (a combine) and combine's (a cached
        # dispatch), and neither forward op again (mandatory: saved, never recomputed)
        assert (fwd, bwd) == ([1, 1, 0, 0], [0, 0, 1, 1])
        assert calls == [one_step] * 4  # 2 steps x (eager, compiled)


@pytest.mark.parametrize("mode", AC_MODES)
def test_compiled_copy_engine_moe_block_matches_eager_fullgraph_on_two_ranks(mode):
    shared = [torch.zeros(1 << 20, dtype=torch.uint8).share_memory_() for _ in range(2)]
    for breaks, unique, fwd, bwd, calls in run_distributed(_compiled_worker, 2, mode, "copy_engine", shared,
                                                           timeout=300):
        assert (breaks, unique) == (0, 1)
        # dispatch + combine exchanges in forward, their two reverse exchanges in backward, none replayed
        assert (fwd, bwd) == ([2], [2])
        assert calls == [{"exchange": 4}] * 4


def _model_worker(rank, world, kind, shared):
    """The reference model (tiny: DSA, MTP, 2 intra-layer micro-batches) with DeepEP or the copy engine,
    EP=2 + FSDP2 and selective AC, compiled through parallelize vs the same eager: loss and gradients bitwise."""
    from spartron.layers.model import build_model
    from spartron.layers.parallelize import parallelize
    from spartron.parallel.dims import ParallelDims
    from spartron.parallel.groups import ParallelGroups
    from spartron.runtime.config import load_config

    transport_keys = ['model.moe.dispatcher="deepep"', 'model.dtype="bfloat16"', "model.moe.deepep_num_sms=8"] \
        if kind == "deepep" else ['model.moe.all_to_all_transport="copy_engine"']
    cfg = load_config("configs/tiny.toml", [
        "train.seq_len=32", "model.n_layers=2", "model.mtp.depth=1", "parallel.ep=2", *transport_keys,
        "ac.mode=selective", "ac.reentrant=false",
        "train.micro_batch_size=2", "train.intra_layer_micro_batches=2", "train.compile=true",
        "train.compile_backend=aot_eager"])
    groups = ParallelGroups.build(ParallelDims(world, fsdp=2, ep=2), "cpu")
    torch._dynamo.reset()
    models = []
    for backend in (None, "aot_eager"):
        transport = EPTransport(groups.ep, deepep_library=deepep_emulator) if kind == "deepep" else \
            EPTransport(groups.ep, memory=HostSharedMemory(shared, groups.ep))
        model = build_model(cfg.model, groups, transport=transport, micro_batches=2)
        models.append(parallelize(model, groups, cfg.ac, compile_backend=backend))
    counters.clear()
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + rank)
        tokens, labels = (torch.randint(0, cfg.model.vocab_size, (2, 32), generator=g) for _ in range(2))
        losses = []
        for model in models:
            loss = model(tokens, labels)["loss"]
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), (step, losses)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        if a.grad is not None:
            assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor()), name
    result = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    for model in models:
        model.close()
    groups.destroy()
    return result


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["deepep", "copy_engine"])
def test_compiled_model_with_deepep_or_copy_engine_ep2_fsdp2_matches_eager(kind):
    # 3 graphs, as with all_to_all (tests/test_compile_ac.py): dense layer, MoE layer with 2 micro-batches, MTP block
    shared = [torch.zeros(4 << 20, dtype=torch.uint8).share_memory_() for _ in range(2)]
    assert run_distributed(_model_worker, 2, kind, shared, timeout=600) == [(0, 3)] * 2


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip_reason() is not None, reason=str(_gpu_skip_reason()))
@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_compiled_deepep_moe_block_matches_eager_on_two_gpus(mode):
    # the same check with the real deep_ep kernels on 2 CUDA ranks (bf16 tolerance): not yet run (needs 2 GPUs)
    for breaks, unique, fwd, bwd, _ in run_distributed(_compiled_worker, 2, mode, "deepep", None, "cuda",
                                                       timeout=600, start_method="spawn"):
        assert (breaks, unique) == (0, 1)
        assert (fwd, bwd) == ([1, 1, 0, 0], [0, 0, 1, 1])
