"""torch.compile with every AC mode on the real model (tiny preset, 2 layers + 1 MTP depth, DSA source
and consumer, MoE): the same loss and gradients as eager, bitwise; fullgraph blocks (no graph break,
no recompile when the MoE split sizes change); the compiled backward graph never contains a
mandatory op (routing top-k, telemetry, a reused DSA result), so none runs twice."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

from spartron.layers.model import build_model
from spartron.layers.parallelize import parallelize
from spartron.runtime.config import load_config
from spartron.testing import run_distributed

SEQ = 32
MANDATORY_IN_GRAPH = ("spartron.moe_topk", "spartron.record_routing_stats", "spartron_ac.reused")


def small(*overrides: str):
    return load_config("configs/tiny.toml", [f"train.seq_len={SEQ}", "model.n_layers=2", "model.mtp.depth=1",
                                             *overrides])


def batch(cfg, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.model.vocab_size, (n, SEQ), generator=g),
            torch.randint(0, cfg.model.vocab_size, (n, SEQ), generator=g))


class Recorder:
    """aot_eager that keeps the forward and backward graphs it was given."""

    def __init__(self) -> None:
        self.graphs: dict[str, list[torch.fx.GraphModule]] = {"forward": [], "backward": []}
        self.backend = aot_autograd(fw_compiler=self._keep("forward"), bw_compiler=self._keep("backward"))

    def _keep(self, kind: str):
        from functorch.compile import make_boxed_func

        def compiler(gm, example_inputs):
            self.graphs[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    def count(self, kind: str, name: str) -> int:
        """Calls of op `name` in the graphs of `kind`, functionalized mutations included."""
        return sum(name in str(n.target) or any(name in str(a) for a in n.args)
                   for gm in self.graphs[kind] for n in gm.graph.nodes if n.op == "call_function")


def _compiled_and_eager(cfg, backend, steps: int = 2, n: int = 2, groups=None):
    eager, compiled = build_model(cfg.model, groups), build_model(cfg.model, groups)
    parallelize(eager, groups, cfg.ac)
    parallelize(compiled, groups, cfg.ac, compile_backend=backend)
    for step in range(steps):  # a second batch routes differently: new split sizes, same graphs
        data = batch(cfg, n, seed=step)
        want, got = eager(*data)["loss"], compiled(*data)["loss"]
        want.backward()
        got.backward()
        assert torch.equal(want, got), (step, want.item(), got.item())
        for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
            assert (a.grad is None) == (b.grad is None), name
            if a.grad is not None:
                assert torch.equal(a.grad, b.grad), (step, name, (a.grad - b.grad).abs().max().item())
    for a, b in zip(eager.buffers(), compiled.buffers(), strict=True):  # routing counts added once per forward
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", [pytest.param("none", marks=pytest.mark.slow),
                                  pytest.param("full", marks=pytest.mark.slow), "selective"])
def test_compiled_blocks_match_eager_bitwise_with_no_graph_break_and_no_recompile(mode):
    cfg = small(f"ac.mode={mode}", *(["ac.reentrant=false"] if mode != "none" else []),
                "train.compile=true", "train.compile_backend=aot_eager")
    rec = Recorder()
    counters.clear()
    _compiled_and_eager(cfg, rec.backend)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # one graph per block (dense layer 0, MoE layer 1, the MTP block), traced once for both steps
    assert counters["stats"]["unique_graphs"] == 3
    assert len(rec.graphs["forward"]) == len(rec.graphs["backward"]) == 3
    # mandatory ops run in forward only: the two MoE blocks route once each, the DSA source (layer 0)
    # and the MTP block's indexer hand over a reused top-k
    assert [rec.count("forward", op) for op in MANDATORY_IN_GRAPH] == [2, 2, 2]
    assert [rec.count("backward", op) for op in MANDATORY_IN_GRAPH] == [0, 0, 0]
    mm_backward = rec.count("backward", "aten.mm")
    # full AC recomputes the forward matmuls in backward, selective saves them like no AC does
    # the policy table in the compiled graph: full AC recomputes the forward matmuls in backward
    # (144 gradient matmuls + 69 recomputed), selective saves them like no AC does; both recompute
    # the norms and activations that no AC saves
    assert (mm_backward, rec.count("backward", "rsqrt"), rec.count("backward", "silu")) == \
        {"none": (144, 12, 75), "full": (213, 48, 113), "selective": (144, 48, 113)}[mode]


def test_compile_with_a_reentrant_region_is_refused_naming_the_fix():
    from spartron.checkpointing import ACConfig, apply_activation_checkpointing, compile_block

    block = apply_activation_checkpointing(torch.nn.Linear(2, 2), ACConfig(mode="full"), name="block 0")
    with pytest.raises(ValueError, match=r"^checkpoint region 'block 0': a reentrant region cannot be compiled .*"
                                         r"use a non-reentrant region \(ac.reentrant = false\)$"):
        compile_block(block, "aot_eager")
