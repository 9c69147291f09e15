"""DeepEP dispatcher: install error, op fake impls, policy, buffer sizing, EP=2 parity with all_to_all.

CPU: the parity worker runs on gloo with `deepep_emulator` (a test double of DeepEP's intranode
Buffer with the same handle layout), so the ops, their autograd, the handle lifetime and the
checkpoint replay run for real; only DeepEP's kernels are replaced. GPU (marked `gpu`): the same
worker on 2 CUDA ranks with NCCL and the real `deep_ep`.
"""

from __future__ import annotations

import importlib.util
import sys

import deepep_emulator  # test double of DeepEP, next to this file (tests/layers/moe)
import pytest
import torch
import torch._dynamo  # noqa: F401  (custom ops import it lazily: 4 s in every forked rank otherwise)
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.multiprocessing.reductions import StorageWeakRef

from spartron.checkpointing import ACConfig, apply_activation_checkpointing, build_policy, checkpoint
from spartron.comm import deepep as deepep_ops
from spartron.comm.deepep_buffer import DeepEPBuffer, DeepEPBufferRef, check_deepep_shape, nvl_buffer_bytes
from spartron.comm.transport import EPTransport
from spartron.layers.config import ModelConfig
from spartron.layers.moe import MoELayer, build_dispatcher
from spartron.layers.moe.dispatch import DeepEPDispatcher
from spartron.layers.overlap import run_interleaved
from spartron.testing import run_distributed

DIM, TOKENS_PER_SEQ, BATCH = 64, 8, 4


def model_cfg(dispatcher: str, dim: int = DIM, **moe) -> ModelConfig:
    base = {"n_routed_experts": 8, "n_shared_experts": 1, "top_k": 3, "moe_inter_dim": 32,
            "score_func": "sigmoid", "dispatcher": dispatcher, "deepep_num_sms": 8,
            "bias_update_rate": 0.01}
    base.update(moe)
    return ModelConfig.model_validate({"dim": dim, "init_std": 0.3, "dtype": "bfloat16", "moe": base})


# --------------------------------------------------------------------------------------------
# CPU: selection error, fake impls, policy, sizing
# --------------------------------------------------------------------------------------------

def test_missing_deep_ep_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # makes `import deep_ep` fail on any machine
    with pytest.raises(ValueError) as err:
        MoELayer(model_cfg("deepep"))
    text = str(err.value)
    assert text.startswith("model.moe.dispatcher = 'deepep' needs DeepEP, which is not importable here")
    assert "DeepEP v1.2.1 from source, intranode only" in text
    assert "pip install --no-build-isolation ." in text and "PyPI 'deep-ep' 1.0.0 sdist does not work" in text
    with pytest.raises(ValueError, match="needs DeepEP"):
        build_dispatcher(model_cfg("deepep").moe, None)


def test_deepep_needs_an_intranode_ep_group():
    cfg = model_cfg("deepep").moe
    with pytest.raises(ValueError, match=r"EP group of 2, 4 or 8 ranks; parallel.ep is 1 \(use 'all_to_all'\)"):
        DeepEPDispatcher(cfg, EPTransport(None, deepep_library=deepep_emulator), None)


@pytest.mark.parametrize(("args", "message"), [
    ((8, 2, 3, 8), "EP group of 2, 4 or 8 ranks; parallel.ep is 3"),
    ((8, 2, 2, 7), "model.moe.deepep_num_sms must be even"),
    ((64, 33, 2, 8), "supports model.moe.top_k <= 32, got 33"),
    ((4096, 2, 2, 8), "at most 1024 experts per rank"),
    ((8, 2, 2, 8, 100), "model.dim 100 x 2 bytes"),
])
def test_shape_limits(args, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_deepep_shape(*args)


def test_nvl_buffer_sizing_matches_deepep_hint():
    # DeepEP v1.2.1 Config.get_nvl_buffer_size_hint (no NVSHMEM): channels * ranks * 5 ints of queue
    # state + channels * ranks * recv_tokens * (hidden bytes + 128 top-k ids/weights + 128 scales).
    # hidden 2048, EP 2, 24 SMs: 12 * 2 * 20 + 12 * 2 * 256 * (4096 + 1024 + 512 + 512) -> 128-aligned
    assert nvl_buffer_bytes(2048, 2, 24) == 37_749_248
    # hidden 7168, EP 8, 20 SMs: 1600 + 80 * 256 * 16384 = 335_545_920, rounded up to 128 bytes
    assert nvl_buffer_bytes(7168, 8, 20) == 335_545_984
    hint = deepep_emulator.Config(24, 24, 256, 6, 128).get_nvl_buffer_size_hint(4096, 2)
    assert nvl_buffer_bytes(2048, 2, 24) == hint  # the double sizes like DeepEP too


def test_fake_impls_give_deepep_shapes():
    ref = DeepEPBufferRef(None)  # the fake impls never read the buffer
    with FakeTensorMode(shape_env=ShapeEnv()):
        x = torch.empty(10, 64, dtype=torch.bfloat16)
        idx = torch.empty(10, 4, dtype=torch.int64)
        w = torch.empty(10, 4, dtype=torch.float32)
        out = torch.ops.spartron_deepep.dispatch(ref, x, None, None, idx, w, 16, 2, 24)
        q, s = torch.empty(10, 64, dtype=torch.float8_e4m3fn), torch.empty(1, 10).t()  # FP8 rows: recv_x in x's dtype
        fp8 = torch.ops.spartron_deepep.dispatch(ref, x, q, s, idx, w, 16, 2, 24)
        assert fp8[0].dtype == torch.bfloat16 and fp8[0].shape[1] == 64
        recv = out[0].shape[0]
        assert isinstance(recv, torch.SymInt)  # data-dependent: decided by the exchange
        got = [(tuple(o.shape), o.dtype) for o in out]
        assert got == [((recv, 64), torch.bfloat16), ((recv, 4), torch.int64), ((recv, 4), torch.float32),
                       ((8,), torch.int64), ((2, 2), torch.int32), ((2, 12), torch.int32),
                       ((2, 12), torch.int32), ((recv,), torch.int32), ((10, 2), torch.bool),
                       ((10, 2), torch.int32)]
        assert out[3].device.type == "cpu"  # rows per local expert: host metadata
        handle = out[4:]
        y = torch.ops.spartron_deepep.combine(ref, torch.empty(recv, 64, dtype=torch.bfloat16), *handle, 24)
        assert tuple(y.shape) == (10, 64) and y.dtype == torch.bfloat16
        gx, gw = torch.ops.spartron_deepep.dispatch_backward(ref, out[0], out[2], *handle, 24)
        assert (tuple(gx.shape), tuple(gw.shape)) == ((10, 64), (10, 4)) and gw.dtype == torch.float32
        back = torch.ops.spartron_deepep.cached_dispatch(ref, x, *handle, 24)
        assert tuple(back.shape) == (recv, 64)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_deepep_ops_are_mandatory_saves(mode):
    policy = build_policy(mode)
    for name in deepep_ops.OPS:
        op = getattr(torch.ops.spartron_deepep, name.split("::")[1]).default
        assert policy.decide(op, (), {}) == "mandatory", name


def test_ops_take_the_buffers_ref():
    with pytest.raises(TypeError, match=r"^spartron_deepep ops take a DeepEPBuffer's `ref` \(DeepEPBufferRef\), "
                                        r"got object$"):
        torch.ops.spartron_deepep.combine(object(), torch.zeros(1, 8, dtype=torch.bfloat16),
                                          *[torch.zeros(1, dtype=torch.int32)] * 6, 8)


# --------------------------------------------------------------------------------------------
# The parity worker (CPU: gloo + emulator; GPU: NCCL + deep_ep)
# --------------------------------------------------------------------------------------------

MODES = ["none", "full", "selective", "full-nonreentrant", "none-mb2", "full-mb2", "selective-experts2"]


def _close(got, ref, what):
    got, ref = got.float(), ref.float()
    scale = max(ref.abs().max().item(), 1e-6)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2 * scale, msg=lambda m: f"{what}: {m}")


def _run_mb2(layer, xs, device):
    return run_interleaved(layer, xs, device)


def _forward(layer, x, mode, device):
    """[MoEOutput per micro-batch] for one of MODES ("-experts2": scope 'experts', 2 chunks in the layer)."""
    if mode.endswith("experts2"):  # the layer was built with micro_batches=2
        return [layer(x)]
    if mode.endswith("mb2"):
        xs = list(x.chunk(2))
        if mode.startswith("full"):
            return checkpoint(_run_mb2, layer, xs, device)
        return _run_mb2(layer, xs, device)
    return [layer(x)]


def _parity_worker(rank, world, device_kind, modes):
    gpu = device_kind == "cuda"
    if gpu:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        group = dist.new_group(list(range(world)), backend="nccl")
        library = None  # the real deep_ep
    else:
        device, group, library = torch.device("cpu"), dist.group.WORLD, deepep_emulator
    dim = DIM
    torch.manual_seed(0)
    ref = MoELayer(model_cfg("all_to_all", dim), EPTransport(group), device=device)
    transport = EPTransport(group, deepep_library=library)  # one buffer for the group, reused by every mode
    shared_buffer = transport.deepep_buffer(3, 8, 8, dim)
    torch.manual_seed(100 + rank)
    x = torch.randn(BATCH, TOKENS_PER_SEQ, dim, device=device, dtype=torch.bfloat16)
    g = torch.randn_like(x)

    x_ref = x.clone().requires_grad_()
    out_ref = ref(x_ref)
    ((out_ref["hidden_states"].float() * g.float()).sum()).backward()
    ref_counts = ref.step_tokens_per_expert.clone()
    ref.update_expert_bias(group=group)
    report = {}
    for mode in modes:
        dep = MoELayer(model_cfg("deepep", dim), transport, device=device,
                       micro_batches=2 if mode.endswith("experts2") else 1)
        assert isinstance(dep.dispatcher, DeepEPDispatcher) and dep.dispatcher.buffer is shared_buffer
        dep.load_state_dict(ref.state_dict())
        with torch.no_grad():
            dep.router.expert_bias.copy_(torch.zeros_like(dep.router.expert_bias))
            ref_bias_before = torch.zeros_like(dep.router.expert_bias)
        base = mode.removesuffix("-mb2").removesuffix("-experts2")
        if base != "none":
            apply_activation_checkpointing(dep, ACConfig(mode=base.split("-")[0],
                                                         reentrant=not base.endswith("nonreentrant")))
        before = dict(shared_buffer.runtime().calls) if library is not None else {}
        x_dep = x.clone().requires_grad_()
        outs = _forward(dep, x_dep, mode, device)
        hidden = torch.cat([o["hidden_states"] for o in outs])
        loss = (hidden.float() * g.float()).sum()
        loss.backward()
        _close(hidden, out_ref["hidden_states"], f"{mode}: output")
        _close(x_dep.grad, x_ref.grad, f"{mode}: input grad")
        for name, p in dep.named_parameters():
            _close(p.grad, ref.get_parameter(name).grad, f"{mode}: grad of {name}")
        counts = sum(o["tokens_per_expert"] for o in outs)
        assert torch.equal(counts, out_ref["tokens_per_expert"]), f"{mode}: tokens_per_expert"
        assert torch.equal(dep.step_tokens_per_expert, ref_counts), f"{mode}: telemetry counts"
        dep.update_expert_bias(group=group)
        assert not torch.equal(dep.router.expert_bias, ref_bias_before)
        assert torch.equal(dep.router.expert_bias, ref.router.expert_bias), f"{mode}: bias update"
        if library is not None:
            after = shared_buffer.runtime().calls
            delta = {k: after[k] - before.get(k, 0) for k in after}
            n = 2 if mode.endswith(("mb2", "experts2")) else 1
            # one layout + one exchange per micro-batch even under AC: the replay reuses the saved
            # dispatch/combine outputs (handle included); backward = one cached dispatch + one combine
            assert delta == {"layout": n, "dispatch": n, "combine": 2 * n, "cached_dispatch": n}, (mode, delta)
        report[mode] = "ok"
    runtime = shared_buffer.runtime()
    assert transport.destroy() == 1  # collective, while every rank is alive
    assert not shared_buffer.created and transport.destroy() == 0
    if library is not None:
        assert runtime.destroyed
    return report


def _handle_lifetime_worker(rank, world):
    buffer = DeepEPBuffer(dist.group.WORLD, 2, 4, 8, 16, library=deepep_emulator)
    torch.manual_seed(rank)
    x = torch.randn(6, 16, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(6)])
    w = torch.rand(6, 2, requires_grad=True)
    recv, recv_ids, recv_w, counts, handle = deepep_ops.deepep_dispatch(buffer, x, ids, w)
    assert int(counts.sum()) == int((recv_ids >= 0).sum())
    assert recv_ids.shape == recv_w.shape and bool((recv_w[recv_ids < 0] == 0).all())
    y = deepep_ops.deepep_combine(buffer, recv * 2, handle)
    # every token went to the ranks of its experts and came back once per rank: y = 2 x * ranks hit
    hits = handle.is_token_in_rank.sum(1, keepdim=True).to(torch.bfloat16)
    torch.testing.assert_close(y, (2 * x * hits).detach())
    storages = [StorageWeakRef(t.untyped_storage()) for t in handle.tensors()]
    loss = y.float().sum() + (recv_w * torch.arange(1.0, 3.0)).sum()
    del recv, recv_ids, recv_w, handle, y
    assert not any(s.expired() for s in storages)  # alive: saved on the autograd nodes
    loss.backward()
    del loss
    freed = [s.expired() for s in storages]
    torch.testing.assert_close(x.grad, (2 * hits).expand_as(x).to(x.grad.dtype))
    own = ids // 2 == rank
    return freed, w.grad.tolist(), own.tolist(), dict(buffer.runtime().calls)


def test_handle_lives_on_the_autograd_graph_and_is_freed_by_backward():
    for rank, (freed, w_grad, own, calls) in enumerate(run_distributed(_handle_lifetime_worker, 2)):
        assert all(freed), f"rank {rank}: handle tensors still alive after backward: {freed}"
        # the gate-weight gradient comes back through dispatch's backward: d/dw (w * [1, 2]) per slot
        assert w_grad == [[1.0, 2.0]] * 6, rank
        assert calls == {"layout": 1, "dispatch": 1, "combine": 2, "cached_dispatch": 1}
        assert len(own) == 6


def test_ep2_parity_with_all_to_all_emulated():
    results = run_distributed(_parity_worker, 2, "cpu", MODES, timeout=120)
    assert results == [{m: "ok" for m in MODES}] * 2


def test_one_transport_gives_every_layer_one_deepep_buffer():
    results = run_distributed(_share_worker, 2)
    assert results == [(True, False, "model.moe.dispatcher = 'deepep': MoE layers on one EP group disagree on "
                               "(top_k, n_routed_experts, deepep_num_sms), dim: (2, 8, 8), 64 vs (3, 8, 8), 64")] * 2


def _share_worker(rank, world):
    transport = EPTransport(dist.group.WORLD, deepep_library=deepep_emulator)
    layers = [MoELayer(model_cfg("deepep"), transport) for _ in range(3)]
    own = MoELayer(model_cfg("deepep"), EPTransport(dist.group.WORLD, deepep_library=deepep_emulator))
    try:
        MoELayer(model_cfg("deepep", top_k=2), transport)
        message = "no error"
    except ValueError as err:
        message = str(err)
    one = layers[0].dispatcher.buffer
    return all(m.dispatcher.buffer is one for m in layers), own.dispatcher.buffer is one, message


def _tiny_deepep_cfg(run_dir, dispatcher: str):
    from spartron.runtime.config import load_config

    return load_config("configs/tiny.toml", [
        "parallel.ep=2", f'model.moe.dispatcher="{dispatcher}"', 'model.dtype="bfloat16"', "model.moe.deepep_num_sms=8",
        "train.steps=2", "train.progress=false", f'train.run_dir="{run_dir}"', "train.peak_tflops=1.0"])


def _build_model_worker(rank, world, run_dir):
    from spartron.layers.model import build_model
    from spartron.parallel.dims import ParallelDims
    from spartron.parallel.groups import ParallelGroups

    sys.modules["deep_ep"] = deepep_emulator  # this forked rank's `import deep_ep` finds the test double
    groups = ParallelGroups.build(ParallelDims(world, fsdp=world, ep=world), "cpu")
    model = build_model(_tiny_deepep_cfg(run_dir, "deepep").model, groups)
    dispatchers = [m.dispatcher for m in model.modules() if isinstance(getattr(m, "dispatcher", None),
                                                                        DeepEPDispatcher)]
    return len(dispatchers), len({id(d.buffer) for d in dispatchers})


def test_build_model_gives_all_deepep_layers_one_buffer(tmp_path):
    # tiny.toml: 4 layers, the first dense -> 3 MoE layers (MTP's layer is a fourth)
    n_layers, n_buffers = run_distributed(_build_model_worker, 2, str(tmp_path))[0]
    assert n_layers >= 3 and n_buffers == 1


def _train_with_deepep_worker(rank, world, run_dir):
    from spartron.layers.model import build_model
    from spartron.layers.parallelize import parallelize
    from spartron.runtime.trainer import train

    made = []

    def recording_buffer(*args, **kwargs):
        made.append(deepep_emulator.Buffer(*args, **kwargs))
        return made[-1]

    library = type(sys)("deep_ep_recording")
    library.Buffer, library.Config = recording_buffer, deepep_emulator.Config

    def factory(cfg, groups):  # the run config says all_to_all (a CPU run); the model is built with deepep
        deepep = cfg.model.model_copy(update={"moe": cfg.model.moe.model_copy(update={"dispatcher": "deepep"})})
        model = build_model(deepep, groups, transport=EPTransport(groups.ep, deepep_library=library))
        assert all(isinstance(m.dispatcher, DeepEPDispatcher) for m in model.moe_layers())
        return parallelize(model, groups, cfg.ac)

    result = train(_tiny_deepep_cfg(run_dir, "all_to_all"), factory)
    return len(result.records), len(made), [b.destroyed for b in made], sum(b.calls["dispatch"] for b in made)


def test_trainer_destroys_the_deepep_buffer_when_the_run_ends(tmp_path):
    for steps, buffers, destroyed, dispatches in run_distributed(_train_with_deepep_worker, 2, str(tmp_path)):
        assert (steps, buffers, destroyed) == (2, 1, [True])  # one buffer for all layers, released collectively
        assert dispatches > 0  # the layers really dispatched through it


# --------------------------------------------------------------------------------------------
# GPU: the real DeepEP on 2 ranks (run by the lead on the lent 2 x H200 machine)
# --------------------------------------------------------------------------------------------

def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA: DeepEP runs on SM90 GPUs over NVLink"
    if torch.cuda.device_count() < 2:
        return f"needs 2 CUDA GPUs for EP=2, found {torch.cuda.device_count()}"
    if importlib.util.find_spec("deep_ep") is None:
        return "needs DeepEP v1.2.1 built from source (intranode only); deep_ep is not importable"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_skip_reason() is not None, reason=str(_gpu_skip_reason()))
def test_ep2_parity_with_all_to_all_deepep_gpu():
    results = run_distributed(_parity_worker, 2, "cuda", MODES, timeout=600, start_method="spawn")
    assert results == [{m: "ok" for m in MODES}] * 2
