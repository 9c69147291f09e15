"""Intra-layer micro-batches: the interleaved order of phases, the phases of a block computing its
forward, parity of loss and grads with 1 micro-batch (plain, under AC, with EP=2 on gloo), the region
receiving a PyTree of micro-batches, and errors."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import spartron.layers.overlap as overlap
from spartron.checkpointing import ACConfig, apply_activation_checkpointing, checkpoint_region_of
from spartron.comm.transport import EPTransport
from spartron.layers.decoder import DecoderLayer, LayerInput
from spartron.layers.model import build_model
from spartron.layers.moe import MoELayer
from spartron.layers.overlap import Phase, interleave, merge_micro_batches, run_interleaved, split_micro_batches
from spartron.runtime.config import load_config
from spartron.testing import run_distributed

SEQ = 32


def tiny(*overrides: str):
    return load_config("configs/tiny.toml", [f"train.seq_len={SEQ}", "model.moe.aux_loss_coeff=0.01", *overrides])


def batch(cfg, n: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg.model.vocab_size, (n, SEQ), generator=g),
            torch.randint(0, cfg.model.vocab_size, (n, SEQ), generator=g))


def _logged(mb: int, names: list[str], log: list[str]) -> tuple[list[Phase], None]:
    """A layer as phases: "attn" first (it returns mb * 10), then one phase per name passing it on."""
    def first(_):
        log.append(f"attn{mb}")
        return mb * 10

    def phase(name):
        def run(state):
            log.append(f"{name}{mb}")
            return state
        return Phase(run, comm=name in ("dispatch", "combine"))

    return [Phase(first), *[phase(name) for name in names]], None


def test_round_robin_interleaves_phases_and_follows_each_comm_phase_with_its_compute_phase():
    log = []
    moe = ["dispatch", "experts", "combine", "finalize"]
    assert interleave([_logged(0, moe, log), _logged(1, moe, log)]) == [0, 10]
    # dispatch mb1 (which may block the host) is issued after mb0's experts, so they run under it
    assert log == ["attn0", "attn1", "dispatch0", "experts0", "dispatch1", "experts1", "combine0", "finalize0",
                   "combine1", "finalize1"]
    log.clear()  # compute phases alone alternate one phase per turn
    assert interleave([_logged(0, ["a", "b"], log), _logged(1, ["a", "b"], log)]) == [0, 10]
    assert log == ["attn0", "attn1", "a0", "a1", "b0", "b1"]
    log.clear()  # a comm phase followed by another comm phase ends the turn; three micro-batches
    assert interleave([_logged(i, ["dispatch", "combine", "experts"], log) for i in range(3)]) == [0, 10, 20]
    assert log == ["attn0", "attn1", "attn2", "dispatch0", "dispatch1", "dispatch2", "combine0", "experts0",
                   "combine1", "experts1", "combine2", "experts2"]
    log.clear()
    assert interleave([_logged(0, ["dispatch", "experts"], log)]) == [0] and log == ["attn0", "dispatch0", "experts0"]
    log.clear()  # a plan of one phase (a dense layer) finishes in the first round
    assert interleave([_logged(0, [], log), _logged(1, ["experts"], log)]) == [0, 10]
    assert log == ["attn0", "attn1", "experts1"]
    log.clear()  # plans that begin with a comm phase (the chunks of scope "experts") after a one-phase plan
    def logs(name):
        return lambda c: log.append(f"{name}{c}") or c

    chunk = [Phase(logs("dispatch"), comm=True), Phase(logs("experts")), Phase(logs("combine"), comm=True),
             Phase(logs("finalize"))]
    shared = [Phase(lambda t: log.append("shared") or t * 2)]
    assert interleave([(shared, 21), (chunk, 0), (chunk, 1)]) == [42, 0, 1]
    assert log == ["shared", "dispatch0", "experts0", "dispatch1", "experts1", "combine0", "finalize0", "combine1",
                   "finalize1"]


def test_overlap_imports_no_layer():
    """The overlap plan knows the layers only through its protocol (Phased, InFlight)."""
    tree = ast.parse(Path(overlap.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported == {"__future__", "collections.abc", "typing", "torch"}


@pytest.mark.parametrize("layer_idx", [0, 1])  # tiny: layer 0 dense, layer 1 MoE
def test_a_blocks_phases_in_order_compute_its_forward_exactly(layer_idx):
    cfg = tiny()
    layer = DecoderLayer(cfg.model, layer_idx)
    x, positions = torch.randn(2, SEQ, cfg.model.dim), torch.arange(SEQ)
    plain = layer(x, positions)
    (phased,) = interleave([(layer.phases(), LayerInput(x, positions, None))])
    assert len(layer.phases()) == (5 if layer_idx else 1)
    assert [p.comm for p in layer.phases()] == ([False, True, False, True, False] if layer_idx else [False])
    assert plain.keys() == phased.keys()
    for key, value in plain.items():
        assert (value is None and phased[key] is None) or torch.equal(phased[key], value), key
    moe = layer.ffn if layer_idx else MoELayer(cfg.model)
    h = torch.randn(2, SEQ, cfg.model.dim)
    alone, (two,) = moe(h), run_interleaved(moe, [h])
    assert all(torch.equal(two[k], v) for k, v in alone.items() if v is not None)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _one_vs_micro_batched(cfg, ac_mode: str, n_seqs: int):
    """The model with 1 micro-batch vs the same model (same seed: same weights) built for cfg's
    micro-batches (AC per ac_mode) on the same batch: equal losses, expert counts, gradients and routing
    telemetry. Returns the micro-batched model and what its layer 2 (a DSA consumer) took and gave."""
    torch.manual_seed(0)
    one = build_model(cfg.model)
    two = build_model(cfg.model, micro_batches=cfg.train.intra_layer_micro_batches,
                      micro_batch_scope=cfg.train.intra_layer_micro_batch_scope)
    if ac_mode != "none":
        for layer in two.layers.values():
            apply_activation_checkpointing(layer, cfg.ac)
    seen = []
    two.layers["2"].register_forward_hook(lambda m, a, out: seen.append((a, out)))
    tokens, labels = batch(cfg, n=n_seqs)
    out1, out2 = one(tokens, labels), two(tokens, labels)
    out1["loss"].backward()
    out2["loss"].backward()
    for key in ("loss", "lm_loss", "aux_loss"):
        torch.testing.assert_close(out2[key], out1[key], rtol=1e-6, atol=1e-6)
    assert torch.equal(out2["tokens_per_expert"], out1["tokens_per_expert"])
    g1, g2 = _grads(one), _grads(two)
    assert g1.keys() == g2.keys()
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-5, atol=1e-7, msg=name)
    for moe1, moe2 in zip(one.moe_layers(), two.moe_layers(), strict=True):  # routing telemetry adds up once
        assert torch.equal(moe1.step_tokens_per_expert, moe2.step_tokens_per_expert)
    return two, seen


@pytest.mark.parametrize("ac_mode", ["none", "full", "selective"])
def test_two_micro_batches_match_one_loss_and_grads(ac_mode):
    cfg = tiny(f"ac.mode={ac_mode}", "train.intra_layer_micro_batches=2", "train.micro_batch_size=4")
    two, seen = _one_vs_micro_batched(cfg, ac_mode, n_seqs=4)
    # the region (layer 2, a DSA consumer) took lists: two hidden-state micro-batches and two id tensors
    args, out = seen[0]
    assert isinstance(args[0], list) and len(args[0]) == 2 and args[0][0].shape[0] == 2
    assert isinstance(out["hidden_states"], list) and isinstance(out["dsa_topk_ids"], list)
    if ac_mode != "none":
        assert checkpoint_region_of(two.layers["2"]).last_stats.replay_count == 1


@pytest.mark.parametrize("ac_mode", ["none", "selective"])
@pytest.mark.parametrize("aux_loss_type", ["seq", "batch"])
def test_experts_scope_matches_one_micro_batch_loss_and_grads(ac_mode, aux_loss_type):
    """Scope 'experts': regions take whole tensors; every MoE layer routes all tokens at once and
    interleaves chunks of its routed path (a batch-level balance loss stays exact, micro-batch size 1 works)."""
    cfg = tiny(f"ac.mode={ac_mode}", f"model.moe.aux_loss_type={aux_loss_type}", "train.micro_batch_size=1",
               "train.intra_layer_micro_batches=3", "train.intra_layer_micro_batch_scope=experts")
    two, seen = _one_vs_micro_batched(cfg, ac_mode, n_seqs=1)  # one sequence of 32 tokens: chunks of 11, 11, 10
    assert two.intra_layer_micro_batches == 1 and {m.micro_batches for m in two.moe_layers()} == {3}
    args, out = seen[0]
    assert isinstance(args[0], torch.Tensor) and isinstance(out["hidden_states"], torch.Tensor)


def test_experts_scope_errors():
    cfg = tiny().model
    with pytest.raises(ValueError, match=r"= 33 \(scope 'experts'\) needs at least 33 tokens per MoE layer call"):
        MoELayer(cfg, micro_batches=33)(torch.randn(1, 32, cfg.dim))
    with pytest.raises(ValueError, match=r"^train.intra_layer_micro_batches must be at least 1, got 0$"):
        MoELayer(cfg, micro_batches=0)
    # 5 tokens: chunks of 2, 1, 1, 1 (chunk() would make only 3); equal to one chunk (the same init: same names)
    x = torch.randn(1, 5, cfg.dim)
    many, one = MoELayer(cfg, micro_batches=4)(x), MoELayer(cfg)(x)
    torch.testing.assert_close(many["hidden_states"], one["hidden_states"], rtol=1e-6, atol=1e-6)
    assert torch.equal(many["tokens_per_expert"], one["tokens_per_expert"])


def test_build_model_refuses_a_transport_of_another_group():
    with pytest.raises(ValueError, match=r"^build_model: the transport's group is not the expert-parallel group"):
        build_model(tiny().model, transport=EPTransport(object()))


def _assert_grads_close(twin, layer):
    """twin's parameter gradients equal layer's (fp32 sums in another order: error relative to the
    largest entry of each gradient)."""
    twin_params = dict(twin.named_parameters())
    for name, p in layer.named_parameters():
        if p.grad is not None:
            scale = float(p.grad.abs().max())
            torch.testing.assert_close(twin_params[name].grad, p.grad, rtol=1e-5, atol=2e-6 * scale, msg=name)


def _ep_worker(rank, world):
    cfg = tiny("parallel.ep=2")
    torch.manual_seed(0)
    full = DecoderLayer(cfg.model, layer_idx=1)
    n_local = cfg.model.moe.n_routed_experts // 2
    state = {n: (t[rank * n_local:(rank + 1) * n_local] if ".experts." in n else t)
             for n, t in full.state_dict().items()}
    layer, twin = (DecoderLayer(cfg.model, 1, EPTransport(torch.distributed.group.WORLD)) for _ in "ab")
    layer.load_state_dict(state)
    twin.load_state_dict(state)
    apply_activation_checkpointing(twin, ACConfig(mode="selective"))
    torch.manual_seed(10 + rank)  # each rank its own tokens
    x = torch.randn(4, SEQ, cfg.model.dim)
    positions = torch.arange(SEQ)
    one = layer(x, positions)
    two = twin(split_micro_batches(x, 2), positions)
    h1, h2 = one["hidden_states"], merge_micro_batches(two["hidden_states"])
    torch.testing.assert_close(h2, h1, rtol=1e-6, atol=1e-6)
    assert torch.equal(two["tokens_per_expert"], one["tokens_per_expert"])
    w = torch.randn_like(h1)
    ((h1 * w).sum() + one["aux_loss"]).backward()
    ((h2 * w).sum() + two["aux_loss"]).backward()
    _assert_grads_close(twin, layer)
    return float(h1.sum())


def test_two_micro_batches_match_one_with_ep2_on_gloo():
    sums = run_distributed(_ep_worker, 2)
    assert sums[0] != sums[1]  # the ranks really ran different tokens through the exchange


class _OpLog(TorchDispatchMode):
    """Logs the prepare sorts and the all-to-alls of a forward, in issue order."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name == "aten.sort" or name.endswith("all_to_all"):
            self.log.append("sort" if name == "aten.sort" else "all_to_all")
        return func(*args, **(kwargs or {}))


def _ep_experts_scope_worker(rank, world):
    cfg = tiny("parallel.ep=2")
    torch.manual_seed(0)
    layer = DecoderLayer(cfg.model, 1, EPTransport(torch.distributed.group.WORLD))
    twin = DecoderLayer(cfg.model, 1, EPTransport(torch.distributed.group.WORLD), moe_micro_batches=2)
    twin.load_state_dict(layer.state_dict())
    torch.manual_seed(10 + rank)
    x = torch.randn(2, SEQ, cfg.model.dim)
    positions = torch.arange(SEQ)
    log = []
    twin.ffn.shared_experts.register_forward_pre_hook(lambda m, a: log.append("shared"))
    with _OpLog(log), torch.no_grad():
        twin(x, positions)
    # both chunks' prepare sorts and the whole shared experts come before the first exchange; then ONE
    # count all-to-all for both chunks; each chunk: tokens all-to-all, a post-dispatch sort (experts);
    # then the two combines
    assert log == ["sort", "sort", "shared", "all_to_all", "all_to_all", "sort", "all_to_all", "sort",
                   "all_to_all", "all_to_all"], log
    apply_activation_checkpointing(twin, ACConfig(mode="selective"))
    one, two = layer(x, positions), twin(x, positions)
    torch.testing.assert_close(two["hidden_states"], one["hidden_states"], rtol=1e-6, atol=1e-6)
    assert torch.equal(two["tokens_per_expert"], one["tokens_per_expert"])
    w = torch.randn_like(x)
    ((one["hidden_states"] * w).sum() + one["aux_loss"]).backward()
    ((two["hidden_states"] * w).sum() + two["aux_loss"]).backward()
    _assert_grads_close(twin, layer)
    return log.count("all_to_all")


def test_experts_scope_with_ep2_on_gloo_orders_shared_experts_before_one_count_exchange():
    # one count exchange for both chunks + 2 chunks x (token all-to-all + combine all-to-all)
    assert run_distributed(_ep_experts_scope_worker, 2) == [5, 5]


def test_micro_batch_errors_name_the_keys():
    # the rules live in the run config (refused at load); the model takes what it is built with
    with pytest.raises(ValueError, match=r"train.intra_layer_micro_batches = 3 must divide train.micro_batch_size"):
        tiny("train.intra_layer_micro_batches=3", "train.micro_batch_size=4")
    with pytest.raises(ValueError, match="needs model.moe.aux_loss_type = 'seq'"):
        tiny("train.intra_layer_micro_batches=2", "train.micro_batch_size=2", "model.moe.aux_loss_type=batch")
    with pytest.raises(ValueError, match="must divide the per-forward batch"):
        split_micro_batches(torch.zeros(3, 4), 2)


@dataclass
class _Rows:
    """A state handing `h` across streams (spartron.layers.overlap.InFlight)."""

    h: torch.Tensor

    def in_flight(self):
        return (self.h,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: comm phases on per-micro-batch side streams")
def test_comm_phases_run_on_their_own_micro_batch_stream_and_results_match_a_plain_run():
    device = torch.device("cuda", torch.cuda.current_device())
    compute = torch.cuda.current_stream(device)
    streams: dict[str, object] = {}

    def layer(mb: int):
        def attn(x):
            return _Rows((x * (mb + 2)).sin())  # compute

        def dispatch(s):
            streams[f"dispatch{mb}"] = torch.cuda.current_stream(device)
            torch.cuda._sleep(2_000_000)  # a slow "collective": the compute stream must not wait for it here
            return _Rows(s.h.flip(0) + 1)

        def experts(s):
            streams[f"experts{mb}"] = torch.cuda.current_stream(device)
            return _Rows(s.h @ s.h.T)

        def combine(s):
            streams[f"combine{mb}"] = torch.cuda.current_stream(device)
            return s.h.cos().sum(0)

        return [Phase(attn), Phase(dispatch, comm=True), Phase(experts), Phase(combine, comm=True)]

    xs = [torch.randn(256, 256, device=device) for _ in range(2)]
    expected = []
    for i, x in enumerate(xs):
        state = x
        for phase in layer(i):
            state = phase.run(state)
        expected.append(state)
    got = interleave([(layer(i), x) for i, x in enumerate(xs)], device=device)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)  # the results are usable on the compute stream right away
    assert streams["experts0"] == compute and streams["experts1"] == compute
    assert streams["dispatch0"] != compute and streams["dispatch1"] != compute
    assert streams["dispatch0"] != streams["dispatch1"]  # one comm stream per micro-batch
    assert streams["combine0"] == streams["dispatch0"] and streams["combine1"] == streams["dispatch1"]
    # a plan that begins with a comm phase waits for what the compute stream had queued when it began
    first = interleave([([Phase(lambda x: x + 1, comm=True)], x) for x in xs], device=device)
    assert all(torch.equal(f, x + 1) for f, x in zip(first, xs, strict=True))


def test_experts_scope_chunks_split_like_tensor_split_with_one_backward_node():
    from spartron.layers.moe.layer import even_split_sizes

    for rows in range(0, 12):
        for n in (1, 2, 3, 5):
            assert even_split_sizes(rows, n) == [t.shape[0] for t in torch.empty(rows).tensor_split(n)], (rows, n)
    x = torch.randn(7, 3, requires_grad=True)
    pieces = x.split(even_split_sizes(7, 2))
    # one node for all pieces: their gradients land in one tensor, no zero-filled full-size copy per piece
    assert {type(p.grad_fn).__name__ for p in pieces} == {"SplitWithSizesBackward0"}
