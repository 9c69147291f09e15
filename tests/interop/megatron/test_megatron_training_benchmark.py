"""benchmarks/megatron_gpt.py --smoke: the CPU path of the GPU benchmark runs, and its parity section holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install megatron-core==0.16.1)")

REPO = Path(__file__).resolve().parents[3]


def test_benchmark_smoke_records_parity_and_every_step(tmp_path):
    out = tmp_path / "megatron_gpt.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "megatron_gpt.py"), "--smoke", "--out", str(out)],
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert {"device", "torch", "megatron_core", "commit", "shapes", "parity", "cases"} <= set(report)
    assert report["device"] == "cpu" and report["smoke"] is True
    parity = report["parity"]  # Spartron's Trainer vs Megatron's machinery around Spartron's layers, fp32
    assert len(parity["spartron_trainer_losses"]) == len(parity["megatron_losses"]) == 4
    assert parity["max_abs_diff"] < 1e-6
    ours, megatron_moe = report["cases"]
    assert ours["case"] == "spartron-layers" and len(ours["losses"]) == len(ours["step_times_s"]) == 3
    assert ours["timed_steps"] == 1 and ours["step_time_s"] == ours["step_times_s"][2]
    assert ours["loss_decreased"] and ours["peak_memory_allocated_gib"] is None
    assert megatron_moe == {"case": "spartron-mla+megatron-moe",
                            "skipped": "CPU: Megatron's alltoall dispatcher creates a torch.cuda.Stream"}


def _comparison_models(rank, world):
    """The benchmark's comparison set-ups as far as a CPU builds them (Megatron's MoE needs CUDA at build)."""
    from cpu_shim import cpu_megatron  # next to this file
    from megatron.core import parallel_state

    from benchmarks.megatron_gpt import MegatronMoETraining
    from examples.megatron_gpt import DEFAULTS, TINY
    from spartron.runtime.config import load_config

    parallel_state.initialize_model_parallel()
    cfg = load_config(TINY, [*DEFAULTS, "train.steps=1"])
    errors = {}
    for native_mla in (False, True):
        try:
            with cpu_megatron():  # past Megatron's CUDA-named placements, to the first real need of CUDA / TE
                MegatronMoETraining(cfg, 1, native_mla=native_mla)
        except Exception as err:  # noqa: BLE001 - the message is the result
            errors[native_mla] = f"{type(err).__name__}: {err}"
    return errors


def test_benchmark_comparison_cases_fail_on_cpu_where_megatron_needs_cuda_or_te():
    from spartron.testing import run_distributed

    (errors,) = run_distributed(_comparison_models, 1, timeout=120)
    # Spartron MLA + Megatron's MoELayer: built up to Megatron's alltoall dispatcher (a CUDA stream)
    assert errors[False].startswith("RuntimeError: torch.cuda.Stream requires CUDA support when instantiating "
                                    "MoELayer"), errors[False]
    # Megatron's own MLA without Transformer Engine: megatron-core 0.16.1 cannot build it at all
    assert "DotProductAttention.__init__() got an unexpected keyword argument 'k_channels' when instantiating " \
           "DotProductAttention when instantiating MLASelfAttention" in errors[True], errors[True]


def test_megatron_mla_is_a_recorded_refusal_without_transformer_engine():
    from benchmarks.megatron_gpt import MLA_NEEDS_TE, NO_TE_MLA, planned_cases

    moe = "spartron-mla+megatron-moe"
    assert planned_cases("cuda", False) == (["spartron-layers", moe], [{"case": NO_TE_MLA, "refused": MLA_NEEDS_TE}])
    assert planned_cases("cuda", True) == (["spartron-layers", moe, NO_TE_MLA], [])
    assert planned_cases("cpu", False)[0] == ["spartron-layers"]
    assert "Transformer Engine is not installed" in MLA_NEEDS_TE


def test_megatron_moe_router_gating_is_the_plain_matmul_in_the_router_dtype():
    from types import SimpleNamespace

    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.router import TopKRouter

    from benchmarks.megatron_gpt import megatron_local_layer

    moe = megatron_local_layer(4, native_mla=False).mlp.submodules  # what the Megatron-MoE case builds
    router = moe.router
    assert issubclass(router, TopKRouter) and router is not TopKRouter and moe.experts.module is SequentialMLP
    x = torch.arange(12, dtype=torch.bfloat16).view(2, 2, 3) / 7
    w = torch.tensor([[1.0, -2.0, 0.5], [0.25, 3.0, -1.0]], dtype=torch.bfloat16)
    fake = SimpleNamespace(weight=w, bias=None, config=SimpleNamespace(moe_router_dtype="fp32"))
    out = router.gating(fake, x)
    assert out.dtype == torch.float32 and out.shape == (2, 2, 2)
    assert torch.equal(out, x.float() @ w.float().T)
    fake.config.moe_router_dtype, fake.bias = None, torch.tensor([1.0, -1.0], dtype=torch.bfloat16)
    assert torch.equal(router.gating(fake, x), torch.nn.functional.linear(x, w, fake.bias))
