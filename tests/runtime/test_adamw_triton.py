"""train.adamw_kernel: config errors, the clip-and-step rule, and TritonAdamW equal to torch's AdamW.

The kernel tests run on CUDA, or on the CPU through Triton's interpreter
(with triton installed: `TRITON_INTERPRET=1 python -m pytest -q tests/runtime/test_adamw_triton.py`); CI
has no triton and skips them. fp32 is held to fp32 rounding against torch's AdamW, fp16 to one fp16 ulp against
torch's fused AdamW (numpy rounds correctly); the interpreter rounds float32 -> bfloat16 by truncation, so on the
CPU the bfloat16 case is one step held to one bfloat16 ulp (the GPU tests hold it over several steps).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from triton_device import DEVICE, HAS_TRITON, INTERPRET, needs_kernel  # tests/triton_device.py

from spartron.optional import MissingDependencyError
from spartron.runtime.config import ConfigError, TrainConfig, config_from_dict
from spartron.runtime.optim import build_optimizer, clip_and_step_, clip_coefficient
from spartron.testing import run_distributed

KEYS = ("exp_avg", "exp_avg_sq")
SHAPES = [(3, 5), (17,), (64, 33), (1,), (0, 4), (300,)]  # sizes off every block, one empty tensor


def test_unknown_adamw_kernel_is_an_error_naming_the_key():
    with pytest.raises(ConfigError,
                       match=r"train.adamw_kernel: Input should be 'auto', 'torch' or 'triton' \(got 'cuda'\)"):
        config_from_dict({"train": {"adamw_kernel": "cuda"}})


@pytest.mark.parametrize("kernel", ["triton", "torch"])
def test_a_chosen_adamw_kernel_with_muon_is_an_error(kernel):
    """Muon's AdamW part (vectors, embeddings) is its own loop: either choice would be ignored."""
    with pytest.raises(ConfigError, match=rf"train.adamw_kernel = '{kernel}' needs train.optimizer = 'adamw' "
                                          r"\(got 'muon', which would ignore it\)"):
        config_from_dict({"train": {"adamw_kernel": kernel, "optimizer": "muon"}})


def test_auto_is_the_default_and_takes_torchs_adamw_for_cpu_parameters():
    from spartron.runtime.adamw_triton import TritonAdamW

    cfg = TrainConfig()
    assert cfg.adamw_kernel == "auto"
    optimizer = build_optimizer(nn.Linear(4, 4), cfg)
    assert type(optimizer) is torch.optim.AdamW and not isinstance(optimizer, TritonAdamW)
    assert config_from_dict({"train": {"optimizer": "muon"}}).train.adamw_kernel == "auto"  # no error with Muon


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda" or not HAS_TRITON, reason="needs CUDA and triton: 'auto' picks TritonAdamW there")
def test_auto_takes_triton_adamw_for_cuda_parameters():
    from spartron.runtime.adamw_triton import TritonAdamW

    assert type(build_optimizer(nn.Linear(4, 4, device="cuda"), TrainConfig())) is TritonAdamW


def test_triton_adamw_on_cpu_parameters_is_an_error():
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"train.adamw_kernel = 'triton' needs CUDA parameters and the triton "
                                         r"package; the parameters are on cpu \(use 'torch'\)"):
        build_optimizer(model, TrainConfig(adamw_kernel="triton"))


@pytest.mark.skipif(HAS_TRITON, reason="checks the message a CPU install without triton gives")
def test_triton_adamw_without_triton_names_the_option_and_the_install():
    from spartron.runtime.adamw_triton import TritonAdamW

    with pytest.raises(MissingDependencyError,
                       match=r"train.adamw_kernel = 'triton' \(or 'auto' with CUDA parameters\) needs the "
                             r"Python package 'triton'.*pip install triton"):
        TritonAdamW([nn.Parameter(torch.zeros(2))])


def test_clip_and_step_clips_only_above_max_norm():
    """Below max_norm the gradients are untouched; above, scaled by max_norm / (norm + 1e-6); 0 never clips."""
    for max_norm, norm, expect in [(1.0, 0.5, 1.0), (1.0, 4.0, 1.0 / (4.0 + 1e-6)), (0.0, 4.0, 1.0)]:
        p = nn.Parameter(torch.zeros(3))
        p.grad = torch.tensor([1.0, -2.0, 3.0])
        opt = torch.optim.SGD([p], lr=1.0)
        clip_and_step_(opt, [p], max_norm, torch.tensor(norm), norm)
        clipped = torch.tensor([1.0, -2.0, 3.0]) * torch.tensor(expect, dtype=torch.float32)
        assert torch.equal(p.grad, clipped) and torch.equal(p.detach(), -clipped)  # clipped, then stepped
    assert clip_coefficient(1.0, torch.tensor(3.0)).item() == pytest.approx(1 / 3.000001, rel=1e-7)


def _params(dtype: torch.dtype, seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g).to(DEVICE, dtype)) for s in SHAPES]


def _groups(params: list[nn.Parameter]) -> list[dict]:
    return [{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:], "weight_decay": 0.0}]


def _run(ref_opt, mine_opt, ref, mine, dtype, steps=4, coef=0.37, clip_ref=True):  # noqa: ANN001
    g = torch.Generator().manual_seed(1)
    scale = torch.tensor(coef, device=DEVICE)
    for _ in range(steps):
        for p, q in zip(ref, mine, strict=True):
            grad = torch.randn(p.shape, generator=g).to(DEVICE, dtype)
            p.grad = grad * scale.to(dtype) if clip_ref else grad.clone()
            q.grad = grad
        ref_opt.step()
        mine_opt.step(grad_scale=scale)


def _assert_states_close(ref_opt, mine_opt, ref, mine, **tol):  # noqa: ANN001
    for p, q in zip(ref, mine, strict=True):
        torch.testing.assert_close(q, p, **tol)
        a, b = ref_opt.state[p], mine_opt.state[q]
        assert b["step"].dtype == torch.float32 and b["step"].device == q.device
        assert b["step"].item() == a["step"].item()
        torch.testing.assert_close(b["exp_avg"], a["exp_avg"], **tol)
        torch.testing.assert_close(b["exp_avg_sq"], a["exp_avg_sq"], **tol)


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("kernel", [dict(block=16, iters=2), dict(block=32, iters=1, per_tensor_min_numel=100)])
def test_fp32_equals_torch_adamw_with_clipped_grads(kernel):
    """Several steps, two groups (decay / none), mixed shapes: torch.optim.AdamW (foreach=False) on gradients
    clipped first, to fp32 rounding; one launch for all tensors, or the large ones on their own."""
    from spartron.runtime.adamw_triton import AdamWKernelConfig, TritonAdamW

    ref, mine = _params(torch.float32), _params(torch.float32)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2, betas=(0.9, 0.95), foreach=False)
    mine_opt = TritonAdamW(_groups(mine), lr=1e-2, betas=(0.9, 0.95), kernel=AdamWKernelConfig(**kernel))
    _run(ref_opt, mine_opt, ref, mine, torch.float32)
    _assert_states_close(ref_opt, mine_opt, ref, mine, rtol=1e-6, atol=1e-7)
    assert not torch.equal(ref[0].detach(), _params(torch.float32)[0].detach())  # it did train


@pytest.mark.gpu
@needs_kernel
def test_table_and_per_tensor_launches_compute_the_same_update():
    """One launch for all tensors, one per tensor, or mixed: the same update (bitwise under the interpreter;
    on the GPU two compiled kernels may contract multiply-adds differently)."""
    from spartron.runtime.adamw_triton import AdamWKernelConfig, TritonAdamW

    runs = []
    for kernel in (AdamWKernelConfig(block=16, iters=4), AdamWKernelConfig(block=32, per_tensor_min_numel=0),
                   AdamWKernelConfig(block=64, iters=1, per_tensor_min_numel=200)):
        params = _params(torch.bfloat16)
        opt = TritonAdamW(_groups(params), lr=1e-2, betas=(0.9, 0.95), kernel=kernel)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(DEVICE, torch.bfloat16)
            opt.step(grad_scale=torch.tensor(0.37, device=DEVICE))
        runs.append([t.detach().clone() for p in params for t in (p, *(opt.state[p][k] for k in KEYS))])
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            torch.testing.assert_close(b, a, rtol=0 if INTERPRET else 2.0**-7, atol=0 if INTERPRET else 1e-5)


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_state_equals_torch_fused_adamw(dtype):
    """fp16 / bf16 params, grads and moments, fp32 math rounded once per store: torch's fused AdamW
    (no clipping: torch's clip would round the scaled gradient to the low dtype first)."""
    from spartron.runtime.adamw_triton import AdamWKernelConfig, TritonAdamW

    ref, mine = _params(dtype), _params(dtype)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2, betas=(0.9, 0.95), fused=True)
    mine_opt = TritonAdamW(_groups(mine), lr=1e-2, betas=(0.9, 0.95), kernel=AdamWKernelConfig(block=16))
    truncating = dtype == torch.bfloat16 and INTERPRET  # one step: truncation vs rounding is <= 1 ulp apart
    _run(ref_opt, mine_opt, ref, mine, dtype, steps=1 if truncating else 4, coef=1.0, clip_ref=False)
    _assert_states_close(ref_opt, mine_opt, ref, mine, rtol=2.0 ** (-10 if dtype == torch.float16 else -7), atol=1e-5)


@pytest.mark.gpu
@needs_kernel
def test_bf16_moments_beside_fp32_parameters_equal_the_torch_reference():
    """train.adamw_moments_dtype = "bfloat16": the kernels load bf16 moments into fp32 and round them on store, as
    TritonAdamW's torch reference does (tests/runtime/test_adamw_moments.py pins the reference bitwise). A moment
    whose fp32 value rounds differently is one bf16 ulp apart; the interpreter truncates, so one step there."""
    from spartron.runtime.adamw_triton import AdamWKernelConfig, TritonAdamW

    ref, mine = _params(torch.float32), _params(torch.float32)
    ref_opt = TritonAdamW(_groups(ref), lr=1e-2, betas=(0.9, 0.95), reference=True, moments_dtype=torch.bfloat16)
    mine_opt = TritonAdamW(_groups(mine), lr=1e-2, betas=(0.9, 0.95), kernel=AdamWKernelConfig(block=16),
                           moments_dtype=torch.bfloat16)
    _run(ref_opt, mine_opt, ref, mine, torch.float32, steps=1 if INTERPRET else 3)
    assert {mine_opt.state[q][k].dtype for q in mine for k in KEYS} == {torch.bfloat16}
    _assert_states_close(ref_opt, mine_opt, ref, mine, rtol=2.0**-7, atol=1e-6)
    for p, q in zip(ref, mine, strict=True):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)  # the fp32 parameters to fp32 rounding


@pytest.mark.gpu
@needs_kernel
def test_unaligned_views_take_the_unhinted_kernel_and_agree():
    """A parameter at a 4-byte offset into its storage cannot take the 16-byte hints; it is bucketed apart."""
    from spartron.runtime.adamw_triton import AdamWKernelConfig, TritonAdamW

    flat = torch.randn(41, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    ref = [nn.Parameter(flat[1:33].clone()), nn.Parameter(flat[:16].clone())]
    mine = [nn.Parameter(flat.clone()[1:33]), nn.Parameter(flat[:16].clone())]
    assert mine[0].data_ptr() % 16 == 4
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, foreach=False)
    mine_opt = TritonAdamW(mine, lr=1e-2, kernel=AdamWKernelConfig(block=16))
    _run(ref_opt, mine_opt, ref, mine, torch.float32, steps=2)
    _assert_states_close(ref_opt, mine_opt, ref, mine, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@needs_kernel
def test_state_dict_is_torch_fused_adamw_s_and_resumes_either_way():
    """Same state_dict keys / step tensors as torch.optim.AdamW(fused=True); a state saved by either loads
    into the other and the next step agrees."""
    from spartron.runtime.adamw_triton import TritonAdamW

    ref, mine = _params(torch.float32), _params(torch.float32)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2, fused=True)
    mine_opt = TritonAdamW(_groups(mine), lr=1e-2)
    _run(ref_opt, mine_opt, ref, mine, torch.float32, steps=2, coef=1.0, clip_ref=False)
    a, b = ref_opt.state_dict(), mine_opt.state_dict()
    assert [sorted(g) for g in a["param_groups"]] == [sorted(g) for g in b["param_groups"]]
    assert [{k: v for k, v in g.items() if k != "params"} for g in a["param_groups"]] == \
           [{k: v for k, v in g.items() if k != "params"} for g in b["param_groups"]]
    assert {i: sorted(s) for i, s in a["state"].items()} == {i: sorted(s) for i, s in b["state"].items()}
    assert all(s["step"].device == b["state"][i]["step"].device for i, s in a["state"].items())
    swapped_ref = [nn.Parameter(q.detach().clone()) for q in mine]  # torch continues TritonAdamW's state
    swapped_mine = [nn.Parameter(p.detach().clone()) for p in ref]  # TritonAdamW continues torch's
    torch_from_mine = torch.optim.AdamW(_groups(swapped_ref), lr=1e-2, fused=True)
    torch_from_mine.load_state_dict(b)
    mine_from_torch = TritonAdamW(_groups(swapped_mine), lr=1e-2)
    mine_from_torch.load_state_dict(a)
    _run(torch_from_mine, mine_from_torch, swapped_ref, swapped_mine, torch.float32, steps=1, coef=1.0,
         clip_ref=False)
    _assert_states_close(torch_from_mine, mine_from_torch, swapped_ref, swapped_mine, rtol=1e-5, atol=1e-6)
    assert mine_from_torch.state[swapped_mine[0]]["step"].item() == 3


@pytest.mark.gpu
@needs_kernel
def test_unsupported_inputs_are_errors():
    from spartron.runtime.adamw_triton import AdamWKernelConfig, TritonAdamW

    p = nn.Parameter(torch.zeros(4, 4, dtype=torch.float64, device=DEVICE))
    p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError, match=r"TritonAdamW: param dtype torch.float64 is not one of float32"):
        TritonAdamW([p]).step()
    q = nn.Parameter(torch.zeros(4, 4, device=DEVICE))
    q.grad = torch.zeros(4, 4, device=DEVICE).t()
    with pytest.raises(ValueError, match=r"TritonAdamW: grad must be contiguous"):
        TritonAdamW([q]).step()
    with pytest.raises(ValueError, match=r"TritonAdamW does not implement amsgrad=True"):
        opt = TritonAdamW([q])
        opt.param_groups[0]["amsgrad"] = True
        opt.step()
    with pytest.raises(ValueError, match=r"grad_scale must have one element, got shape \(2,\)"):
        TritonAdamW([q]).step(grad_scale=torch.ones(2))
    with pytest.raises(ValueError, match=r"AdamWKernelConfig.block must be a power of two >= 16, got 48"):
        AdamWKernelConfig(block=48)


def _dtensor_rank(rank: int, world: int) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from spartron.runtime.adamw_triton import AdamWKernelConfig, TritonAdamW

    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))
    grads = [torch.randn(8, 6, generator=torch.Generator().manual_seed(4 + i)) for i in range(2)]
    ref = nn.Parameter(full.clone())
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, foreach=False)
    mine = nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
    opt = TritonAdamW([mine], lr=1e-2, kernel=AdamWKernelConfig(block=16))
    coef = torch.tensor(0.5)
    for grad in grads:
        ref.grad = grad * coef
        ref_opt.step()
        mine.grad = distribute_tensor(grad, mesh, [Shard(0)])
        opt.step(grad_scale=coef)
    rows = slice(rank * 4, rank * 4 + 4)
    assert isinstance(opt.state[mine]["exp_avg"], DTensor)  # the state stays sharded like the parameter
    return [float((mine.to_local() - ref.detach()[rows]).abs().max()),
            float((opt.state[mine]["exp_avg_sq"].to_local() - ref_opt.state[ref]["exp_avg_sq"][rows]).abs().max())]


@pytest.mark.skipif(not INTERPRET, reason="needs Triton's interpreter (gloo ranks hold CPU shards)")
def test_dtensor_shards_update_their_local_slice():
    for diffs in run_distributed(_dtensor_rank, 2, timeout=120):
        assert diffs[0] <= 2.5e-7 and diffs[1] <= 1e-9


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA and triton (the compiled kernels, not the interpreter)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernels_equal_torch_fused_adamw(dtype):
    """The compiled kernels (16-byte aligned table launch and per-tensor launch) against torch's fused CUDA
    AdamW; the reference's gradients are pre-scaled in fp32 and rounded, as clip_grads_ does."""
    from spartron.runtime.adamw_triton import AdamWKernelConfig, TritonAdamW

    for kernel in (AdamWKernelConfig(), AdamWKernelConfig(per_tensor_min_numel=1000)):
        ref, mine = _params(dtype), _params(dtype)
        ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2, betas=(0.9, 0.95), fused=True)
        mine_opt = TritonAdamW(_groups(mine), lr=1e-2, betas=(0.9, 0.95), kernel=kernel)
        _run(ref_opt, mine_opt, ref, mine, dtype, coef=1.0, clip_ref=False)
        tol = dict(rtol=2.0**-7, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
        _assert_states_close(ref_opt, mine_opt, ref, mine, **tol)


def _train_cfg(run_dir, kernel: str, device: str, precision: dict | None = None, **train):  # noqa: ANN001, ANN003
    """A 2-layer MoE model without DSA / MTP (their GPU kernels are not what this checks), clipped every step."""
    model = {**(precision or {}), "vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4, "first_k_dense": 1,
             "dense_inter_dim": 128, "max_seq_len": 64,
             "mla": {"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                     "v_head_dim": 16},
             "moe": {"n_routed_experts": 4, "n_shared_experts": 1, "top_k": 2, "moe_inter_dim": 32,
                     "dispatcher": "local"}}
    return config_from_dict({"name": "adamw", "device": device, "model": model, "train": {
        "steps": 4, "seq_len": 32, "global_batch_size": 2, "micro_batch_size": 1, "lr": 1e-3, "warmup_steps": 0,
        "grad_clip": 0.05, "adamw_kernel": kernel, "save_every": 2, "progress": False, "run_dir": str(run_dir),
        **train}})


def _losses_and_norms(cfg) -> list[tuple[int, float, float]]:  # noqa: ANN001
    from spartron.runtime.trainer import train

    return [(r["step"], r["loss"], r["grad_norm"]) for r in train(cfg).records]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA and triton (the Trainer with train.adamw_kernel = 'triton')")
def test_trainer_with_triton_adamw_trains_like_torch_and_resumes_across_kernels(tmp_path):
    """The Trainer's clipped step through TritonAdamW (bf16 compute over fp32 masters: FSDP2 DTensor parameters
    on one rank) follows torch's fused AdamW; each run's saved step 2 resumes under the other kernel and its steps
    3-4 follow the run that saved it. (bf16 compute: an fp32-rounding difference in a master may flip a bf16
    weight.)"""
    import shutil

    from spartron.runtime.state import step_dir

    masters = {"dtype": "bfloat16", "master_dtype": "float32"}
    ref = _losses_and_norms(_train_cfg(tmp_path / "torch", "torch", "cuda", masters))
    mine = _losses_and_norms(_train_cfg(tmp_path / "triton", "triton", "cuda", masters))
    assert [s for s, _, _ in mine] == [1, 2, 3, 4] and all(n > 0.05 for _, _, n in mine)  # every step clipped
    assert mine[0] == pytest.approx(ref[0], rel=1e-6)  # before any update (CUDA atomics may reorder sums)
    for (_, a, na), (_, b, nb) in zip(ref, mine, strict=True):
        assert b == pytest.approx(a, rel=1e-3) and nb == pytest.approx(na, rel=1e-2)
    for run, (other, done) in {"triton": ("torch", mine), "torch": ("triton", ref)}.items():
        shutil.rmtree(step_dir(tmp_path / run, 4))
        resumed = _losses_and_norms(_train_cfg(tmp_path / run, other, "cuda", masters, resume=True))
        assert [s for s, _, _ in resumed] == [3, 4]
        for (_, a, _), (_, b, _) in zip(done[2:], resumed, strict=True):
            assert b == pytest.approx(a, rel=1e-3)


def _trainer_rank(rank: int, world: int, cfg, swap: bool) -> list[tuple[float, float]]:  # noqa: ANN001
    from torch.distributed.tensor import DTensor

    from spartron.runtime.adamw_triton import TritonAdamW
    from spartron.runtime.trainer import Trainer

    trainer = Trainer(cfg).setup()
    if swap:  # build_optimizer refuses CPU parameters: the same groups, as TritonAdamW, under the interpreter
        t = cfg.train
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in trainer.optimizer.param_groups]
        trainer.optimizer = TritonAdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8)
        assert any(isinstance(p, DTensor) for g in groups for p in g["params"])  # FSDP2 shards on 2 ranks
    out = []
    while not trainer.done:
        record = trainer.step()
        out.append((record["loss"], record["grad_norm"]))
    trainer.close()
    return out


@pytest.mark.skipif(not INTERPRET, reason="needs Triton's interpreter (the Trainer's CPU parameters)")
def test_trainer_step_through_triton_adamw_on_fsdp_shards(tmp_path):
    """The Trainer's clipped step (clip_and_step_) with a TritonAdamW over FSDP2 DTensor shards on 2 gloo ranks
    follows the same run with torch's AdamW."""
    ref = run_distributed(_trainer_rank, 2, _train_cfg(tmp_path / "a", "torch", "cpu", steps=3, save_every=0), False,
                          timeout=240)
    mine = run_distributed(_trainer_rank, 2, _train_cfg(tmp_path / "b", "torch", "cpu", steps=3, save_every=0), True,
                           timeout=240)
    assert mine[0] == mine[1] and all(n > 0.05 for _, n in mine[0])  # every step clipped
    for (a, na), (b, nb) in zip(ref[0], mine[0], strict=True):
        assert b == pytest.approx(a, rel=1e-5) and nb == pytest.approx(na, rel=1e-4)
    assert mine[0][2] != ref[0][0]  # it trained
