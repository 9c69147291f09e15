"""torch.compile with every AC mode on the real model (tiny preset, 2 layers + 1 MTP depth, DSA source
and consumer, MoE): the same loss and gradients as eager, bitwise; fullgraph blocks (no graph break,
no recompile when the MoE split sizes change, blocks of one kind share a graph); the compiled
backward graph never contains a mandatory op (routing top-k, telemetry, a reused DSA result), so
none runs twice."""

from __future__ import annotations

import contextlib
import shutil

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

from spartron.layers.model import build_model
from spartron.layers.parallelize import parallelize
from spartron.runtime.config import load_config
from spartron.runtime.preflight import inductor_compilers
from spartron.testing import run_distributed

SEQ = 32
MANDATORY_IN_GRAPH = ("spartron.moe_topk", "spartron.record_routing_stats", "spartron_ac.reused")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test builds its own models: dynamo's caches (per code object) start empty for each."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


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


def _compiled_and_eager(cfg, backend, steps: int = 2, n: int = 2, groups=None, model_cfg=None):
    model_cfg = model_cfg or cfg.model
    eager, compiled = build_model(model_cfg, groups), build_model(model_cfg, groups)
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
    _check_compiled_blocks(cfg, mode)


def test_twelve_layers_share_their_graphs_below_dynamos_recompile_limit():
    # blocks of one kind have one type and one compiled callable: 12 layers (> the recompile limit
    # of 8) compile 3 graphs (dense layer 0, DSA-source MoE layers, DSA-consumer MoE layers)
    cfg = small("ac.mode=full", "ac.reentrant=false", "model.n_layers=12", "model.mtp.depth=0",
                "train.compile=true", "train.compile_backend=aot_eager")
    counters.clear()
    model = build_model(cfg.model)
    parallelize(model, None, cfg.ac, compile_backend="aot_eager")
    model(*batch(cfg, 2, seed=0))["loss"].backward()
    assert counters["stats"]["unique_graphs"] == 3 and sum(counters["graph_break"].values()) == 0
    assert len({type(layer) for layer in model.layers.values()}) == 1
    with torch.no_grad():  # evaluation runs compiled too: one no-grad graph per kind, not eager
        model(*batch(cfg, 2, seed=1))
    assert counters["stats"]["unique_graphs"] == 6 and sum(counters["graph_break"].values()) == 0


def _check_compiled_blocks(cfg, mode):
    rec = Recorder()
    counters.clear()
    _compiled_and_eager(cfg, rec.backend)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # one graph per kind of block, traced once for both steps: dense layer 0 (no DSA: model.dsa.layers is
    # "moe"), and one MoE DSA-source graph that layer 1 and the MTP block (depth 1 of 1) share
    assert counters["stats"]["unique_graphs"] == 2
    assert len(rec.graphs["forward"]) == len(rec.graphs["backward"]) == 2
    # mandatory ops run in forward only: the MoE graph routes once, the source hands over a reused top-k
    assert [rec.count("forward", op) for op in MANDATORY_IN_GRAPH] == [1, 1, 1]
    assert [rec.count("backward", op) for op in MANDATORY_IN_GRAPH] == [0, 0, 0]
    mm_backward = rec.count("backward", "aten.mm")
    # the policy table in the compiled graph: full AC recomputes the forward matmuls in backward
    # (80 gradient matmuls + 38 recomputed), selective saves them like no AC does; both recompute
    # the norms and activations that no AC saves (silu: w2's weight gradient recomputes silu(gate) in every
    # mode; the FFNs' swiglu gradients run inside the opaque spartron::swiglu_backward_, one call in each of the
    # two backward graphs: spartron.layers.swiglu)
    assert (mm_backward, rec.count("backward", "rsqrt"), rec.count("backward", "silu"),
            rec.count("backward", "swiglu_backward_")) == \
        {"none": (80, 8, 32, 2), "full": (118, 32, 52, 2), "selective": (80, 32, 52, 2)}[mode]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_dense_mla_compiled_matches_eager_bitwise(mode):
    cfg = small(f"ac.mode={mode}", "ac.reentrant=false", "train.compile=true", "train.compile_backend=aot_eager")
    counters.clear()
    _compiled_and_eager(cfg, "aot_eager", model_cfg=cfg.model.model_copy(update={"dsa": None}))
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] == 2


def test_query_chunked_dsa_with_kl_sparse_compiled_matches_eager_bitwise():
    """model.dsa.attention_chunk (spartron::sparse_mla_absorbed, chunks of 11 rows ending mid-sequence) with the
    indexer trained by kl_sparse under selective AC: compiled (aot_eager) loss and gradients equal eager's
    bitwise, no graph break; the op and its backward are in the graphs, opaque."""
    cfg = small("ac.mode=selective", "ac.reentrant=false", "model.dsa.indexer_mode=kl_sparse",
                "model.dsa.indexer_loss_coeff=0.5", "model.dsa.attention_chunk=11", "train.compile=true",
                "train.compile_backend=aot_eager")
    rec = Recorder()
    counters.clear()
    _compiled_and_eager(cfg, rec.backend)
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] == 2
    assert rec.count("forward", "spartron.sparse_mla_absorbed.") == 1
    assert rec.count("backward", "spartron.sparse_mla_absorbed_backward") == 1


def test_compile_with_a_reentrant_region_is_refused_naming_the_fix():
    from spartron.checkpointing import ACConfig, apply_activation_checkpointing, compile_block

    block = apply_activation_checkpointing(torch.nn.Linear(2, 2), ACConfig(mode="full"), name="block 0")
    with pytest.raises(ValueError, match=r"^checkpoint region 'block 0': a reentrant region cannot be compiled .*"
                                         r"use a non-reentrant region \(ac.reentrant = false\)$"):
        compile_block(block, "aot_eager")


def _everything_worker(rank, world, ac_mode, backend, *extra):
    """Offload + AC + 2 intra-layer micro-batches + FSDP2 + EP=2 over gloo all-to-all + DSA reuse,
    compiled vs the same eager, bitwise, on each of two ranks."""
    from spartron.checkpointing.offload import ActivationOffloader
    from spartron.parallel.dims import ParallelDims
    from spartron.parallel.groups import ParallelGroups

    ac = [f"ac.mode={ac_mode}", "ac.reentrant=false", "offload.enabled=true", "offload.what=inputs_and_dsa_ids"]
    cfg = small("train.micro_batch_size=2", "parallel.ep=2", *(ac if ac_mode != "none" else ["ac.mode=none"]),
                "train.intra_layer_micro_batches=2", "train.compile=true", f"train.compile_backend={backend}", *extra)
    groups = ParallelGroups.build(ParallelDims(world, fsdp=2, ep=2), "cpu")
    models = []
    for compile_backend in (None, backend):
        torch.manual_seed(0)
        model = build_model(cfg.model, groups, micro_batches=2)
        models.append(parallelize(model, groups, cfg.ac, compile_backend=compile_backend))
    counters.clear()
    seen = []
    for step in range(2):
        seen.append((sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]))
        tokens, labels = batch(cfg, 2, seed=10 * step + rank)
        losses = []
        for model in models:
            offloader = ActivationOffloader.for_model(model, cfg.offload, "cpu") if ac_mode != "none" else None
            with offloader.session() if offloader is not None else contextlib.nullcontext() as session:
                loss = model(tokens, labels)["loss"]
                loss.backward()
            assert session is None or session.stats.offloaded_tensors > 0
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), (step, losses)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        if a.grad is not None:
            assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor()), name
    groups.destroy()
    seen.append((sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]))
    reasons = {k.split("\n")[0] for k in counters["graph_break"]}
    return seen, reasons


@pytest.mark.slow
@pytest.mark.parametrize("ac_mode", ["none", "full", "selective"])
def test_compiled_ep2_fsdp2_micro_batches_on_two_gloo_ranks_match_eager(ac_mode):
    # FSDP2's hooks of the separately sharded experts run on the block, outside the graph: no break,
    # 3 graphs (dense layer, MoE layer with 2 micro-batches, MTP block), none added in step 2
    want = ([(0, 0), (0, 3), (0, 3)], set())
    assert run_distributed(_everything_worker, 2, ac_mode, "aot_eager", timeout=600) == [want] * 2


@pytest.mark.slow
def test_compiled_weight_shared_mtp_block_run_twice_under_fsdp2_matches_eager():
    # the MTP block runs for 2 depths per step (its experts' hooks, now on the block, run twice); its
    # second depth is a DSA consumer of the first depth's ids (model.dsa.share_indexer_across_mtp), a
    # different program: one more graph (spartron.layers.mtp.MTP; the test at the end of this file)
    want = ([(0, 0), (0, 4), (0, 4)], set())
    assert run_distributed(_everything_worker, 2, "full", "aot_eager", "model.mtp.depth=2", timeout=600) == [want] * 2


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["layer", "experts"])
def test_compiled_full_ac_with_offload_and_two_micro_batches_matches_eager(scope):
    from spartron.checkpointing.offload import ActivationOffloader

    cfg = small("ac.mode=full", "ac.reentrant=false", "offload.enabled=true", "offload.what=inputs_and_dsa_ids",
                "train.micro_batch_size=2", "train.intra_layer_micro_batches=2",
                f"train.intra_layer_micro_batch_scope={scope}", "train.compile=true", "train.compile_backend=aot_eager")
    models = []
    for backend in (None, "aot_eager"):
        model = build_model(cfg.model, micro_batches=2, micro_batch_scope=scope)
        models.append(parallelize(model, None, cfg.ac, compile_backend=backend))
    counters.clear()
    for step in range(2):
        data = batch(cfg, 2, seed=step)
        results = []
        for model in models:
            with ActivationOffloader.for_model(model, cfg.offload, "cpu").session() as session:
                loss = model(*data)["loss"]
                loss.backward()
            results.append((loss.detach(), session.stats.offloaded_tensors))
        assert torch.equal(results[0][0], results[1][0]), (step, results)
        assert results[0][1] > 0 and results[1][1] > 0  # both offload (the compiled graph saves other tensors)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad), name
    # scope "layer": the stack's blocks take lists of micro-batches, the MTP block one tensor: 3 graphs
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == {"layer": 3, "experts": 2}[scope]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: inductor on the GPU in bf16")
@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_cuda_bf16_compiled_blocks_match_eager(mode):
    """The same parity on the GPU (inductor, bf16, dense MLA + MoE, grouped GEMM). Inductor's fusions
    round differently from eager, so both bf16 runs are held to an fp32 eager run of the same seed:
    compiled may be off from it by at most twice eager's error (on the H200 the router's gradient, a
    sum with heavy cancellation, differed by 7% between the two bf16 runs)."""
    base = ["model.n_layers=3", "model.dim=512", "model.n_heads=4", "model.vocab_size=4096",
            "model.dense_inter_dim=1024", "model.moe.n_routed_experts=16", "model.moe.top_k=4",
            "model.moe.moe_inter_dim=256", "model.max_seq_len=1024",
            "train.seq_len=1024", f"ac.mode={mode}", *(["ac.reentrant=false"] if mode != "none" else []),
            "train.compile=true"]
    results = []
    for dtype, backend in (("float32", None), ("bfloat16", None), ("bfloat16", "inductor")):
        cfg = load_config("configs/dsv3-12l.toml", [*base, f"model.dtype={dtype}"])
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = build_model(cfg.model)
        parallelize(model, None, cfg.ac, compile_backend=backend)
        counters.clear()
        for step in range(2):
            g = torch.Generator(device="cuda").manual_seed(step)
            tokens = torch.randint(0, cfg.model.vocab_size, (2, 1024), device="cuda", generator=g)
            labels = torch.randint(0, cfg.model.vocab_size, (2, 1024), device="cuda", generator=g)
            model.zero_grad(set_to_none=True)
            loss = model(tokens, labels)["loss"]
            loss.backward()
        results.append((loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}))
        if backend is not None:
            assert sum(counters["graph_break"].values()) == 0
    (ref_loss, ref), (eager_loss, eager), (loss, got) = results
    assert abs(loss - ref_loss) <= 2 * abs(eager_loss - ref_loss) + 1e-2 * abs(ref_loss)
    assert set(got) == set(eager) == set(ref)

    def error(g, name):
        return ((g - ref[name]).norm() / ref[name].norm().clamp(min=1e-12)).item()

    for name, g in got.items():
        assert torch.isfinite(g).all(), name
        compiled_err, eager_err = error(g, name), error(eager[name], name)
        assert compiled_err <= 2 * eager_err + 1e-2, \
            f"{name}: compiled bf16 is {compiled_err:.3g} from fp32, eager bf16 {eager_err:.3g}"


@pytest.mark.slow
@pytest.mark.skipif(not any(shutil.which(c) for c in inductor_compilers()),
                    reason="inductor on CPU needs a C++ compiler")
def test_inductor_on_cpu_with_selective_ac_matches_eager():
    # one MoE block with a DSA source (one graph): inductor's C++ build dominates the time
    cfg = small("ac.mode=selective", "ac.reentrant=false", "train.compile=true", "model.n_layers=1",
                "model.first_k_dense=0", "model.mtp.depth=0")
    eager, compiled = build_model(cfg.model), build_model(cfg.model)
    parallelize(eager, None, cfg.ac)
    parallelize(compiled, None, cfg.ac, compile_backend="inductor")
    data = batch(cfg, 2, seed=0)
    want, got = eager(*data)["loss"], compiled(*data)["loss"]
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # fused kernels: fp32 rounding, not bitwise
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("share_indexer", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_weight_shared_mtp_block_compiles_one_graph_per_dsa_role(share_indexer):
    # 2 layers (dense, MoE DSA source) + one shared MTP block for 2 depths: depth 1 is a DSA source like
    # layer 1 (their graph is shared); depth 2 consumes depth 1's ids when the indexer is shared across
    # MTP depths (no indexer run: a third graph), else it is a source too (no new graph)
    cfg = small("ac.mode=full", "ac.reentrant=false", "model.mtp.depth=2",
                f"model.dsa.share_indexer_across_mtp={str(share_indexer).lower()}",
                "train.compile=true", "train.compile_backend=aot_eager")
    counters.clear()
    model = build_model(cfg.model)
    parallelize(model, None, cfg.ac, compile_backend="aot_eager")
    model(*batch(cfg, 2, seed=0))["loss"].backward()
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == (3 if share_indexer else 2)
