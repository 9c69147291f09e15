"""Several compiled models in one process: each compiles its own graphs.

Dynamo keeps compiled graphs per code object and does not guard the selective-checkpoint policy, so
regions sharing one code object would let a selective-AC model run a full-AC model's graphs (same
numbers, other memory and time: seen on the H200 as selective timing like full) and a few models
would exceed the recompile limit."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd

from spartron.layers.model import build_model
from spartron.layers.parallelize import parallelize
from spartron.runtime.config import load_config

SEQ = 32


class BackwardGraphs:
    """aot_eager that keeps the backward graphs it compiles."""

    def __init__(self) -> None:
        from functorch.compile import make_boxed_func

        self.graphs: list[torch.fx.GraphModule] = []

        def keep(gm, example_inputs):
            self.graphs.append(gm)
            return make_boxed_func(gm.forward)

        self.backend = aot_autograd(fw_compiler=lambda gm, ex: make_boxed_func(gm.forward), bw_compiler=keep)


def _step(mode: str, backend, targets: str | None = None) -> None:
    cfg = load_config("configs/tiny.toml", [f"train.seq_len={SEQ}", "model.n_layers=2", f"ac.mode={mode}",
                                            "ac.reentrant=false", "train.compile=true",
                                            *([f"ac.targets={targets}"] if targets else [])])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    parallelize(model, None, cfg.ac, compile_backend=backend)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, SEQ), generator=g)
    model(tokens, tokens)["loss"].backward()


def _mm(graphs) -> int:
    return sum(str(g.code).count("aten.mm") for g in graphs)


@pytest.mark.slow
def test_each_model_compiles_its_own_graphs_under_its_own_policy():
    """Three models (before the fix the second ran the first's graphs, and the third hit dynamo's
    recompile limit under fullgraph)."""
    torch._dynamo.reset()
    rec = BackwardGraphs()
    _step("full", rec.backend)
    full = list(rec.graphs)
    _step("selective", rec.backend)
    selective = rec.graphs[len(full):]
    _step("selective", rec.backend, targets='["aten::addmm"]')
    addmm_only = rec.graphs[len(full) + len(selective):]
    torch._dynamo.reset()
    assert full and selective and addmm_only
    # full AC recomputes the forward's matmuls in backward; selective (matmuls saved) does not
    assert _mm(selective) < _mm(full), (_mm(selective), _mm(full))
    assert _mm(selective) < _mm(addmm_only) == _mm(full)
