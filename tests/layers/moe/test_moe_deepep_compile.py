"""DeepEP + torch.compile on CPU: a compiled MoE block with the DeepEP dispatcher traces fullgraph (no
graph break, one graph for two routings) and equals the same block eager, bitwise, with AC none / full /
selective; the compiled forward graph holds the dispatch and combine ops once each and the compiled
backward none (the policy saves them: no second exchange), and the buffer sees the same DeepEP calls
compiled as eager.

Runs on 2 gloo ranks with `deepep_emulator` (the test double of DeepEP's intranode Buffer, next to this
file): the ops, their fake impls, autograd and the buffer ref are the project's, only DeepEP's kernels
are replaced. What this cannot show: the real kernels under a compiled graph on 2+ GPUs (not lent).
"""

from __future__ import annotations

import deepep_emulator  # test double of DeepEP, next to this file (tests/layers/moe)
import pytest
import torch
import torch.distributed as dist
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

from spartron.checkpointing import ACConfig, apply_activation_checkpointing, compile_block
from spartron.comm.transport import EPTransport
from spartron.layers.config import ModelConfig
from spartron.layers.moe import MoELayer
from spartron.testing import run_distributed

DIM, TOKENS = 32, 12
DEEPEP_OPS = ("spartron_deepep.dispatch.", "spartron_deepep.combine.", "spartron_deepep.dispatch_backward.",
              "spartron_deepep.cached_dispatch.")


def _cfg() -> ModelConfig:
    return ModelConfig.model_validate({"dim": DIM, "init_std": 0.3, "dtype": "bfloat16", "moe": {
        "n_routed_experts": 4, "n_shared_experts": 1, "top_k": 2, "moe_inter_dim": 16, "score_func": "sigmoid",
        "dispatcher": "deepep", "deepep_num_sms": 8, "bias_update_rate": 0.01}})


def _graph_op_counts(graphs: list[torch.fx.GraphModule]) -> list[int]:
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    return [sum(t.startswith(op) for t in targets) for op in DEEPEP_OPS]


def _compiled_worker(rank, world, mode):
    graphs: dict[str, list] = {"forward": [], "backward": []}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    torch._dynamo.reset()
    transport = EPTransport(dist.group.WORLD, deepep_library=deepep_emulator)  # one buffer, both layers
    layers = []
    for compiled in (False, True):
        torch.manual_seed(0)
        layer = MoELayer(_cfg(), ep_group=dist.group.WORLD, transport=transport)
        if mode != "none":
            apply_activation_checkpointing(layer, ACConfig(mode=mode, reentrant=False), name="moe")
        if compiled:
            compile_block(layer, backend)
        layers.append(layer)
    runtime = transport.deepep_buffer(2, 4, 8, DIM).runtime()
    counters.clear()
    calls = []
    for step in range(2):  # the second input routes differently: other receive sizes, the same graph
        torch.manual_seed(10 * step + rank)
        x = torch.randn(2, TOKENS // 2, DIM, dtype=torch.bfloat16)
        g = torch.randn(2, TOKENS // 2, DIM)
        outs = []
        for layer in layers:
            before = dict(runtime.calls)
            x_in = x.clone().requires_grad_()
            out = layer(x_in)
            (out["hidden_states"].float() * g).sum().backward()
            calls.append({k: v - before.get(k, 0) for k, v in runtime.calls.items()})
            outs.append((out["hidden_states"].detach(), x_in.grad, out["tokens_per_expert"]))
        for a, b in zip(*outs, strict=True):
            assert torch.equal(a, b), (step, mode, (a.float() - b.float()).abs().max().item())
    for (name, a), b in zip(layers[0].named_parameters(), layers[1].parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), (mode, name)
    assert torch.equal(layers[0].step_tokens_per_expert, layers[1].step_tokens_per_expert)
    breaks = sum(counters["graph_break"].values())
    unique = counters["stats"]["unique_graphs"]
    transport.destroy()
    return breaks, unique, _graph_op_counts(graphs["forward"]), _graph_op_counts(graphs["backward"]), calls


def test_compiled_deepep_moe_block_matches_eager_fullgraph_on_two_emulated_ranks():
    one_step = {"layout": 1, "dispatch": 1, "combine": 2, "cached_dispatch": 1}  # eager, per step
    for mode in ("none", "full", "selective"):
        for breaks, unique, fwd, bwd, calls in run_distributed(_compiled_worker, 2, mode, timeout=300):
            assert (breaks, unique) == (0, 1), mode
            # dispatch + combine in forward; backward: dispatch's backward (a combine) and combine's (a cached
            # dispatch), and neither forward op again (mandatory: saved, never recomputed)
            assert (fwd, bwd) == ([1, 1, 0, 0], [0, 0, 1, 1]), mode
            assert calls == [one_step] * 4, mode


def _model_worker(rank, world):
    """The reference model (tiny: DSA, MTP, 2 intra-layer micro-batches) with DeepEP, EP=2 + FSDP2 and
    selective AC, compiled through parallelize vs the same eager: loss and gradients bitwise."""
    from spartron.layers.model import build_model
    from spartron.layers.parallelize import parallelize
    from spartron.parallel.dims import ParallelDims
    from spartron.parallel.groups import ParallelGroups
    from spartron.runtime.config import load_config

    cfg = load_config("configs/tiny.toml", [
        "train.seq_len=32", "model.n_layers=2", "model.mtp.depth=1", "parallel.ep=2", 'model.moe.dispatcher="deepep"',
        'model.dtype="bfloat16"', "model.moe.deepep_num_sms=8", "ac.mode=selective", "ac.reentrant=false",
        "train.micro_batch_size=2", "train.intra_layer_micro_batches=2", "train.compile=true",
        "train.compile_backend=aot_eager"])
    groups = ParallelGroups.build(ParallelDims(world, fsdp=2, ep=2), "cpu")
    torch._dynamo.reset()
    models = []
    for backend in (None, "aot_eager"):
        transport = EPTransport(groups.ep, deepep_library=deepep_emulator)
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
def test_compiled_model_with_deepep_ep2_fsdp2_matches_eager():
    # 3 graphs, as with all_to_all (tests/test_compile_ac.py): dense layer, MoE layer with 2 micro-batches, MTP block
    assert run_distributed(_model_worker, 2, timeout=600) == [(0, 3)] * 2
