"""model.fp8.param_gather (spartron.layers.fp8.param_gather): FP8-run weights quantised once per optimizer step on
their FSDP2 shard and all-gathered as E4M3. 2-rank gloo runs of the Trainer (reference backend): bitwise the
bf16-gather run, one quantisation per weight per step, E4M3 bytes on the wire, resume, refusals."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton_device import DEVICE as KERNEL_DEVICE  # tests/triton_device.py
from triton_device import needs_kernel

from spartron.configbase import ConfigError
from spartron.layers.config import FP8Config
from spartron.layers.fp8 import quant
from spartron.layers.fp8.apply import check_param_gather
from spartron.layers.fp8.shard_quant import block_amax, local_amax, quantize_shard
from spartron.runtime.config import load_config
from spartron.testing import run_distributed


def _shards(w: torch.Tensor, dim: int, world: int) -> list[torch.Tensor]:
    """torch.chunk's shards, zero-padded to the first one's size (FSDP2's)."""
    chunks = torch.chunk(w, world, dim)
    padded = chunks[0].shape[dim]
    out = []
    for r in range(world):
        p = torch.zeros(*w.shape[:dim], padded, *w.shape[dim + 1:], dtype=w.dtype)
        if r < len(chunks):
            p.narrow(dim, 0, chunks[r].shape[dim]).copy_(chunks[r])
        out.append(p)
    return out


@pytest.mark.parametrize("shape, dim, world", [
    ((384, 256), 0, 2),     # 192 rows a shard: a 128-row block split over two shards (the global amax)
    ((384, 256), 0, 3),     # 128 rows a shard: whole blocks
    ((384, 256), 0, 7),     # 55 rows, the last shard padded
    ((4, 256, 128), 0, 2),  # whole experts a shard
    ((2, 256, 128), 1, 4),  # experts sharded on their rows (parallelize.expert_shard_dim), 64 rows a shard
])
def test_shards_quantised_with_the_max_reduced_amax_equal_the_full_weights_blocks(shape, dim, world):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(shape, generator=g) * torch.rand(shape[-2], 1, generator=g) * 10).bfloat16()
    q, s = quant.quantize_blocks(w, pow2=True)
    shards = _shards(w, dim, world)
    amax = block_amax(torch.cat([local_amax(p, w.shape, dim) for p in shards], dim), w.shape, dim)
    scales = quant.tile_scales(amax, True)
    assert torch.equal(scales, s)
    gathered = torch.cat([quantize_shard(p, scales, dim, r) for r, p in enumerate(shards)], dim)
    assert torch.equal(gathered.narrow(dim, 0, shape[dim]).view(torch.uint8), q.view(torch.uint8))


def test_refusals_name_the_key():
    with pytest.raises(ConfigError, match=r"^model.fp8.param_gather = true with train.compile = true: the FP8 "
                       r"all-gather's weights are not traced into compiled blocks; set train.compile = false or "
                       r"model.fp8.param_gather = false$"):
        check_param_gather(True, 2)
    with pytest.raises(ConfigError, match=r"^model.fp8.param_gather = true needs FSDP2 sharding over more than one "
                       r"rank \(the fsdp group has 1\): nothing is all-gathered; set model.fp8.param_gather = false$"):
        check_param_gather(False, 1)
    with pytest.raises(ValueError, match=r"model.fp8.param_gather = true with model.fp8.weight_cache = 'on': the "
                       r"gathered FP8 weights replace the cache; use weight_cache 'auto' \(on only for experts whole "
                       r"on each rank\)"):
        FP8Config(param_gather=True, weight_cache="on")
    with pytest.raises(ValueError, match=r"model.fp8.param_gather = true with train.compile = true"):
        load_config("configs/tiny.toml", _OVERRIDES + ["model.fp8.param_gather=true", "train.compile=true"])
    assert FP8Config(param_gather=True).weight_cache == "auto"


_OVERRIDES = ["train.progress=false", "train.peak_tflops=1.0", "train.lr=3e-3", "train.warmup_steps=0",
              "train.seq_len=32", "model.dtype=bfloat16", "model.master_dtype=float32", "model.dim=128",
              "model.moe.moe_inter_dim=128", "model.dense_inter_dim=256", "model.fp8.backend=reference",
              "parallel.fsdp=2"]


def _cfg(run_dir: str, gather: bool, steps: int = 3, *extra: str):
    return load_config("configs/tiny.toml", [*_OVERRIDES, f"train.steps={steps}", f"train.run_dir={run_dir}",
                                             f"model.fp8.param_gather={str(gather).lower()}", *extra])


def _full(model) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone() for k, v in model.state_dict().items()}


class _Gathers(TorchDispatchMode):
    """The bytes every all-gather writes, by output dtype (the c10d ops go through the dispatcher)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = {}
        self.max_reduces = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        name = str(func)
        if "allgather" in name or "all_gather" in name:
            out = args[0]
            for t in out if isinstance(out, (list, tuple)) else [out]:
                for x in t if isinstance(t, (list, tuple)) else [t]:
                    self.bytes[str(x.dtype)] = self.bytes.get(str(x.dtype), 0) + x.numel() * x.element_size()
        return func(*args, **(kwargs or {}))


def _train(rank, world, root: str):
    from spartron.layers.fp8 import gemms, reference
    from spartron.layers.fp8.gathered import GatheredFP8Weight
    from spartron.layers.fp8.modules import FP8GroupedExperts
    from spartron.layers.fp8.param_gather import states_of
    from spartron.layers.step_memory import fp8_gathered_shard_bytes
    from spartron.runtime.trainer import Trainer

    out = {}
    for gather in (False, True):
        trainer = Trainer(_cfg(f"{root}/{gather}", gather)).setup()
        losses, bytes_per_step, seen = [], [], set()
        experts = [m for m in trainer.model.modules() if isinstance(m, FP8GroupedExperts)]
        handles = [m.register_forward_pre_hook(lambda m, a, seen=seen: seen.add(type(m.w1))) for m in experts]
        for _ in range(3):
            with _Gathers() as mode:
                losses.append(trainer.step()["loss"])
            bytes_per_step.append(mode.bytes)
        for h in handles:
            h.remove()
        states = states_of(trainer.model)
        params = _full(trainer.model)
        blocks_equal = None
        if gather:  # the gathered blocks against gemms.weight_blocks of the bf16 weights
            experts = next(m for m in trainer.model.modules() if isinstance(m, FP8GroupedExperts))
            full = [getattr(experts, n).full_tensor().bfloat16() for n in ("w1", "w3", "w2")]
            experts.unshard()
            w1, w2 = experts.w1, experts.w2
            got = [*w1.joint.blocks(), *w2.joint.blocks()]
            want = gemms.weight_blocks(reference, *full, True)
            blocks_equal = (isinstance(w1, GatheredFP8Weight), [
                torch.equal(a.view(torch.uint8) if a.dtype == quant.FP8 else a, b.view(torch.uint8)
                            if b.dtype == quant.FP8 else b) for a, b in zip(got, want, strict=True)])
            experts.reshard()
        held = sum(st.q.numel() * st.q.element_size() + 4 * st.shape.numel() // (128 * 128) for st in states)
        planned = fp8_gathered_shard_bytes(trainer.cfg.model, trainer.cfg.parallel.dims(world))
        out[gather] = dict(losses=losses, bytes=bytes_per_step, params=params, seen=seen, held=(held, planned),
                           quantisations=[s.quantisations for s in states], dims=[s.dim for s in states],
                           rows=[s.fsdp_param.padded_sharded_param_size[s.dim] for s in states],
                           blocks_equal=blocks_equal)
        trainer.close()
    return out


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    return run_distributed(_train, 2, str(tmp_path_factory.mktemp("pg")), timeout=600)


def test_fp8_gather_trains_bitwise_as_the_bf16_gather_on_two_ranks(two_runs):
    for rank in two_runs:
        off, on = rank[False], rank[True]
        assert on["losses"] == off["losses"] and len(set(on["losses"])) == 3
        assert on["params"].keys() == off["params"].keys()
        for name, value in off["params"].items():
            assert torch.equal(on["params"][name], value), name
        from spartron.layers.fp8.gathered import GatheredFP8Weight
        assert GatheredFP8Weight in on["seen"] and GatheredFP8Weight not in off["seen"]


def test_each_fp8_weight_is_quantised_once_per_step_and_its_blocks_equal_the_bf16_weights(two_runs):
    on = two_runs[0][True]
    # every FP8-run weight (dense linears, FFNs, experts of 3 MoE layers + MTP), once at set-up and once a step
    assert len(on["quantisations"]) > 0 and set(on["quantisations"]) == {4}
    # both layouts: rows split inside a 128-row block (dense [N, 128] over 2: 64 rows) and whole experts
    assert 0 in on["dims"] and any(r % 128 for r in on["rows"]) and any(r % 128 == 0 for r in on["rows"])
    assert on["blocks_equal"] == (True, [True] * 8)


def test_the_fp8_weights_cross_the_wire_as_one_byte_elements(two_runs):
    off, on = two_runs[0][False], two_runs[0][True]
    for before, after in zip(off["bytes"], on["bytes"], strict=True):
        assert "torch.float8_e4m3fn" not in before
        # the FP8 weights' bytes halve: the step's all-gathered bytes fall by what the FP8 weights weighed in bf16
        assert sum(after.values()) < 0.75 * sum(before.values())


def _run(cfg, steps: int = 3) -> tuple[float, dict]:
    from spartron.runtime.trainer import Trainer

    trainer = Trainer(cfg).setup()
    while trainer.step_no < steps:
        loss = trainer.step()["loss"]
    params = _full(trainer.model)
    trainer.close()
    return loss, params


def _resume(rank, world, root: str):
    whole = _run(_cfg(f"{root}/whole", True, 3))
    _run(_cfg(f"{root}/split", True, 3, "train.save_every=2"), steps=2)  # saves step 2, stops there
    split = _run(_cfg(f"{root}/split", True, 3, "train.save_every=2"))
    _run(_cfg(f"{root}/mixed", False, 3, "train.save_every=2"), steps=2)  # saved by a bf16-gather run
    mixed = _run(_cfg(f"{root}/mixed", True, 3, "train.save_every=2"))
    return whole, split, mixed


def test_a_saved_step_resumes_bitwise_and_a_bf16_gather_run_resumes_with_it(tmp_path):
    for (loss, params), *resumed in run_distributed(_resume, 2, str(tmp_path), timeout=600):
        for other_loss, other in resumed:
            assert other_loss == loss and other.keys() == params.keys()
            for name, value in params.items():
                assert torch.equal(other[name], value), name


def test_a_mirrored_rehearsal_of_eight_ranks_trains_as_without_it():
    """The shards' scales come from an all-gather of position-free local maxima, so a rehearsal's mirrored group
    (every slot the local shard) gives what identical shards give: the losses of the bf16 gather, bitwise
    (an all-reduce MAX of grids each rank fills where its rows fall left the other ranks' blocks at amax 0)."""
    from spartron.launch.rehearse import run_rehearsal

    losses = {}
    for gather in (False, True):
        cfg = load_config("configs/tiny.toml", [*_OVERRIDES[:-1], "parallel.ep=2", "train.global_batch_size=32",
                                                f"model.fp8.param_gather={str(gather).lower()}"])
        run = run_rehearsal(cfg, 8, 0, 2, balanced=True)
        losses[gather] = [step["record"]["loss"] for step in run["steps"]]
    assert losses[True] == losses[False]


def test_the_memory_plan_counts_the_e4m3_shards_and_scales_each_rank_holds(two_runs):
    for rank in two_runs:
        held, planned = rank[True]["held"]
        assert held == planned > 0
        assert rank[False]["held"] == (0, 0)


def test_gathered_operands_hand_each_gemms_joint_blocks_once_and_refuse_a_mix():
    """A pair's two weights share one JointBlocks: the ops get its blocks once, then w2's; plain weights pass."""
    from spartron.layers.fp8.gathered import GatheredFP8Weight, JointBlocks, gathered_operands
    from spartron.layers.fp8.quant import FP8

    pair, single = JointBlocks([torch.Size([2, 128, 256])] * 2), JointBlocks([torch.Size([2, 256, 128])])
    for joint in (pair, single):
        for i, shape in enumerate(joint.shapes):
            joint.set_scales(i, torch.ones(*shape[:-2], shape[-2] // 128, shape[-1] // 128))
            joint.write(i, torch.zeros(shape, dtype=FP8))
    w1, w3 = (GatheredFP8Weight(pair.shapes[i], torch.bfloat16, torch.device("cpu"), pair) for i in (0, 1))
    w2 = GatheredFP8Weight(single.shapes[0], torch.bfloat16, torch.device("cpu"), single)
    weights, cached = gathered_operands([w1, w3, w2])
    assert [tuple(w.shape) for w in weights] == [(2, 128, 256), (2, 128, 256), (2, 256, 128)]
    assert all(w.stride() == (0, 0, 0) for w in weights)  # stand-ins: no storage read
    def same(a, b):  # the same tensor, or the same view of it (s^T is a fresh transpose per call)
        return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype)

    assert all(same(a, b) for a, b in zip(cached, [*pair.blocks(), *single.blocks()], strict=True))
    plain = torch.zeros(2, 128, 256, dtype=torch.bfloat16)
    assert gathered_operands([plain]) == ([plain], [])
    with pytest.raises(RuntimeError, match="model.fp8.param_gather: one module's weights are partly FP8-gathered"):
        gathered_operands([w1, plain])


@pytest.mark.parametrize("shapes", [[torch.Size([384, 256])], [torch.Size([256, 384])] * 2])
def test_gathered_dense_blocks_have_the_weight_caches_layout(shapes):
    """A dense weight's gathered blocks in the ops' one-group form ([1, N, K]) have the shapes and strides of the
    weight cache's (quantize_blocks_both of the unsqueezed weight): DeepGEMM's dgrad asserts that s^T's group
    stride is the whole scale grid (an H100 rehearsal with param_gather failed there when s^T was a transposed
    view unsqueezed: group stride K/128)."""
    from spartron.layers.fp8 import reference
    from spartron.layers.fp8.gathered import JointBlocks

    joint = JointBlocks(shapes)
    weights = [torch.randn(s) for s in shapes]
    for i, w in enumerate(weights):
        want = reference.quantize_blocks_cat((w,), True)
        joint.set_scales(i, want[1])
        joint.write(i, want[0])
    got = joint.blocks(lead=True)
    cache = reference.quantize_blocks_both(tuple(w.unsqueeze(0) for w in weights), True)
    assert [(tuple(t.shape), t.stride()) for t in got] == [(tuple(t.shape), t.stride()) for t in cache]
    s_t = got[3]
    assert s_t.stride(-3) == s_t.size(-2) * s_t.size(-1)
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(got, cache, strict=True))


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("joint", [True, False])
def test_place_gathered_kernel_writes_both_places_as_the_torch_copies(joint):
    """JointBlocks.write on CUDA: one Triton kernel puts the gathered E4M3 values in the pair's joint operand
    and, transposed, in dgrad's operand; the bytes equal the torch copies (CPU path) and nothing else is
    written (the other weight's columns keep their sentinel)."""
    from spartron.layers.fp8 import triton_backend
    from spartron.layers.fp8.quant import FP8

    g = torch.Generator().manual_seed(0)
    total, start = (512, 256) if joint else (256, 0)
    q = torch.randint(0, 255, (2, 256, 384), generator=g, dtype=torch.uint8).view(FP8).to(KERNEL_DEVICE)
    out = torch.full((2, total, 384), 7, dtype=torch.uint8, device=KERNEL_DEVICE).view(FP8) if joint else None
    out_t = torch.full((2, 384, total), 7, dtype=torch.uint8, device=KERNEL_DEVICE).view(FP8)
    want_t = out_t.view(torch.uint8).clone()
    want_t[..., start:start + 256] = q.view(torch.uint8).transpose(-2, -1)
    triton_backend.place_gathered(q, out, out_t, start)
    assert torch.equal(out_t.view(torch.uint8), want_t)
    if joint:
        want = torch.full((2, total, 384), 7, dtype=torch.uint8, device=KERNEL_DEVICE)
        want[:, start:start + 256] = q.view(torch.uint8)
        assert torch.equal(out.view(torch.uint8), want)
