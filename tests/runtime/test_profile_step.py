"""benchmarks/profile_step.py: the trace analysis on a synthetic CUDA-style kineto trace, and the
region-stats aggregation on a real checkpointed model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prof():
    from benchmarks import profile_step

    return profile_step


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _synthetic_trace():
    """Main thread 1 runs forward (an mm) and, after backward, an item() that syncs; autograd thread 2
    runs a reentrant region's backward: its replay (a mul) and its inner backward (an mm)."""
    ev = [
        _x("user_annotation", "spartron_profiled_step", 0, 1000),
        # forward: aten::mm launches kernel c=1 (100 us on stream 7)
        _x("cpu_op", "aten::mm", 10, 20),
        _x("cuda_runtime", "cudaLaunchKernel", 15, 5, correlation=1),
        _x("kernel", "nvjet_tst_gemm", 20, 100, tid=7, stream=7, correlation=1),
        # backward on thread 2: the region node [200, 600]; replay mul at 210, nested node at 400
        _x("cpu_op", "autograd::engine::evaluate_function: _ReentrantRegionBackward", 200, 400, tid=2),
        _x("cpu_op", "aten::mul", 210, 10, tid=2),
        _x("cuda_runtime", "cudaLaunchKernel", 212, 3, tid=2, correlation=2),
        _x("kernel", "vectorized_elementwise_kernel", 220, 30, tid=7, stream=7, correlation=2),
        _x("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 400, 100, tid=2),
        _x("cpu_op", "aten::mm", 410, 20, tid=2),
        _x("cuda_runtime", "cudaLaunchKernel", 415, 3, tid=2, correlation=3),
        _x("kernel", "nvjet_tst_gemm", 420, 50, tid=7, stream=7, correlation=3),
        # after backward: item() -> D2H copy + stream sync (blocks 40 us); a side-stream kernel
        _x("cpu_op", "aten::_local_scalar_dense", 700, 60),
        _x("cuda_runtime", "cudaMemcpyAsync", 705, 5, correlation=4),
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 710, 2, tid=7, stream=7, correlation=4),
        _x("cuda_runtime", "cudaStreamSynchronize", 711, 40),
        _x("cpu_op", "aten::add", 800, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 802, 3, correlation=5),
        _x("kernel", "vectorized_elementwise_kernel", 805, 10, tid=8, stream=8, correlation=5),
        # outside the step: ignored
        _x("cuda_runtime", "cudaLaunchKernel", 2000, 3, correlation=6),
        _x("kernel", "nvjet_tst_gemm", 2005, 500, tid=7, stream=7, correlation=6),
    ]
    return {"traceEvents": ev}


def test_analyze_trace_windows_busy_and_syncs(prof):
    a = prof.analyze_trace(_synthetic_trace())
    assert a["step_wall_ms"] == pytest.approx(1.0)
    assert a["gpu_kernel_sum_ms"] == pytest.approx((100 + 30 + 50 + 2 + 10) / 1e3)
    assert a["gpu_busy_ms"] == pytest.approx(0.192)
    assert a["gpu_idle_fraction"] == pytest.approx(1 - 0.192)
    assert a["gpu_ms_by_window"] == pytest.approx({"forward": 0.1, "replay": 0.03, "backward": 0.05,
                                                   "after_backward": 0.012})
    assert a["forward_wall_ms"] == pytest.approx(0.2)
    assert a["backward_wall_ms"] == pytest.approx(0.4)
    assert a["replay_wall_ms"] == pytest.approx(0.2)  # region start 200 -> nested node 400
    assert a["after_backward_wall_ms"] == pytest.approx(0.4)
    assert a["gpu_ms_by_stream"] == pytest.approx({"7": 0.182, "8": 0.01})
    assert a["compute_stream_ms"] == pytest.approx(0.182)
    assert a["top_kernels"][0] == {"name": "nvjet_tst_gemm", "ms": pytest.approx(0.15), "count": 2}
    assert a["gpu_ms_by_category"]["gemm"] == pytest.approx(0.15)
    assert a["gpu_ms_by_category"]["elementwise"] == pytest.approx(0.04)
    assert {d["op"]: d["ms"] for d in a["gpu_ms_by_launching_op"]} == pytest.approx(
        {"aten::mm": 0.15, "aten::mul": 0.03, "aten::add": 0.01, "aten::_local_scalar_dense": 0.002})
    assert a["replay_gpu_ms_by_op"] == [{"op": "aten::mul", "ms": pytest.approx(0.03)}]
    assert a["host_syncs"] == [{"where": "cudaStreamSynchronize in aten::_local_scalar_dense", "count": 1,
                                "ms": pytest.approx(0.04)}]
    assert a["host_sync_count"] == 1
    assert a["memcpy_counts"] == {"Memcpy DtoH": 1}
    assert a["sync_prone_ops"] == [{"op": "aten::_local_scalar_dense", "count": 1, "ms": pytest.approx(0.06)}]
    assert a["n_kernel_launches"] == 4
    assert a["idle_gaps"]["count_over_1ms"] == 0
    assert a["idle_gaps"]["largest_ms"][:2] == pytest.approx([0.24, 0.185])  # 470 -> 710, 815 -> 1000


def test_analyze_trace_needs_the_step_range(prof):
    with pytest.raises(RuntimeError, match="spartron_profiled_step"):
        prof.analyze_trace({"traceEvents": [_x("cpu_op", "aten::mm", 0, 1)]})


def test_kernel_categories(prof):
    assert prof.kernel_category("void cutlass::Kernel<GroupedGemm...>") == "grouped_gemm"
    assert prof.kernel_category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert prof.kernel_category("void at::native::(anonymous)::indexing_backward_kernel<...>") == \
        "index_scatter_gather"
    assert prof.kernel_category("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer"
    assert prof.kernel_category("something_else") == "other"
    # torch._grouped_mm's sm90 CUTLASS kernel (its mangled name says GroupProblemShape, not "grouped")
    assert prof.kernel_category("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6"
                                "kernel13GemmUniversalINS5_17GroupProblemShapeIN4cute5tupleIJiiiEEEEENS") == \
        "grouped_gemm"
    assert prof.kernel_category("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    # inductor's kernels in a compiled step
    assert prof.kernel_category("triton_poi_fused__to_copy_mul_silu_0") == "elementwise"
    assert prof.kernel_category("triton_red_fused__to_copy_mean_pow_1") == "reduce"
    assert prof.kernel_category("triton_per_fused_cat_index_2") == "reduce"
    assert prof.kernel_category("triton_tem_fused_mm_3") == "gemm"


def test_region_stats_sum_saved_and_recomputed(prof):
    from spartron.layers.model import build_model
    from spartron.layers.parallelize import apply_ac
    from spartron.runtime.config import load_config

    cfg = load_config(REPO / "configs" / "tiny.toml", ["device=cpu", "model.mtp.depth=0", "model.n_layers=2",
                                                       "ac.mode=selective"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    assert prof.region_stats(model) is None
    apply_ac(model, cfg.ac)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 16))
    model(tokens, tokens)["loss"].backward()
    stats = prof.region_stats(model)
    assert stats["regions"] == 2 and stats["replays"] == 2
    assert stats["saved_by_op"]["spartron::moe_topk"] == 1  # one MoE layer (first_k_dense = 1)
    assert stats["saved_by_op"]["aten::mm"] > 0
    assert stats["ops_saved"] == sum(stats["saved_by_op"].values())
    assert "aten::mm" not in stats["recomputed_by_op"]


def test_offload_benchmark_kernel_families():
    """benchmarks/offload.py groups kernels by family to explain micro-batch 2 vs 1; first match wins."""
    from benchmarks import offload as module

    family = module.kernel_family
    assert family("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)") == "nccl"
    assert family("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT") == "gemm"
    assert family("void at::native::elementwise_kernel<128, 2>") == "elementwise"
    assert family("void at::native::(anonymous namespace)::indexSelectLargeIndex") == "index_scatter_gather"
    assert family("Memcpy DtoH (Device -> Pinned)") == "copy"
    assert family("pytorch_flash::flash_fwd_kernel") == "attention"
    assert family("some_custom_kernel") == "other"
    assert family("void deep_ep::intranode::dispatch<8, 768, 6>(int4*, float*)") == "deepep"
    assert module.is_comm_kernel("ncclDevKernel_AllToAll") and module.is_comm_kernel("void deep_ep::intranode::combine")
    assert not module.is_comm_kernel("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT")
    peer = "Memcpy PtoP (Device -> Device)"  # the copy-engine exchange's copies into peer memory
    assert family(peer) == "peer_copy" and module.is_comm_kernel(peer)
    assert not module.is_comm_kernel("Memcpy DtoD (Device -> Device)")
