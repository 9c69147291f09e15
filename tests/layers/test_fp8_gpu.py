"""The Triton and torch_scaled_mm backends on the GPU: quantisation bitwise equal to the reference
(both scale modes; the slot-aligned column layout with its zero padding, the transposed weight
blocks), GEMMs within accumulation-order error of it, the fused expert ops bitwise equal to the
unfused path, and a new routed-row count reusing the compiled kernels."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from spartron.layers.fp8 import gemms, grouped_mm, linear, quant, reference
from spartron.layers.fp8.expert_ops import grouped_mm_pair, swiglu_grouped_mm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Hopper)")]


def _inputs(m: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, 256, device="cuda", generator=g).bfloat16()
    w = (torch.randn(3, 384, 256, device="cuda", generator=g) * 0.05).bfloat16()
    grad = torch.randn(m, 384, device="cuda", generator=g).bfloat16()
    return x, w, grad


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("counts", [[130, 0, 382], [512, 0, 0]])
def test_triton_primitives_match_the_reference(counts, pow2):
    from spartron.layers.fp8 import triton_backend as tb

    c = torch.tensor(counts, dtype=torch.int32, device="cuda")
    x, w, grad = _inputs(512)
    for fn, arg in (("quantize_rows", x), ("quantize_blocks", w), ("quantize_blocks_t", w)):
        (q, s), (rq, rs) = getattr(tb, fn)(arg, pow2), getattr(quant, fn)(arg, pow2)
        assert q.shape == rq.shape and q.is_contiguous(), fn
        assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), fn
    for cols in (x, grad):  # the kernel writes every slot (no memset): padding and unused slots must be zero
        junk = torch.full((1 << 22,), 0x7E, dtype=torch.uint8, device="cuda")  # a freed block for q_t to reuse
        del junk
        (q, s), (rq, rs) = tb.quantize_cols_grouped(cols, c, pow2), quant.quantize_cols_grouped(cols, c, pow2)
        assert q.shape == rq.shape == (cols.shape[1], (512 // 128 + 3) * 128) and s.stride() == rs.stride()
        assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    order = torch.randperm(512, device="cuda")  # gathered: x[order] read through the index, bitwise the same
    (q, s), (rq, rs) = tb.quantize_rows(x, pow2, order), quant.quantize_rows(x[order], pow2)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), "gathered rows"
    (q, s), (rq, rs) = tb.quantize_cols_grouped(x, c, pow2, order), quant.quantize_cols_grouped(x[order], c, pow2)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), "gathered columns"
    gate, up = grad[:, :256].contiguous(), x.flip(0).contiguous()
    (q, s), (rq, rs) = tb.swiglu_quantize_rows(gate, up, pow2), reference.swiglu_quantize_rows(gate, up, pow2)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), "swiglu"
    q, s = tb.swiglu_quantize_rows(gate, up, pow2, order)
    rq, rs = reference.swiglu_quantize_rows(gate, up, pow2, order)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), "swiglu gathered"
    out, ref = gemms.forward(tb, x, w, c, pow2), gemms.forward(reference, x, w, c, pow2)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    (dx, dw), (rdx, rdw) = (gemms.backward(impl, grad, x, w, c, pow2, True) for impl in (tb, reference))
    torch.testing.assert_close(dx.float(), rdx.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dw.float(), rdw.float(), rtol=1e-2, atol=5e-2)
    assert torch.equal(dw[c == 0], torch.zeros_like(dw[c == 0]))  # an empty expert reads no slot


def test_every_quantiser_config_of_the_sweep_writes_the_reference_values():
    """benchmarks/fp8_gemms.py's quantiser configs (rows / SwiGLU rows by BM and warps, columns by BC and warps,
    weight blocks by rows at a time and warps): each writes the reference's values bitwise, on ragged groups and
    gathered rows."""
    from benchmarks.fp8_gemms import QUANT_BLOCKS_CONFIGS, QUANT_COLS_CONFIGS, QUANT_ROWS_CONFIGS
    from spartron.layers.fp8 import triton_backend as tb

    def same(got, want, what):
        assert torch.equal(got[1], want[1]) and torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)), what

    c = torch.tensor([1, 0, 63, 130, 318], dtype=torch.int32, device="cuda")
    x, w, grad = _inputs(512)
    order = torch.randperm(512, device="cuda")
    gate, up = grad[:, :256].contiguous(), x.flip(0).contiguous()
    for bm, warps in QUANT_ROWS_CONFIGS:
        kw = dict(block_m=bm, num_warps=warps)
        same(tb.quantize_rows(x[:509], True, **kw), quant.quantize_rows(x[:509], True), f"rows {kw}")
        same(tb.quantize_rows(x, False, order, **kw), quant.quantize_rows(x[order], False), f"gathered rows {kw}")
        same(tb.swiglu_quantize_rows(gate, up, True, order, **kw),
             reference.swiglu_quantize_rows(gate, up, True, order), f"swiglu {kw}")
    for bc, warps in QUANT_COLS_CONFIGS:
        kw = dict(block_c=bc, num_warps=warps)
        same(tb.quantize_cols_grouped(x, c, True, order, **kw), quant.quantize_cols_grouped(x[order], c, True),
             f"columns {kw}")
    for config in QUANT_BLOCKS_CONFIGS:
        q, s, qt, st = tb.quantize_blocks_both((w,), True, config=config)
        same((q, s), quant.quantize_blocks(w, True), f"blocks {config}")
        same((qt, st), quant.quantize_blocks_t(w, True), f"transposed blocks {config}")


def _close_at_fp8_mma_precision(out, ref):
    """Hopper's FP8 MMA adds its products with a truncated accumulator (about 14 bits, DeepSeek-V3
    section 3.3.2; the H100 measured up to 1.4e-3 of the output's scale at 128-deep blocks): the bound
    is relative to the output's magnitude; a wrong row, group or scale is off by the output itself."""
    torch.testing.assert_close(out, ref, rtol=0, atol=4e-3 * ref.abs().max().item())


@pytest.mark.parametrize("block_m, num_warps", [(64, 4), (128, 8)])
def test_grouped_gemm_configs_match_the_reference_on_ragged_groups(block_m, num_warps):
    """The sweep's configs of benchmarks/fp8_gemms.py (BM 64 slots: a group of 65 rows takes two); every
    config gives the default config's result bitwise (the same MMAs over the same 128-deep blocks)."""
    from spartron.layers.fp8 import triton_backend as tb

    c = torch.tensor([1, 0, 63, 64, 65, 0, 319], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(512, 256, device="cuda", generator=g).bfloat16()
    w = (torch.randn(7, 384, 256, device="cuda", generator=g) * 0.05).bfloat16()
    grad = torch.randn(512, 384, device="cuda", generator=g).bfloat16()
    kw = dict(block_m=block_m, num_warps=num_warps, num_stages=4)
    xq, wq = quant.quantize_rows(x, True), quant.quantize_blocks(w, True)
    out, ref = tb.fprop(*xq, *wq, c, torch.float32, **kw), reference.fprop(*xq, *wq, c, torch.float32)
    _close_at_fp8_mma_precision(out, ref)
    assert torch.equal(out, tb.fprop(*xq, *wq, c, torch.float32))
    gq, wt = quant.quantize_rows(grad, True), quant.quantize_blocks_t(w, True)
    out, ref = tb.dgrad(*gq, *wt, c, torch.float32, **kw), reference.dgrad(*gq, *wt, c, torch.float32)
    _close_at_fp8_mma_precision(out, ref)
    assert torch.equal(out, tb.dgrad(*gq, *wt, c, torch.float32))
    gt, xt = quant.quantize_cols_grouped(grad, c, True), quant.quantize_cols_grouped(x, c, True)
    ref = reference.wgrad(*gt, *xt, c, torch.float32)
    for bn, warps, stages in ((128, 8, 2), (64, 4, 4)):
        out = tb.wgrad(*gt, *xt, c, torch.float32, block_n=bn, num_warps=warps, num_stages=stages)
        _close_at_fp8_mma_precision(out, ref)
        assert torch.equal(out, tb.wgrad(*gt, *xt, c, torch.float32))


def test_triton_fused_expert_ops_equal_the_unfused_path_bitwise_but_dx_is_one_contraction():
    """As tests/layers/test_fp8_fused.py on the reference: the w1|w3 GEMM and the swiglu quantisation of
    h13's halves (read in place) give the two-GEMM path's out / dw bitwise; dx is one dgrad over 2I."""
    from spartron.layers.swiglu import swiglu

    c = torch.tensor([130, 0, 382], dtype=torch.int32, device="cuda")
    x, w, grad = _inputs(512, seed=1)
    w1, w3 = w[:, :256], w[:, 128:]
    w2 = (w[:, :256].transpose(1, 2) * 1.5).contiguous()  # [3, 256, 256]
    results = {}
    for path in ("fused", "w13", "unfused"):
        leaves = [t.detach().clone().contiguous().requires_grad_() for t in (x, w1, w3, w2)]
        xl, w1l, w3l, w2l = leaves
        if path == "fused":
            h13 = grouped_mm_pair(xl, w1l, w3l, c, "triton", True, True, [], None, None, 1, [])
            out = swiglu_grouped_mm(h13, w2l, c, "triton", True, True, [], [])
        elif path == "w13":
            gate, up = grouped_mm(xl, torch.cat([w1l, w3l], 1), c, "triton", True, True).split(256, dim=1)
            out = grouped_mm(swiglu(gate, up, inplace_backward=True), w2l, c, "triton", True, True)
        else:  # SwiGLU's backward as the experts run it (the fused op's: one kernel, spartron.layers.swiglu)
            h = swiglu(grouped_mm(xl, w1l, c, "triton", True, True), grouped_mm(xl, w3l, c, "triton", True, True),
                       inplace_backward=True)
            out = grouped_mm(h, w2l, c, "triton", True, True)
        out.backward(grad[:, :256])
        results[path] = [out] + [t.grad for t in leaves]
    for i, name in enumerate(("out", "dx", "dw1", "dw3", "dw2")):
        assert torch.equal(results["fused"][i], results["w13"][i]), name
        if name != "dx":
            assert torch.equal(results["fused"][i], results["unfused"][i]), name
    # one contraction over 2I (FP8 MMA, fp32, rounded once) against two bf16 results added: where dx1 and dx3
    # cancel, the difference is a rounding of the TERMS, not of their sum (the H100: one bf16 ulp at the
    # largest gradient), so the bound is relative to the gradient's scale
    unfused = results["unfused"][1]
    torch.testing.assert_close(results["fused"][1], unfused, rtol=0, atol=2 ** -7 * unfused.abs().max().item())


@pytest.mark.parametrize("pow2", [True, False])
def test_triton_concatenated_blocks_and_cached_experts_match(pow2):
    """quantize_blocks_cat / _both write each weight's blocks into its rows of one buffer (the reference's
    blocks of the concatenation, bitwise); experts with the weight cache equal them without it bitwise."""
    from spartron.layers.config import FP8Config
    from spartron.layers.fp8 import apply_fp8
    from spartron.layers.fp8 import triton_backend as tb
    from spartron.layers.moe.experts import GroupedExperts

    _, w, _ = _inputs(128, seed=2)
    w1, w3 = w[:, :256].contiguous(), w[:, 128:].contiguous() * 3
    both = tb.quantize_blocks_both((w1, w3), pow2)  # q, s, q^T, s^T from one read of each weight
    for t in (False, True):
        (q, s), (rq, rs) = tb.quantize_blocks_cat((w1, w3), pow2, t), reference.quantize_blocks_cat((w1, w3), pow2, t)
        assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), t
        assert torch.equal(both[2 * t + 1], rs) and torch.equal(both[2 * t].view(torch.uint8), rq.view(torch.uint8)), t
    grads = []
    for cache in ("on", "off"):
        torch.manual_seed(0)
        experts = GroupedExperts(3, 256, 256, dtype=torch.bfloat16, device="cuda")
        apply_fp8([experts], FP8Config(backend="triton", modules=["experts"], weight_cache=cache,
                                       power_of_two_scales=pow2))
        x = _inputs(512, seed=3)[0].requires_grad_()
        for _ in range(2):
            out = experts(x, [130, 0, 382])
            out.backward(torch.ones_like(out))
        grads.append([out, x.grad, experts.w1.grad, experts.w3.grad, experts.w2.grad])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def _compiled(fn) -> int:
    caches = getattr(fn, "device_caches", None)  # triton >= 3.2: {device: (kernel cache, ...)}
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(entry) for entry in fn.cache.values())


def test_a_new_routed_row_count_reuses_the_compiled_kernels():
    from spartron.layers.fp8 import triton_kernels as k

    kernels = (k.quantize_rows_kernel, k.quantize_blocks_kernel, k.quantize_cols_kernel, k.grouped_gemm_kernel,
               k.grouped_wgrad_kernel)
    x, w, grad = _inputs(1024, seed=2)
    x.requires_grad_(True)
    counts = ([256, 0, 256], [300, 12, 200], [0, 640, 144], [128, 128, 768])  # rows 512, 512, 784, 1024
    for i, cs in enumerate(counts):
        rows = sum(cs)
        c = torch.tensor(cs, dtype=torch.int32, device="cuda")
        grouped_mm(x[:rows], w, c, "triton", True, True).backward(grad[:rows])
        torch.cuda.synchronize()
        if i == 0:
            first = [_compiled(f) for f in kernels]
    assert [_compiled(f) for f in kernels] == first  # rows 512 / 784 / 1024: all multiples of 16, no compile


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0), reason="sm90 only")
@pytest.mark.parametrize("k", [384, 512])
def test_torch_scaled_mm_dense_linear_matches_the_reference(k):
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(256, k, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(640, k, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    grad = torch.randn(256, 640, device="cuda", generator=g).bfloat16()
    out = linear(x, w, "torch_scaled_mm", True, True, [])
    out.backward(grad)
    ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = linear(ref_x, ref_w, "reference", True, True, [])
    ref.backward(grad)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(x.grad.float(), ref_x.grad.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(w.grad.float(), ref_w.grad.float(), rtol=1e-2, atol=5e-2)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0), reason="sm90 only")
def test_torch_scaled_mm_grouped_gemms_match_the_reference_on_ragged_groups():
    """fprop / dgrad on the Triton kernel, wgrad as one cuBLAS GEMM per group writing its gradient in place:
    groups of 1, 63, 65, 319 rows and empty ones (an empty group's wgrad is zeros), at fp8 MMA precision of
    the reference (bf16 outputs, as the experts' ops produce)."""
    from spartron.layers.fp8 import scaled_mm_backend as sb

    c = torch.tensor([1, 0, 63, 64, 65, 0, 319], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(512, 256, device="cuda", generator=g).bfloat16()
    w = (torch.randn(7, 384, 256, device="cuda", generator=g) * 0.05).bfloat16()
    grad = torch.randn(512, 384, device="cuda", generator=g).bfloat16()
    bf16 = torch.bfloat16
    xq, wq = quant.quantize_rows(x, True), quant.quantize_blocks(w, True)
    _close_at_fp8_mma_precision(sb.fprop(*xq, *wq, c, bf16).float(), reference.fprop(*xq, *wq, c, torch.float32))
    gq, wt = quant.quantize_rows(grad, True), quant.quantize_blocks_t(w, True)
    _close_at_fp8_mma_precision(sb.dgrad(*gq, *wt, c, bf16).float(), reference.dgrad(*gq, *wt, c, torch.float32))
    gt, xt = quant.quantize_cols_grouped(grad, c, True), quant.quantize_cols_grouped(x, c, True)
    out = sb.wgrad(*gt, *xt, c, bf16)
    _close_at_fp8_mma_precision(out.float(), reference.wgrad(*gt, *xt, c, torch.float32))
    assert not out[1].any() and not out[5].any()
    # one local expert of 130 rows (EP as wide as the experts): the Triton kernel, not cuBLAS (which refuses 130)
    one = torch.tensor([130], dtype=torch.int32, device="cuda")
    xq1, wq1 = quant.quantize_rows(x[:130], True), quant.quantize_blocks(w[:1], True)
    _close_at_fp8_mma_precision(sb.fprop(*xq1, *wq1, one, bf16).float(),
                                reference.fprop(*xq1, *wq1, one, torch.float32))


def _experts_step(backend: str, counts, tensors, grad, order=None, inverse=None, layout=()) -> list:
    """The routed experts' fused ops (w1|w3 pair, SwiGLU-quantised w2) forward and backward on `backend`:
    [out, dx, dw1, dw3, dw2]. `layout`: the backend's slot layout of the rows, computed once for both ops (as
    FP8GroupedExperts passes it); empty: each op computes its own."""
    leaves = [t.detach().clone().contiguous().requires_grad_() for t in tensors]
    xl, w1l, w3l, w2l = leaves
    h13 = grouped_mm_pair(xl, w1l, w3l, counts, backend, True, True, [], order, inverse, 1, list(layout))
    out = swiglu_grouped_mm(h13, w2l, counts, backend, True, True, [], list(layout))
    out.backward(grad)
    return [out] + [t.grad for t in leaves]


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0), reason="sm90 only")
def test_torch_scaled_mm_experts_match_the_triton_experts():
    """The routed experts' fused ops (w1|w3 pair, SwiGLU-quantised w2) on cuBLAS against the Triton
    kernels: the same quantised operands, so only the fp32 accumulation order differs."""
    c = torch.tensor([130, 0, 382], dtype=torch.int32, device="cuda")
    x, w, grad = _inputs(512, seed=2)
    w1, w3 = w[:, :256], w[:, 128:]
    w2 = (w[:, :256].transpose(1, 2) * 1.5).contiguous()
    results = {backend: _experts_step(backend, c, (x, w1, w3, w2), grad[:, :256])
               for backend in ("triton", "torch_scaled_mm")}
    for name, got, want in zip(("out", "dx", "dw1", "dw3", "dw2"), results["torch_scaled_mm"], results["triton"],
                               strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2 ** -6 * want.abs().max().item(),
                                   msg=name)


def test_fp8_dispatch_wire_on_the_gpu_equals_the_reference_and_keeps_the_forward():
    """model.fp8.dispatch with the Triton quantiser: the wire bytes equal the reference's, and a mirrored EP-4
    rank's FP8 MoE layer gives the bf16-dispatch layer's output and input gradient bitwise."""
    import torch.distributed as dist

    from spartron.comm.mirror import mirrored_world
    from spartron.comm.transport import EPTransport
    from spartron.layers.config import FP8Config, ModelConfig
    from spartron.layers.fp8 import apply_fp8
    from spartron.layers.fp8.wire import pack
    from spartron.layers.moe import MoELayer

    x, _, _ = _inputs(384)
    assert torch.equal(pack(x, "triton"), pack(x, "reference"))
    moe = {"n_routed_experts": 8, "n_shared_experts": 0, "top_k": 2, "moe_inter_dim": 256, "n_groups": 1,
           "topk_groups": 1, "dispatcher": "all_to_all"}
    cfg = ModelConfig.model_validate({"dim": 256, "init_std": 0.05, "dtype": "bfloat16", "moe": moe})
    results = []
    with mirrored_world(0, 4):
        for dispatch in (False, True):
            layer = MoELayer(cfg, EPTransport(dist.group.WORLD)).cuda()
            apply_fp8([layer], FP8Config(backend="triton", modules=["experts"], dispatch=dispatch))
            xin = x.view(2, 192, 256).clone().requires_grad_()
            out = layer(xin)["hidden_states"]
            out.float().square().sum().backward()
            results.append((out.detach(), xin.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def _has_deep_gemm() -> bool:
    return importlib.util.find_spec("deep_gemm") is not None  # installed (a broken build fails its tests, not skips)


@pytest.mark.skipif(not _has_deep_gemm(), reason="needs DeepGEMM (benchmarks/build_deep_gemm.sh)")
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0), reason="sm90 only")
def test_deep_gemm_grouped_gemms_equal_the_triton_kernels_on_ragged_groups():
    """fprop and dgrad on DeepGEMM, the operands quantised into the slot layout: bitwise the Triton kernel's output
    on the packed rows (the same quantised values, the same 128-deep promotion) on groups of 1, 63, 65, 319 rows
    and empty ones, one expert of 130 rows, and no rows at all."""
    from spartron.layers.fp8 import deep_gemm_backend as dg
    from spartron.layers.fp8 import triton_backend as tb

    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(512, 256, device="cuda", generator=g).bfloat16()
    w = (torch.randn(7, 384, 256, device="cuda", generator=g) * 0.05).bfloat16()
    grad = torch.randn(512, 384, device="cuda", generator=g).bfloat16()
    bf16 = torch.bfloat16
    for counts, rows in (([1, 0, 63, 64, 65, 0, 319], 512), ([130], 130), ([0, 0, 0, 0, 0, 0, 0], 0)):
        c = torch.tensor(counts, dtype=torch.int32, device="cuda")
        for got, want in zip(tb.slot_rows(c, rows), dg.padded_rows(c, rows), strict=True):  # one kernel, the same
            assert got.dtype == want.dtype and torch.equal(got, want), counts
        wg = w[:len(counts)]
        wq, wt = tb.quantize_blocks(wg, True), tb.quantize_blocks_t(wg, True)
        slots = dg.group_counts(c)  # the operands quantised into the slot layout, as the experts' ops do
        out = dg.fprop(*tb.quantize_rows(x[:rows], True, dg.gemm_rows(slots, rows, None)), *wq, slots, bf16)
        want = tb.fprop(*tb.quantize_rows(x[:rows], True), *wq, c, bf16)
        assert out.shape == (rows, 384) and torch.equal(out, want), counts
        slots = dg.group_counts(c)
        dx = dg.dgrad(*tb.quantize_rows(grad[:rows], True, dg.gemm_rows(slots, rows, None)), *wt, slots, bf16)
        want = tb.dgrad(*tb.quantize_rows(grad[:rows], True), *wt, c, bf16)
        assert dx.shape == (rows, 256) and torch.equal(dx, want), counts
    packed = tb.quantize_rows(x, True)  # rows not in the slot layout: one error, not a wrong product
    with pytest.raises(ValueError, match="must be quantised through gemm_rows"):
        dg.fprop(*packed, *tb.quantize_blocks(w, True), torch.tensor([512, 0, 0, 0, 0, 0, 0], device="cuda"), bf16)


@pytest.mark.skipif(not _has_deep_gemm(), reason="needs DeepGEMM (benchmarks/build_deep_gemm.sh)")
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0), reason="sm90 only")
def test_deep_gemm_experts_equal_the_triton_experts():
    """The routed experts' fused ops on backend 'deep_gemm' against 'triton' (the same quantisation and wgrad, the
    fprop / dgrad bitwise the Triton kernel's): every output and gradient equal, with the EP permutation fused,
    with the slot layout computed by each op or once for both (FP8GroupedExperts)."""
    from spartron.layers.fp8 import deep_gemm_backend as dg

    c = torch.tensor([130, 0, 382], dtype=torch.int32, device="cuda")
    x, w, grad = _inputs(512, seed=3)
    w1, w3 = w[:, :256], w[:, 128:]
    w2 = (w[:, :256].transpose(1, 2) * 1.5).contiguous()
    order = torch.randperm(512, device="cuda")
    inverse = torch.argsort(order)
    want = _experts_step("triton", c, (x, w1, w3, w2), grad[:, :256], order, inverse)
    for layout in ((), dg.slot_layout(c, 512)):
        got = _experts_step("deep_gemm", c, (x, w1, w3, w2), grad[:, :256], order, inverse, layout)
        for name, a, b in zip(("out", "dx", "dw1", "dw3", "dw2"), got, want, strict=True):
            assert torch.equal(a, b), (name, len(layout))


@pytest.mark.parametrize("backend", ["triton", "deep_gemm"])
def test_fp8_linear_and_experts_never_wait_for_the_gpu(backend):
    """A host sync per FP8 GEMM call (a host-list tensor copied to the device: a synchronous copy) drains the
    launch queue: the V3-shaped rehearsal was host-bound with less GPU time than bf16. Forward and backward of an
    FP8 linear and of the FP8 experts (counts on the device, as the MoE layer passes them) must not sync."""
    if backend == "deep_gemm" and not _has_deep_gemm():
        pytest.skip("needs DeepGEMM (benchmarks/build_deep_gemm.sh)")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90 only")
    from spartron.layers.config import FP8Config
    from spartron.layers.fp8 import apply_fp8
    from spartron.layers.moe.experts import GroupedExperts

    for wgrad in ("fp8", "model_dtype"):
        lin = torch.nn.Linear(256, 384, bias=False, device="cuda", dtype=torch.bfloat16)
        experts = GroupedExperts(3, 256, 128, dtype=torch.bfloat16, device="cuda")
        apply_fp8([torch.nn.ModuleList([lin, experts])], FP8Config(backend=backend, wgrad=wgrad, weight_cache="off"))
        x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        counts = torch.tensor([130, 0, 382], dtype=torch.int32, device="cuda")
        (lin(x).float().sum() + experts(x, counts).float().sum()).backward()  # the kernels compile here
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            (lin(x).float().sum() + experts(x, counts).float().sum()).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not _has_deep_gemm(), reason="needs DeepGEMM (benchmarks/build_deep_gemm.sh)")
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0), reason="sm90 only")
@pytest.mark.parametrize("wgrad", ["fp8", "model_dtype"])
@pytest.mark.parametrize("rows", [130, 4096])
def test_deep_gemm_dense_linear_equals_the_triton_linear(rows, wgrad):
    """A dense linear on "deep_gemm" runs as one group on DeepGEMM (no cuBLAS): output and both gradients bitwise the
    "triton" backend's (its one-group Triton GEMM on the same quantised values), 130 rows included."""
    from spartron.layers.config import FP8Config
    from spartron.layers.fp8 import apply_fp8

    torch.manual_seed(0)
    layers = [torch.nn.Linear(512, 384, bias=False, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    for layer, backend in zip(layers, ("deep_gemm", "triton"), strict=True):
        apply_fp8([torch.nn.ModuleList([layer])], FP8Config(backend=backend, modules=["dense"], wgrad=wgrad))
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(rows, 384, device="cuda", dtype=torch.bfloat16)
    results = []
    for layer in layers:
        xin = x.clone().requires_grad_()
        out = layer(xin)
        out.backward(grad)
        results.append((out, xin.grad, layer.weight.grad))
    for name, got, want in zip(("out", "dx", "dw"), *results, strict=True):
        assert torch.equal(got, want), name


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0), reason="sm90 only")
@pytest.mark.parametrize("rows", [130, 4096])
def test_fp8_ffn_on_the_gpu_equals_three_fp8_linears_but_dx(rows):
    """An FFN as one group of the fused expert ops ("triton", and "deep_gemm" where built): output and weight
    gradients bitwise three "triton" FP8 linears'; x's gradient one contraction (within its rounding)."""
    from spartron.layers.config import FP8Config
    from spartron.layers.ffn import FeedForward
    from spartron.layers.fp8 import apply_fp8
    from spartron.layers.fp8.modules import FP8FeedForward, FP8Linear

    torch.manual_seed(0)
    split = FeedForward(512, 384, dtype=torch.bfloat16, device="cuda")
    for lin in (split.w1, split.w3, split.w2):
        lin.__class__ = FP8Linear
        lin.fp8_backend, lin.fp8_pow2, lin.fp8_wgrad = "triton", True, True
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)

    def step(module):
        xin = x.clone().requires_grad_()
        out = module(xin)
        out.backward(grad)
        return [out, xin.grad, module.w1.weight.grad, module.w3.weight.grad, module.w2.weight.grad]

    want = step(split)
    for backend in ("triton", "deep_gemm") if _has_deep_gemm() else ("triton",):
        ffn = FeedForward(512, 384, dtype=torch.bfloat16, device="cuda")
        ffn.load_state_dict({k: v.detach() for k, v in split.state_dict().items()})
        apply_fp8([torch.nn.ModuleList([ffn])], FP8Config(backend=backend, modules=["dense"]))
        assert type(ffn) is FP8FeedForward
        got = step(ffn)
        for name, a, b in zip(("out", "dx", "dw1", "dw3", "dw2"), got, want, strict=True):
            if name == "dx":
                assert (a.float() - b.float()).abs().max() <= 2 ** -7 * b.float().abs().max(), backend
            else:
                assert torch.equal(a, b), (backend, name)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0), reason="sm90 only")
@pytest.mark.parametrize("backend", ["triton", "deep_gemm"])
def test_dense_linear_on_gathered_blocks_equals_the_cached_weight(backend):
    """A dense linear given model.fp8.param_gather's blocks (JointBlocks in the ops' one-group form) computes what
    it computes from its own weight cache, bitwise; on "deep_gemm" the gathered s^T's layout is what DeepGEMM's
    dgrad asserts (a V3 rehearsal with param_gather failed there at 2b17780)."""
    from spartron.layers.fp8.gathered import JointBlocks
    from spartron.layers.fp8.ops import linear as fp8_linear

    if backend == "deep_gemm" and not _has_deep_gemm():
        pytest.skip("needs DeepGEMM (benchmarks/build_deep_gemm.sh)")
    torch.manual_seed(0)
    w = (torch.randn(384, 512, device="cuda") * 0.05).bfloat16()
    x = torch.randn(130, 512, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(130, 384, device="cuda", dtype=torch.bfloat16)
    joint = JointBlocks([w.shape])
    q, s = reference.quantize_blocks_cat((w,), True)
    joint.set_scales(0, s)
    joint.write(0, q)
    results = []
    for cached in ([], joint.blocks(lead=True)):
        xin, win = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fp8_linear(xin, win, backend, True, True, cached)
        out.backward(grad)
        results.append((out, xin.grad))
    for name, got, want in zip(("out", "dx"), *results, strict=True):
        assert torch.equal(got, want), name
