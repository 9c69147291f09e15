"""model.fp8.weight_cache (spartron.layers.fp8.weight_cache) on CPU, reference backend: a cached step
equals an uncached one bitwise, the cache refreshes after an optimizer step (explicitly: a write the
version counter cannot see leaves it stale otherwise), AC replays reuse it, and the option resolves
and validates as documented."""

from __future__ import annotations

import pytest
import torch

from spartron.checkpointing.config import ACConfig
from spartron.configbase import ConfigError
from spartron.layers.config import FP8Config
from spartron.layers.fp8 import apply_fp8, invalidate_on_step, invalidate_weight_caches
from spartron.layers.fp8.apply import weight_cache_on
from spartron.layers.model import build_model
from spartron.layers.moe.experts import GroupedExperts
from spartron.layers.parallelize import parallelize
from spartron.runtime.config import load_config

COUNTS = [130, 0, 254]


def _experts(cache: str, seed: int = 0) -> GroupedExperts:
    torch.manual_seed(seed)
    experts = GroupedExperts(3, 256, 128, mode="loop", dtype=torch.bfloat16)
    apply_fp8([experts], FP8Config(backend="reference", modules=["experts"], weight_cache=cache))
    return experts


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(384, 256, generator=g).bfloat16(), torch.randn(384, 256, generator=g).bfloat16()


def _step(experts, seed: int):
    x, grad = _batch(seed)
    x.requires_grad_()
    out = experts(x, COUNTS)
    out.backward(grad)
    return out.detach(), x.grad


def _new_weights(experts) -> dict[str, torch.Tensor]:
    return {n: (p.detach() * 1.5 + 0.01).bfloat16() for n, p in experts.named_parameters()}


def test_cached_micro_batches_equal_uncached_bitwise_and_quantise_once():
    cached, plain = _experts("on"), _experts("off")
    assert plain.fp8_cache is None
    for seed in (1, 2):  # two micro-batches of one step: forward, backward, forward, backward
        for a, b in zip(_step(cached, seed), _step(plain, seed), strict=True):
            assert torch.equal(a, b)
    for name in ("w1", "w3", "w2"):
        assert torch.equal(getattr(cached, name).grad, getattr(plain, name).grad), name
    assert cached.fp8_cache.refreshes == 1
    # the cache holds q, s, q^T, s^T of w1, w3, w2: 1 byte an element twice, plus fp32 scales
    weights = 3 * 3 * 128 * 256
    assert cached.fp8_cache.nbytes == 2 * weights + 2 * 4 * weights // (128 * 128)


def test_a_write_the_version_counter_misses_needs_the_explicit_invalidation():
    """FSDP2's all-gather (version preserved) and TritonAdamW (a kernel) write weights without a version
    bump; `.data` does the same here. Without invalidation the cache would be stale: a silent numerics bug."""
    cached, plain = _experts("on"), _experts("off")
    before = _step(cached, 1)[0]
    new = _new_weights(cached)
    for module in (cached, plain):
        for name, p in module.named_parameters():
            p.data.copy_(new[name])
    stale = _step(cached, 1)[0]
    assert torch.equal(stale, before)  # the key did not see it: this is why invalidation is explicit
    assert invalidate_weight_caches(cached) == 1
    fresh = _step(cached, 1)[0]
    assert torch.equal(fresh, _step(plain, 1)[0]) and not torch.equal(fresh, before)
    assert cached.fp8_cache.refreshes == 2


def test_the_step_hook_refreshes_after_an_optimizer_that_writes_through_a_kernel():
    class KernelLikeSGD(torch.optim.SGD):  # writes as a Triton kernel does: no version bump
        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.data.copy_(p.data - group["lr"] * p.grad)

    cached, plain = _experts("on"), _experts("off")
    opts = [KernelLikeSGD(m.parameters(), lr=0.5) for m in (cached, plain)]
    invalidate_on_step(opts[0], cached)
    for module, opt in zip((cached, plain), opts, strict=True):
        _step(module, 1)
        opt.step()
    assert torch.equal(cached.w1, plain.w1) and not torch.equal(cached.w1, _experts("off").w1)
    assert torch.equal(_step(cached, 2)[0], _step(plain, 2)[0])
    assert cached.fp8_cache.refreshes == 2


def test_an_in_place_torch_write_or_a_load_refreshes_by_itself():
    cached, plain = _experts("on"), _experts("off")
    _step(cached, 1)
    with torch.no_grad():  # a version bump: the key sees it
        for module in (cached, plain):
            module.w2.mul_(2)
    assert torch.equal(_step(cached, 1)[0], _step(plain, 1)[0])
    assert cached.fp8_cache.refreshes == 2
    state = {k: v * 0.5 for k, v in plain.state_dict().items()}
    cached.load_state_dict(state)
    assert cached.fp8_cache.nbytes == 0  # the load hook dropped it
    plain.load_state_dict(state)
    assert torch.equal(_step(cached, 3)[0], _step(plain, 3)[0])


def _model_grads(cache: str, ac: ACConfig):
    cfg = load_config("configs/tiny.toml", ["train.seq_len=32", "model.dtype=bfloat16", "model.dim=128",
                                            "model.moe.moe_inter_dim=128", "model.dense_inter_dim=256",
                                            "model.fp8.backend=reference", f"model.fp8.weight_cache={cache}"])
    model = build_model(cfg.model, seed=0)
    parallelize(model, None, ac, fp8=cfg.model.fp8)
    g = torch.Generator().manual_seed(1)
    out = model(*(torch.randint(0, cfg.model.vocab_size, (2, 32), generator=g) for _ in range(2)))
    out["loss"].backward()
    refreshes = [m.fp8_cache.refreshes for m in model.modules() if getattr(m, "fp8_cache", None) is not None]
    return out["loss"].detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, refreshes


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_ac_replays_reuse_the_cache_and_give_the_uncached_gradients(mode):
    loss, grads, none = _model_grads("off", ACConfig(mode="none"))
    ac_loss, ac_grads, refreshes = _model_grads("on", ACConfig(mode=mode))
    assert none == [] and len(refreshes) >= 1 and set(refreshes) == {1}  # the replay quantised nothing again
    assert torch.equal(loss, ac_loss) and grads.keys() == ac_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, ac_grads[name]), name


def test_the_option_resolves_and_refuses_on_with_compile():
    auto = FP8Config(backend="reference")
    assert weight_cache_on(auto, compiled=False, expert_shards=1)
    assert not weight_cache_on(auto, compiled=False, expert_shards=2)  # FSDP-sharded experts: off
    assert not weight_cache_on(auto, compiled=True, expert_shards=1)
    assert weight_cache_on(FP8Config(backend="reference", weight_cache="on"), compiled=False, expert_shards=4)
    assert not weight_cache_on(FP8Config(backend="reference", weight_cache="off"), compiled=False, expert_shards=1)
    with pytest.raises(ConfigError, match=r"model.fp8.weight_cache = 'on' with train.compile = true"):
        weight_cache_on(FP8Config(backend="reference", weight_cache="on"), compiled=True, expert_shards=1)
    with pytest.raises(ValueError, match="weight_cache"):
        FP8Config(weight_cache="yes")


def test_the_memory_plan_counts_the_cache_where_it_resolves_on():
    from spartron.layers.step_memory import StepShape, fp8_weight_cache_bytes, memory_plan
    from spartron.parallel.dims import ParallelDims

    def model(cache: str):
        return load_config("configs/tiny.toml", ["model.dtype=bfloat16", "model.dim=128", "model.moe.moe_inter_dim=128",
                                                 "model.dense_inter_dim=256", f"model.fp8.weight_cache={cache}"]).model

    m, one, step = model("auto"), ParallelDims(world_size=1, fsdp=1), StepShape(seq_len=32, micro_batch_size=2)
    elements = 4 * 8 * 3 * 128 * 128  # 3 MoE decoder layers + the shared MTP block, 8 experts, w1 / w3 / w2
    assert fp8_weight_cache_bytes(m, one) == 2 * elements + 8 * elements // (128 * 128)
    on, off = memory_plan(m, one, step), memory_plan(model("off"), one, step)
    assert on.parts["fp8_weight_cache"] == fp8_weight_cache_bytes(m, one) and "fp8_weight_cache" not in off.parts
    assert on.peak - off.peak == fp8_weight_cache_bytes(m, one)
    sharded = ParallelDims(world_size=2, fsdp=2)  # experts sharded over expert_fsdp 2: auto is off
    assert fp8_weight_cache_bytes(m, sharded) == 0 and fp8_weight_cache_bytes(model("on"), sharded) == 2 * (
        2 * elements + 8 * elements // (128 * 128)) // 2
    # the last decoder layer kept in bf16 (model.fp8.layers_at_end_in_bf16) has no cache: 3 of the 4 expert sets
    kept = load_config("configs/tiny.toml", ["model.dtype=bfloat16", "model.dim=128", "model.moe.moe_inter_dim=128",
                                             "model.fp8.layers_at_end_in_bf16=1"]).model
    assert fp8_weight_cache_bytes(kept, one) == 3 * (2 * elements + 8 * elements // (128 * 128)) // 4


def _trainer_losses(rank, world, root):
    from spartron.layers.fp8.modules import FP8GroupedExperts
    from spartron.runtime.trainer import Trainer

    out = {}
    for cache in ("on", "off"):
        cfg = load_config("configs/tiny.toml", [
            "train.steps=3", "train.progress=false", "train.peak_tflops=1.0", f"train.run_dir={root}/{cache}",
            "train.lr=3e-3", "train.warmup_steps=0", "train.seq_len=32", "model.dtype=bfloat16",
            "model.master_dtype=float32", "model.dim=128", "model.moe.moe_inter_dim=128", "model.dense_inter_dim=256",
            "model.fp8.backend=reference", f"model.fp8.weight_cache={cache}"])
        trainer = Trainer(cfg).setup()
        experts = [m for m in trainer.model.modules() if isinstance(m, FP8GroupedExperts)]
        losses, held = [], []
        for _ in range(3):
            losses.append(trainer.step()["loss"])
            held.append(sum(m.fp8_cache.nbytes for m in experts if m.fp8_cache is not None))
        out[cache] = dict(losses=losses, held=held, cached=sum(m.fp8_cache is not None for m in experts))
        trainer.close()
    return out


def test_the_trainer_invalidates_after_each_step_under_fsdp2_masters(tmp_path):
    """fp32 masters on one rank (FSDP2 all-gathers the bf16 weights, version preserved): the Trainer drops
    every cache after each optimizer step (held 0: fails without its invalidate_weight_caches call) and
    trains as without the cache, bitwise. (Here FSDP2's re-allocated storage also changes the key's
    data_ptr; the explicit rule is what does not depend on the allocator.)"""
    from spartron.testing import run_distributed

    (r,) = run_distributed(_trainer_losses, 1, str(tmp_path), timeout=240)
    assert r["on"]["cached"] >= 1 and r["off"]["cached"] == 0
    assert r["on"]["held"] == [0, 0, 0]  # dropped after every optimizer step
    assert r["on"]["losses"] == r["off"]["losses"] and len(set(r["on"]["losses"])) == 3
