"""model.fp8.dispatch: the MoE dispatch all-to-all sends E4M3 rows with their 1x128 scales.

On real gloo ranks (EP 2): the layer's output and input gradient equal the bf16-dispatch FP8 layer's bitwise
(the experts' own quantisation of the received rows gives back the sent FP8 values), and every gradient does
when the input is already FP8-representable (the wire is then lossless). On a mirrored rank of EP 4: the
dispatch all-to-all moves dim + 4 * dim / 128 bytes a row instead of 2 * dim. The layouts it cannot serve
are one-line errors naming the key.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401  (custom ops import it lazily: 4 s in every forked rank otherwise)
import torch.distributed as dist

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
TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
BF16 = ['model.dtype="bfloat16"', "model.dim=128", "model.moe.moe_inter_dim=128", "model.dense_inter_dim=128"]


def _cfg() -> ModelConfig:
    moe = {"n_routed_experts": 4, "n_shared_experts": 0, "top_k": 2, "moe_inter_dim": 128, "n_groups": 1,
           "topk_groups": 1, "dispatcher": "all_to_all"}
    return ModelConfig.model_validate({"dim": DIM, "init_std": 0.05, "dtype": "bfloat16", "moe": moe})


def _layer(group, dispatch: bool) -> MoELayer:
    layer = MoELayer(_cfg(), EPTransport(group))
    apply_fp8([layer], FP8Config(backend="reference", modules=["experts"], dispatch=dispatch))
    return layer


def _run(layer: MoELayer, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().view(2, TOKENS // 2, DIM).requires_grad_()
    out = layer(x)["hidden_states"]
    (out.float() * g).sum().backward()
    return out.detach(), x.grad, *(p.grad for p in layer.experts.parameters())


def _worker(rank, world):
    torch.manual_seed(rank)
    x = torch.randn(TOKENS, DIM, dtype=torch.bfloat16) * 3
    g = torch.randn(2, TOKENS // 2, DIM)
    plain, wire = _layer(dist.group.WORLD, False), _layer(dist.group.WORLD, True)
    assert wire.dispatcher.wire is not None and plain.dispatcher.wire is None
    a, b = _run(plain, x, g), _run(wire, x, g)
    out = {"out": torch.equal(a[0], b[0]), "dx": torch.equal(a[1], b[1]), "w2": torch.equal(a[4], b[4]),
           "w13_close": all(torch.allclose(p, q, rtol=0.05, atol=1e-2) for p, q in zip(a[2:4], b[2:4], strict=True))}
    exact = dequantize_rows(*quantize_rows(x.float())).to(torch.bfloat16)  # FP8-representable rows
    a, b = _run(plain, exact, g), _run(wire, exact, g)
    out["all_equal_when_representable"] = all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    return out


def test_fp8_dispatch_keeps_the_forward_and_input_gradient_bitwise_on_two_ranks():
    for rank_result in run_distributed(_worker, 2, timeout=120):
        assert rank_result == {"out": True, "dx": True, "w2": True, "w13_close": True,
                               "all_equal_when_representable": True}


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
        layer = _layer(dist.group.WORLD, dispatch)
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
    with pytest.raises(ValueError, match="built for model.moe.dispatcher = 'all_to_all' with all_to_all_transport "
                                         "= 'nccl', got dispatcher 'all_to_all', transport 'copy_engine'"):
        load_config(TINY, [*BF16, "model.fp8.backend=reference", "model.fp8.dispatch=true", "parallel.ep=2",
                           'model.moe.all_to_all_transport="copy_engine"'])
    with pytest.raises(ValueError, match="needs model.fp8.power_of_two_scales = true"):
        FP8Config(dispatch=True, power_of_two_scales=False)
    with pytest.raises(ValueError, match=r"needs 'experts' in model.fp8.modules, got \['dense'\]"):
        FP8Config(dispatch=True, modules=["dense"])
    layer = MoELayer(_cfg())  # one EP rank: the local dispatcher
    with pytest.raises(ConfigError, match="needs the NCCL all-to-all dispatcher .* this MoE layer has LocalDispatcher"):
        apply_fp8([layer], FP8Config(backend="reference", modules=["experts"], dispatch=True))


def _compiled_worker(rank, world):
    from torch._dynamo.utils import counters

    from spartron.checkpointing import ACConfig, apply_activation_checkpointing, compile_block

    torch._dynamo.reset()
    layers = []
    for compiled in (False, True):
        layer = MoELayer(_cfg(), EPTransport(dist.group.WORLD))
        apply_fp8([layer], FP8Config(backend="reference", modules=["experts"], dispatch=True, weight_cache="off"))
        apply_activation_checkpointing(layer, ACConfig(mode="selective", reentrant=False), name="moe")
        if compiled:
            compile_block(layer, "aot_eager")  # fullgraph: a graph break is an error
        layers.append(layer)
    counters.clear()
    torch.manual_seed(rank)
    x = torch.randn(2, TOKENS // 2, DIM, dtype=torch.bfloat16)
    g = torch.randn(2, TOKENS // 2, DIM)
    eager, compiled = _run(layers[0], x, g), _run(layers[1], x, g)
    return [torch.equal(a, b) for a, b in zip(eager, compiled, strict=True)], sum(counters["graph_break"].values())


def test_a_compiled_selective_ac_block_sends_fp8_and_equals_eager_on_two_ranks():
    for equal, breaks in run_distributed(_compiled_worker, 2, timeout=300):
        assert equal == [True] * 5 and breaks == 0
