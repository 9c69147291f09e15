"""model.fp8.dispatch: the MoE dispatch sends E4M3 rows with their 1x128 scales, over every dispatcher that moves
rows: the NCCL all-to-all, the copy-engine exchange (CPU: over HostSharedMemory) and DeepEP (CPU: its test double,
deepep_emulator, taking and returning the (values, scales) pair as DeepEP's FP8 dispatch does).

On real gloo ranks (EP 2), for each dispatcher: the layer's output and input gradient equal the bf16-dispatch FP8
layer's bitwise (the experts' own quantisation of the received rows gives back the sent FP8 values), and every
gradient does when the input is already FP8-representable (the wire is then lossless). The all-to-all moves dim + 4
* dim / 128 bytes a row instead of 2 * dim (a mirrored rank of EP 4), DeepEP the same per token (the double counts
them). Compiled with selective AC, each equals eager with no graph break. A layout with one EP rank is a one-line
error naming the key.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import deepep_emulator  # test double of DeepEP, next to this file (tests/layers/moe)
import pytest
import torch
import torch._dynamo  # noqa: F401  (custom ops import it lazily: 4 s in every forked rank otherwise)
import torch.distributed as dist

from spartron.comm.copy_engine import HostSharedMemory
from spartron.comm.mirror import mirrored_world
from spartron.comm.transport import EPTransport
from spartron.configbase import ConfigError
from spartron.layers.config import FP8Config, ModelConfig
from spartron.layers.fp8 import apply_fp8
from spartron.layers.fp8.quant import dequantize_rows, quantize_rows
from spartron.layers.fp8.wire import pack, unpack, wire_row_bytes
from spartron.layers.moe import MoELayer
from spartron.runtime.config import load_config
from spartron.testing import run_distributed

DIM, TOKENS = 256, 24
TINY = Path(__file__).resolve().parents[3] / "configs" / "tiny.toml"
BF16 = ['model.dtype="bfloat16"', "model.dim=128", "model.moe.moe_inter_dim=128", "model.dense_inter_dim=128"]
KINDS = ["all_to_all", "copy_engine", "deepep"]


def _cfg(kind: str = "all_to_all") -> ModelConfig:
    moe = {"n_routed_experts": 4, "n_shared_experts": 0, "top_k": 2, "moe_inter_dim": 128, "n_groups": 1,
           "topk_groups": 1, "dispatcher": "deepep" if kind == "deepep" else "all_to_all",
           "all_to_all_transport": "copy_engine" if kind == "copy_engine" else "nccl", "deepep_num_sms": 8}
    return ModelConfig.model_validate({"dim": DIM, "init_std": 0.05, "dtype": "bfloat16", "moe": moe})


def _shared() -> list[torch.Tensor]:
    """The copy-engine exchange's receive memory of 2 ranks, made before they fork."""
    return [torch.zeros(1 << 20, dtype=torch.uint8).share_memory_() for _ in range(2)]


def _transport(kind: str, shared, group=None, library=deepep_emulator) -> EPTransport:
    """The EP group's transport (CPU: gloo with the DeepEP double or the shared-memory exchange; GPU: group is the
    NCCL group, library None: the real deep_ep, the copy engines over symmetric memory)."""
    group = group or dist.group.WORLD
    if kind == "deepep":
        return EPTransport(group, deepep_library=library)
    cpu = kind == "copy_engine" and shared is not None
    return EPTransport(group, memory=HostSharedMemory(shared, group) if cpu else None)


def _layer(transport: EPTransport, dispatch: bool, kind: str = "all_to_all", backend: str = "reference",
           device: torch.device | None = None, **fp8) -> MoELayer:
    layer = MoELayer(_cfg(kind), transport, device=device)
    apply_fp8([layer], FP8Config(backend=backend, modules=["experts"], dispatch=dispatch, **fp8))
    return layer


def _run(layer: MoELayer, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().view(2, TOKENS // 2, DIM).requires_grad_()
    out = layer(x)["hidden_states"]
    (out.float() * g).sum().backward()
    return out.detach(), x.grad, *(p.grad for p in layer.experts.parameters())


def _worker(rank, world, kind, shared, device_kind="cpu"):
    device, group, backend, library = torch.device("cpu"), None, "reference", deepep_emulator
    if device_kind == "cuda":  # NCCL, the real deep_ep, the Triton quantiser
        torch.cuda.set_device(rank)
        device, group, backend, library = torch.device("cuda", rank), dist.new_group([0, 1], backend="nccl"), \
            "triton", None
    torch.manual_seed(rank)
    x = (torch.randn(TOKENS, DIM, dtype=torch.bfloat16) * 3).to(device)
    g = torch.randn(2, TOKENS // 2, DIM).to(device)
    transport = _transport(kind, None if device_kind == "cuda" else shared, group, library)  # shared by both layers
    plain, wire = (_layer(transport, dispatch, kind, backend, device) for dispatch in (False, True))
    assert wire.dispatcher.wire is not None and plain.dispatcher.wire is None
    counted = kind == "deepep" and library is not None  # the double counts the tokens' bytes each dispatch sends
    runtime = transport.deepep_buffer(2, 4, 8, DIM).runtime() if counted else None
    results, sent = [], []
    for layer in (plain, wire):
        before = runtime.dispatched_bytes if counted else 0
        results.append(_run(layer, x, g))
        sent.append(runtime.dispatched_bytes - before if counted else 0)
    a, b = results
    out = {"out": torch.equal(a[0], b[0]), "dx": torch.equal(a[1], b[1]), "w2": torch.equal(a[4], b[4]),
           "w13_close": all(torch.allclose(p, q, rtol=0.05, atol=1e-2) for p, q in zip(a[2:4], b[2:4], strict=True))}
    exact = dequantize_rows(*quantize_rows(x.float().cpu())).to(torch.bfloat16).to(device)  # FP8-representable rows
    a, b = _run(plain, exact, g), _run(wire, exact, g)
    out["all_equal_when_representable"] = all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    if counted:  # the tokens DeepEP sent, once per destination rank: 2 * dim bytes each, then dim + its scales
        bf16, fp8 = sent
        out["deepep_bytes"] = bf16 % (2 * DIM) == 0 and fp8 == bf16 // (2 * DIM) * wire_row_bytes(DIM) and fp8 > 0
    transport.destroy()
    return out


WANT = {"out": True, "dx": True, "w2": True, "w13_close": True, "all_equal_when_representable": True}


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_dispatch_keeps_the_forward_and_input_gradient_bitwise_on_two_ranks(kind):
    want = WANT | ({"deepep_bytes": True} if kind == "deepep" else {})
    for rank_result in run_distributed(_worker, 2, kind, _shared(), timeout=120):
        assert rank_result == want


def _gpu_skip_reason(kind: str) -> str | None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return "needs 2 CUDA GPUs (EP 2 over NCCL, NVLink)"
    if kind == "deepep" and importlib.util.find_spec("deep_ep") is None:
        return "needs DeepEP v1.2.1 built from source (benchmarks/build_deepep.sh); deep_ep is not importable"
    return None


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.skipif(_gpu_skip_reason(k) is not None,
                                                                         reason=str(_gpu_skip_reason(k))))
                                  for k in KINDS])
def test_fp8_dispatch_on_two_gpus_keeps_the_forward_and_input_gradient_bitwise(kind):
    """The same on 2 GPUs: the real DeepEP's FP8 dispatch, the copy engines over symmetric memory, NCCL."""
    for rank_result in run_distributed(_worker, 2, kind, None, "cuda", timeout=600, start_method="spawn"):
        assert rank_result == WANT


def test_pack_unpack_round_trip_and_row_bytes():
    x = torch.randn(5, DIM, dtype=torch.bfloat16) * 100
    wire = pack(x, "reference")
    assert wire.dtype == torch.uint8 and wire.shape == (5, wire_row_bytes(DIM)) == (5, DIM + 8)
    q, s = quantize_rows(x.float())
    assert torch.equal(unpack(wire, DIM, torch.bfloat16), dequantize_rows(q, s).to(torch.bfloat16))
    assert pack(x[:0], "reference").shape == (0, DIM + 8)
    hostile = torch.zeros(4, DIM, dtype=torch.bfloat16)  # a zero tile, bf16 subnormals, the largest bf16, a NaN
    hostile[1, :3] = torch.tensor([1e-40, -2e-39, 9.2e-41])
    hostile[2, 128:131] = torch.tensor([3.3e38, -1.0, 1e-30])
    hostile[3, 5] = float("nan")
    q, s = quantize_rows(hostile.float())
    expected = dequantize_rows(q, s).to(torch.bfloat16)
    assert torch.equal(unpack(pack(hostile, "reference"), DIM, torch.bfloat16).isnan(), expected.isnan())
    assert torch.equal(unpack(pack(hostile, "reference"), DIM, torch.bfloat16).nan_to_num(), expected.nan_to_num())
    assert wire_row_bytes(7168) / (2 * 7168) == pytest.approx(0.515625)


def _dispatch_bytes(dispatch: bool) -> int:
    with mirrored_world(0, 4) as ledger:
        layer = _layer(EPTransport(dist.group.WORLD), dispatch)
        x = torch.randn(2, TOKENS // 2, DIM, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
        ledger.take()
        layer(x)  # forward only: the count exchange, the dispatch and the combine
        records = [r for r in ledger.take() if r.kind == "all_to_all"]
    return sum(r.bytes for r in records)


def test_the_dispatch_moves_fp8_bytes_on_a_mirrored_rank():
    rows = TOKENS * 2  # top_k slots: what the dispatch sends (the same routing both times: the combine's equal)
    bf16, fp8 = _dispatch_bytes(False), _dispatch_bytes(True)
    assert bf16 - fp8 == rows * (2 * DIM - wire_row_bytes(DIM))


@pytest.mark.parametrize("fp8", [False, True])
def test_the_experts_get_the_regrouping_as_tensors_needing_a_gradient(fp8):
    """The EP regrouping reaches the experts as a plan (received rows, order, inverse), passed as tensors:
    FSDP2 registers its post-backward hook on the forward's tensor arguments that need a gradient, and a
    dataclass argument hid them (the experts' gradients then waited for the end of backward: an H100
    rehearsal of the V3-256 rank ran out of memory)."""
    with mirrored_world(0, 4):
        layer = MoELayer(_cfg(), EPTransport(dist.group.WORLD))
        if fp8:
            apply_fp8([layer], FP8Config(backend="reference", modules=["experts"]))
        seen = []
        layer.experts.register_forward_pre_hook(lambda module, args: seen.append(args))
        x = torch.randn(2, TOKENS // 2, DIM, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
        layer(x.requires_grad_())
    (args,) = seen
    assert [type(a) for a in args] == [torch.Tensor] * 4 + [int] and args[0].requires_grad
    assert args[2].shape == args[3].shape == (args[0].shape[0],) and args[4] == 1  # a permutation of the received rows


def test_layouts_that_cannot_send_fp8_are_refused():
    with pytest.raises(ValueError, match="model.fp8.dispatch = true needs parallel.ep > 1"):
        load_config(TINY, [*BF16, "model.fp8.backend=reference", "model.fp8.dispatch=true"])
    for moe in ('model.moe.all_to_all_transport="copy_engine"', 'model.moe.dispatcher="deepep"'):  # both send FP8
        cfg = load_config(TINY, [*BF16, "model.fp8.backend=reference", "model.fp8.dispatch=true", "parallel.ep=2", moe])
        assert cfg.model.fp8.dispatch
    with pytest.raises(ValueError, match="needs model.fp8.power_of_two_scales = true"):
        FP8Config(dispatch=True, power_of_two_scales=False)
    with pytest.raises(ValueError, match=r"needs 'experts' in model.fp8.modules, got \['dense'\]"):
        FP8Config(dispatch=True, modules=["dense"])
    layer = MoELayer(_cfg())  # one EP rank: the local dispatcher
    with pytest.raises(ConfigError, match="^model.fp8.dispatch = true needs a dispatcher that moves rows between more "
                                          "than one EP rank; this MoE layer has LocalDispatcher$"):
        apply_fp8([layer], FP8Config(backend="reference", modules=["experts"], dispatch=True))


def test_deepep_takes_fp8_rows_only_as_its_fp8_dispatch_does():
    """A wrong pair is a one-line error before any rank enters DeepEP's collective (a bad shape there hangs the
    peers); the scales may be a transposed view (DeepEP reads them through their strides)."""
    from spartron.comm.deepep_buffer import DeepEPBuffer

    with mirrored_world(0, 2):
        buffer = DeepEPBuffer(dist.group.WORLD, 2, 4, 8, DIM, library=deepep_emulator)
    x = torch.zeros(6, DIM, dtype=torch.bfloat16)
    q, scales = torch.zeros(6, DIM, dtype=torch.float8_e4m3fn), torch.ones(DIM // 128, 6).t()
    got_q, got_scales = buffer.check_fp8(x, q.t().contiguous().t(), scales)
    assert got_q.is_contiguous() and got_scales is scales
    with pytest.raises(ValueError, match=r"^model.moe.dispatcher = 'deepep': FP8 rows must be float8_e4m3fn \(6, 256\) "
                                         r"with dim a multiple of 128, got torch.uint8 \(6, 256\)$"):
        buffer.check_fp8(x, q.view(torch.uint8), scales)
    with pytest.raises(ValueError, match=r"^model.moe.dispatcher = 'deepep': FP8 scales must be float32 \[6, 2\] "
                                         r"\(one per 128 values\), got torch.float32 \(2, 6\)$"):
        buffer.check_fp8(x, q, scales.t())


def _compiled_worker(rank, world, kind, shared):
    from torch._dynamo.utils import counters

    from spartron.checkpointing import ACConfig, apply_activation_checkpointing, compile_block

    torch._dynamo.reset()
    layers = []
    transport = _transport(kind, shared)
    for compiled in (False, True):
        layer = _layer(transport, True, kind, weight_cache="off")
        apply_activation_checkpointing(layer, ACConfig(mode="selective", reentrant=False), name="moe")
        if compiled:
            compile_block(layer, "aot_eager")  # fullgraph: a graph break is an error
        layers.append(layer)
    counters.clear()
    torch.manual_seed(rank)
    x = torch.randn(2, TOKENS // 2, DIM, dtype=torch.bfloat16)
    g = torch.randn(2, TOKENS // 2, DIM)
    eager, compiled = _run(layers[0], x, g), _run(layers[1], x, g)
    transport.destroy()
    return [torch.equal(a, b) for a, b in zip(eager, compiled, strict=True)], sum(counters["graph_break"].values())


@pytest.mark.parametrize("kind", KINDS)
def test_a_compiled_selective_ac_block_sends_fp8_and_equals_eager_on_two_ranks(kind):
    for equal, breaks in run_distributed(_compiled_worker, 2, kind, _shared(), timeout=300):
        assert equal == [True] * 5 and breaks == 0
