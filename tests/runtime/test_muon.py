"""Distributed Muon (spartron.runtime.muon) against a plain one-rank Muon written here: the tiny model's
real layouts (FSDP2, EP2, EP2 x FSDP2, experts split on their inner dim) on gloo ranks, the same gradients
(functions of each tensor's global name and the step), three steps, every parameter equal to 1e-6; each
matrix orthogonalised once in the world; no host sync in the step."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from spartron.runtime.config import load_config
from spartron.runtime.muon import MuonWithAdamW
from spartron.runtime.rank_setup import RankModel, RankPlace, default_model_factory
from spartron.testing import run_distributed

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
LR, WD, STEPS = 0.02, 0.1, 3

# What reads a tensor's value on the host (item, float, bool, data-dependent shapes).
HOST_SYNC_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
                 torch.ops.aten.equal.default, torch.ops.aten.nonzero.default,
                 torch.ops.aten.masked_select.default, torch.ops.aten.allclose.default}


class NoHostSync(TorchDispatchMode):
    """Raises on any operator that makes the host wait for a tensor's value."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in HOST_SYNC_OPS:
            raise AssertionError(f"host sync in the optimizer step: {func}")
        return func(*args, **(kwargs or {}))


def _grad(name: str, shape: list[int], step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 10 + step)
    return torch.randn(shape, generator=gen)


def _full(param: torch.Tensor, ep_sharded: bool, ep_group, ep: int) -> torch.Tensor:  # noqa: ANN001
    """The 1-rank tensor of `param`: its FSDP shards gathered, then its EP ranks' experts."""
    whole = param.full_tensor() if isinstance(param, DTensor) else param.detach().clone()
    if not ep_sharded or ep == 1:
        return whole
    parts = [torch.empty_like(whole) for _ in range(ep)]
    dist.all_gather(parts, whole.contiguous(), group=ep_group)
    return torch.cat(parts)


def _skipped(name: str, step: int) -> bool:
    """No gradient (as the DSA indexer before its loss starts): the optimizer leaves such a tensor alone."""
    return ".indexer." in name and step == 1


def _set_grad(param: torch.Tensor, full: torch.Tensor, ep: int, ep_rank: int | None) -> None:
    """param.grad = this rank's part of the global gradient `full` (its experts, then its FSDP shard)."""
    if ep_rank is not None:
        full = full.chunk(ep)[ep_rank]
    if isinstance(param, DTensor):
        param.grad = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    else:
        param.grad = full.clone()


def _distributed(rank, world, extra: tuple[str, ...]):
    cfg = load_config(TINY, [f"train.lr={LR}", f"train.weight_decay={WD}", 'train.optimizer="muon"', *extra])
    place = RankPlace.of(cfg)
    built = RankModel.build(cfg, place, default_model_factory)
    model, opt, groups = built.model, built.optimizer, place.groups
    assert isinstance(opt, MuonWithAdamW)
    ep, ep_names = groups.size("ep"), set(built.ep_state["ep_sharded"])
    ep_rank = groups.rank_in("ep") if ep > 1 else None

    def full_state() -> dict[str, torch.Tensor]:
        return {n: _full(p, n in ep_names, groups.ep if ep > 1 else None, ep) for n, p in model.named_parameters()}

    initial, counts = full_state(), []
    for step in range(1, STEPS + 1):
        for name, p in model.named_parameters():
            if _skipped(name, step):
                p.grad = None
                continue
            _set_grad(p, _grad(name, list(initial[name].shape), step), ep, ep_rank if name in ep_names else None)
        with NoHostSync():
            opt.step()
        counts.append(opt.orthogonalized)
        opt.zero_grad(set_to_none=True)
    def plain(state: dict[str, torch.Tensor]) -> dict:  # by value: a tensor would pass a shared-memory handle
        return {n: t.detach().numpy() for n, t in state.items()}

    return plain(initial), plain(full_state()), counts


def _reference_muon(weights: dict[str, torch.Tensor], vocab: int) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The plain Muon: every full matrix and every expert orthogonalised by itself, AdamW step by step."""
    a, b, c = 3.4445, -4.7750, 2.0315

    def ns(g: torch.Tensor) -> torch.Tensor:
        x = g.T if g.shape[0] > g.shape[1] else g
        x = x / (x.norm() + 1e-7)
        for _ in range(5):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.T if g.shape[0] > g.shape[1] else x

    w = {n: t.clone() for n, t in weights.items()}
    state: dict[str, dict] = {n: {} for n in w}
    matrices = []  # per step
    for step in range(1, STEPS + 1):
        matrices.append(0)
        for name, p in w.items():
            if _skipped(name, step):
                continue
            g, s = _grad(name, list(p.shape), step), state[name]
            muon = p.ndim in (2, 3) and vocab not in p.shape[-2:]
            p.mul_(1 - LR * (WD if p.ndim >= 2 else 0.0))
            if muon:
                buf = s.setdefault("buf", torch.zeros_like(g)).mul_(0.95).add_(g)
                update = g + 0.95 * buf
                for m, u in zip(p.view(-1, *p.shape[-2:]), update.view(-1, *p.shape[-2:]), strict=True):
                    m.sub_(LR * max(1.0, u.shape[0] / u.shape[1]) ** 0.5 * ns(u))
                    matrices[-1] += 1
                continue
            s["m"] = s.get("m", torch.zeros_like(g)) * 0.9 + 0.1 * g
            s["v"] = s.get("v", torch.zeros_like(g)) * 0.95 + 0.05 * g * g
            s["step"] = s.get("step", 0) + 1
            p.sub_(LR / (1 - 0.9 ** s["step"]) * s["m"] / ((s["v"] / (1 - 0.95 ** s["step"])).sqrt() + 1e-8))
    return w, matrices


LAYOUTS = [
    pytest.param(1, (), id="one-rank"),
    pytest.param(2, (), id="fsdp2"),
    pytest.param(2, ("parallel.ep=2",), id="ep2"),
    pytest.param(4, ("parallel.ep=2",), id="ep2xfsdp2"),
    # 6 experts: 3 per EP rank do not split over expert_fsdp 2, so FSDP2 shards them on dim 1 (gathered)
    pytest.param(4, ("parallel.ep=2", "model.moe.n_routed_experts=6"), id="ep2xfsdp2-experts-dim1"),
    # HSDP: each of the 2 replicas orthogonalises every matrix once over its own 2 ranks
    pytest.param(4, ("parallel.dp_replicate=2",), id="hsdp2xfsdp2"),
]


@pytest.mark.parametrize(("world", "extra"), LAYOUTS)
def test_distributed_muon_equals_the_one_rank_reference(world, extra):
    results = run_distributed(_distributed, world, extra, timeout=240)
    initial, final = ({n: torch.from_numpy(a) for n, a in d.items()} for d in results[0][:2])
    cfg = load_config(TINY, list(extra))
    assert cfg.train.beta1 == 0.9 and cfg.train.beta2 == 0.95  # the reference's constants
    want, matrices = _reference_muon(initial, cfg.model.vocab_size)
    assert final.keys() == want.keys()
    for name in want:
        assert not torch.equal(final[name], initial[name]), name
        torch.testing.assert_close(final[name], want[name], rtol=0, atol=1e-6, msg=name)
    # each matrix (an expert counts once) orthogonalised once in the world, every step
    experts = cfg.model.moe.n_routed_experts
    assert matrices[-1] == sum(1 if t.ndim == 2 else experts for n, t in initial.items()
                               if t.ndim in (2, 3) and cfg.model.vocab_size not in t.shape[-2:])
    assert matrices[0] < matrices[-1]  # the indexer had no gradient at step 1
    replicas = cfg.parallel.dp_replicate
    assert [sum(r[2][s] for r in results) for s in range(STEPS)] == [replicas * m for m in matrices]
    if world > replicas:  # the work is spread: no rank does more than 60% of its replica's
        assert max(r[2][-1] for r in results) < 0.6 * matrices[-1], [r[2] for r in results]


def test_the_host_sync_check_catches_item_and_torchs_own_adamw():
    with pytest.raises(AssertionError, match="_local_scalar_dense"), NoHostSync():
        torch.ones(2).sum().item()
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = torch.optim.AdamW([p], foreach=False)  # its single-tensor path reads the step on the host
    with pytest.raises(AssertionError, match="host sync"), NoHostSync():
        opt.step()


def test_the_optimizer_switch_is_validated_and_selects_distributed_muon_for_experts_too():
    from spartron.layers.model import build_model
    from spartron.runtime.config import ConfigError, config_from_dict
    from spartron.runtime.optim import build_optimizer

    with pytest.raises(ConfigError, match=r"train\.optimizer: Input should be 'adamw' or 'muon' \(got 'lion'\)"):
        config_from_dict({"train": {"optimizer": "lion"}})
    cfg = load_config(TINY, ['train.optimizer="muon"'])
    model = build_model(cfg.model, seed=0)
    opt = build_optimizer(model, cfg.train)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = sorted(names[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"])
    assert isinstance(opt, MuonWithAdamW)
    assert "layers.1.ffn.experts.w1" in muon and "layers.1.attn.wo.weight" in muon
    assert not {"embed.weight", "head.weight", "norm.weight"} & set(muon)
    assert all(".experts." in n or model.get_parameter(n).ndim == 2 for n in muon)


def test_muon_ns_dtype_is_validated_and_runs_newton_schulz_in_bfloat16_for_float32_parameters():
    """train.muon_ns_dtype = "bfloat16" with float32 parameters (as fp32 masters have): each matrix moves by
    lr x scale x NS in bfloat16 of its Nesterov update, the rest of the step in float32."""
    from spartron.layers.model import build_model
    from spartron.runtime.config import ConfigError
    from spartron.runtime.muon import newton_schulz_orthogonalize
    from spartron.runtime.optim import build_optimizer

    with pytest.raises(ConfigError, match=r"train\.muon_ns_dtype = 'bfloat16' needs train\.optimizer = 'muon' "
                                          r"\(got 'adamw', which would ignore it\)"):
        load_config(TINY, ['train.muon_ns_dtype="bfloat16"'])
    cfg = load_config(TINY, ['train.optimizer="muon"', 'train.muon_ns_dtype="bfloat16"'])
    model = build_model(cfg.model, seed=0)
    opt = build_optimizer(model, cfg.train)
    assert opt.ns_dtype is torch.bfloat16
    assert build_optimizer(model, load_config(TINY, ['train.optimizer="muon"']).train).ns_dtype is None
    names = {id(p): n for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = _grad(names[id(p)], list(p.shape), 1)
    p = model.get_parameter("layers.1.attn.wo.weight")
    assert p.dtype == torch.float32 and any(p is q for g in opt.param_groups if g["muon"] for q in g["params"])
    before, g = p.detach().clone(), p.grad.clone()
    lr, wd = opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"]
    scale = max(1.0, p.shape[0] / p.shape[1]) ** 0.5
    update = torch.add(g, g, alpha=0.95)  # Nesterov on a fresh buffer: g + 0.95 x (0.95 x 0 + g)
    opt.step()
    ortho = newton_schulz_orthogonalize(update, 5, torch.bfloat16)
    assert ortho.dtype == torch.float32
    assert torch.equal(p.detach(), before.mul(1 - lr * wd).add_(ortho, alpha=-lr * scale))
    in_fp32 = newton_schulz_orthogonalize(update, 5)
    assert not torch.equal(ortho, in_fp32)  # the iteration ran in bfloat16, not in float32
    torch.testing.assert_close(ortho, in_fp32, rtol=0, atol=0.02)  # bfloat16's rounding of the same iteration


def test_a_resume_that_changes_muon_ns_dtype_says_so_and_an_older_step_says_nothing():
    from spartron.runtime.saved_config import state_config, training_notes

    saved = state_config(load_config(TINY, ['train.optimizer="muon"']))
    now = state_config(load_config(TINY, ['train.optimizer="muon"', 'train.muon_ns_dtype="bfloat16"']))
    assert training_notes(saved, now) == [
        "spartron: note: train.muon_ns_dtype changed on resume: the saved step trained with 'auto', this run uses "
        "'bfloat16'"]
    older = {k: v for k, v in saved.items() if k != "train.muon_ns_dtype"}  # saved before the key was recorded
    assert training_notes(older, now) == []
