"""The experts' fused FP8 ops equal the unfused path bitwise (reference backend, CPU), the experts
module runs them, torch_scaled_mm's scale layouts pass torch's own checks (meta device), and counts
that do not cover the rows are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spartron.layers.fp8 import grouped_mm, scaled_mm_backend
from spartron.layers.fp8.expert_ops import grouped_mm_pair, swiglu_grouped_mm
from spartron.layers.fp8.modules import FP8GroupedExperts
from spartron.layers.moe.experts import GroupedExperts
from spartron.layers.swiglu import swiglu

COUNTS = [130, 0, 254]


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(384, 256, generator=g).bfloat16()
    w1, w3 = ((torch.randn(3, 128, 256, generator=g) * 0.05).bfloat16() for _ in range(2))
    w2 = (torch.randn(3, 256, 128, generator=g) * 0.05).bfloat16()
    grad = torch.randn(384, 256, generator=g).bfloat16()
    return x, w1, w3, w2, grad


def _run(x, w1, w3, w2, grad, path: str, pow2: bool = True):
    x, w1, w3, w2 = (t.clone().requires_grad_() for t in (x, w1, w3, w2))
    counts = torch.tensor(COUNTS, dtype=torch.int32)
    if path == "fused":
        h13 = grouped_mm_pair(x, w1, w3, counts, "reference", pow2, True, [], None, None, 1, [])
        out = swiglu_grouped_mm(h13, w2, counts, "reference", pow2, True, [], [])
    elif path == "w13":  # the recipe's definition: one grouped GEMM over the concatenated [w1; w3]
        gate, up = grouped_mm(x, torch.cat([w1, w3], 1), counts, "reference", pow2, True).split(128, dim=1)
        out = grouped_mm(swiglu(gate, up), w2, counts, "reference", pow2, True)
    else:  # two GEMMs: x's gradient is the bf16 sum of two rounded results
        h = swiglu(*(grouped_mm(x, w, counts, "reference", pow2, True) for w in (w1, w3)))
        out = grouped_mm(h, w2, counts, "reference", pow2, True)
    out.backward(grad)
    return out, x.grad, w1.grad, w3.grad, w2.grad


@pytest.mark.parametrize("wgrad", ["fp8", "model_dtype"])
def test_an_fp8_ffn_is_one_group_of_the_fused_ops_and_equals_three_fp8_linears_but_dx(wgrad):
    """A SwiGLU FeedForward (dense FFN, shared experts) in FP8 runs the experts' fused ops as one group: x quantised
    once for w1 and w3 (one GEMM over [w1; w3]), SwiGLU's product quantised where produced. Output and weight
    gradients equal three FP8Linear (the per-linear path, which "torch_scaled_mm" keeps) bitwise; x's gradient is
    one contraction over both halves. Parameters and state_dict keys are the FeedForward's."""
    from spartron.layers.config import FP8Config
    from spartron.layers.ffn import FeedForward
    from spartron.layers.fp8 import apply_fp8
    from spartron.layers.fp8.apply import ffn_eligible
    from spartron.layers.fp8.modules import FP8FeedForward, FP8Linear

    torch.manual_seed(0)
    ffn = FeedForward(256, 384, dtype=torch.bfloat16)
    split = FeedForward(256, 384, dtype=torch.bfloat16)
    split.load_state_dict(ffn.state_dict())
    keys = list(ffn.state_dict())
    assert apply_fp8([torch.nn.ModuleList([ffn])], FP8Config(backend="reference", wgrad=wgrad)) == ["0.0"]
    assert type(ffn) is FP8FeedForward and type(ffn.w1) is torch.nn.Linear and list(ffn.state_dict()) == keys
    for lin in (split.w1, split.w3, split.w2):  # the per-linear path
        lin.__class__ = FP8Linear
        lin.fp8_backend, lin.fp8_pow2, lin.fp8_wgrad = "reference", True, wgrad == "fp8"
    assert not ffn_eligible(FeedForward(256, 384), "torch_scaled_mm") and ffn_eligible(FeedForward(256, 384), "triton")
    assert not ffn_eligible(FeedForward(256, 96), "triton")  # an inter dim the 128-wide tiles do not divide
    x = torch.randn(2, 96, 256, dtype=torch.bfloat16)  # 192 rows: one group, not whole tiles
    grad = torch.randn(2, 96, 256, dtype=torch.bfloat16)
    results = []
    for module in (ffn, split):
        xi = x.clone().requires_grad_()
        out = module(xi)
        out.backward(grad)
        results.append([out, xi.grad, module.w1.weight.grad, module.w3.weight.grad, module.w2.weight.grad])
    for name, a, b in zip(("out", "dx", "dw1", "dw3", "dw2"), *results, strict=True):
        assert a.shape == b.shape and torch.equal(a, b) == (name != "dx"), name
    diff = (results[0][1].float() - results[1][1].float()).abs()
    assert 0 < diff.max() <= 2 ** -7 * results[1][1].float().abs().max()


@pytest.mark.parametrize("pow2", [True, False])
def test_fused_expert_ops_equal_the_unfused_path_bitwise_but_dx_is_one_contraction(pow2):
    """out, dw1, dw3, dw2 equal two GEMMs' bitwise; dx equals one dgrad over [w1; w3] (K = 2I, fp32
    across both halves, rounded once) bitwise and differs from the two-GEMM bf16 sum dx1 + dx3 by that
    sum's rounding only: the recipe's definition (Megatron's fused fc1 alike), a numerics change."""
    inputs = _inputs(0)
    fused, w13, unfused = (_run(*inputs, path=p, pow2=pow2) for p in ("fused", "w13", "unfused"))
    for name, a, b, c in zip(("out", "dx", "dw1", "dw3", "dw2"), fused, w13, unfused, strict=True):
        assert torch.equal(a, b), name
        assert torch.equal(a, c) == (name != "dx"), name
    diff = (fused[1].float() - unfused[1].float()).abs()
    assert 0 < diff.max() <= 2 ** -7 * unfused[1].float().abs().max()  # within bf16's rounding of the sum
    assert torch.equal(fused[2][1], torch.zeros(128, 256, dtype=torch.bfloat16))  # the empty expert
    assert fused[0].abs().sum() > 0 and fused[1].abs().sum() > 0


def test_fp8_experts_module_runs_the_fused_ops_and_matches_their_composition():
    x = _inputs(1)[0]
    experts = GroupedExperts(3, 256, 128, mode="loop", dtype=torch.bfloat16)
    experts.__class__ = FP8GroupedExperts
    experts.fp8_backend, experts.fp8_pow2, experts.fp8_wgrad = "reference", True, True
    out = experts(x, COUNTS)
    counts = torch.tensor(COUNTS, dtype=torch.int32)
    h = swiglu(*(grouped_mm(x, w, counts, "reference", True, True) for w in (experts.w1, experts.w3)))
    assert torch.equal(out, grouped_mm(h, experts.w2, counts, "reference", True, True))
    with pytest.raises(ValueError, match="tokens_per_expert sums to 383, x has 384 rows"):
        experts(x, [130, 0, 253])


def test_the_swiglu_backward_is_swiglus():
    """The fused op's gate / up gradients (the halves of h13's) are spartron.layers.ffn.swiglu's on the same dh."""
    g = torch.Generator().manual_seed(2)
    gate, up = (torch.randn(256, 128, generator=g).bfloat16() for _ in range(2))
    w = (torch.randn(1, 128, 128, generator=g) * 0.05).bfloat16()
    counts = torch.tensor([256], dtype=torch.int32)
    grad = torch.randn(256, 128, generator=g).bfloat16()
    h13 = torch.cat([gate, up], 1).requires_grad_()
    swiglu_grouped_mm(h13, w, counts, "reference", True, True, [], []).backward(grad)
    h = swiglu(gate.clone().requires_grad_(), up.clone().requires_grad_())
    dh = torch.autograd.grad(grouped_mm(h, w, counts, "reference", True, True), h, grad)[0]
    assert torch.equal(h13.grad[:, :128], torch.ops.aten.silu_backward(dh * up, gate))
    assert torch.equal(h13.grad[:, 128:], dh * F.silu(gate))


@pytest.mark.parametrize("cache", ["off", "on"])
@pytest.mark.parametrize("k", [1, 3])
def test_experts_read_a_gathered_plan_in_place_and_equal_the_written_rows_bitwise(k, cache):
    """The last regrouping before the experts as a GatheredRows plan, passed as tensors (order, inverse) and
    k: the EP permutation (k = 1) or the one-rank replication into top-k slots (k = 3). The FP8 experts
    quantise x[order // k] reading x through the index (those rows never written) and send x's gradient
    back through the inverse, each token's k copies summed; output, x's gradient and every weight gradient
    equal the experts on the plan written out (`permute_rows` / `replicate_tokens`) bitwise. The bf16
    experts write the plan out first: the same as before."""
    from spartron.layers.config import FP8Config
    from spartron.layers.fp8 import apply_fp8
    from spartron.layers.moe.dispatch import GatheredRows, inverse_permutation

    g = torch.Generator().manual_seed(3)
    x = torch.randn(384 // k, 256, generator=g).bfloat16()
    grad = torch.randn(384, 256, generator=g).bfloat16()
    order = torch.randperm(384, generator=g)
    inverse = inverse_permutation(order)
    counts = torch.tensor(COUNTS)
    for fp8 in (True, False):
        results = []
        for gathered in (True, False):
            torch.manual_seed(0)
            experts = GroupedExperts(3, 256, 128, dtype=torch.bfloat16, init_std=0.05)
            if fp8:
                apply_fp8([experts], FP8Config(backend="reference", modules=["experts"], weight_cache=cache))
            source = x.clone().requires_grad_()
            out = experts(source, counts, order, inverse, k) if gathered else \
                experts(GatheredRows(source, order, inverse, k).materialize(), counts)
            out.backward(grad)
            results.append([out, source.grad, *(p.grad for p in experts.parameters())])
        for name, a, b in zip(("out", "dx", "dw1", "dw3", "dw2"), *results, strict=True):
            assert torch.equal(a, b), (fp8, name)


@pytest.mark.parametrize("counts, k, n", [([256], 384, 640), ([384], 512, 256), ([128], 128, 128), ([4], 128, 256),
                                          ([100, 0, 300, 17], 384, 640), ([0, 129, 1], 256, 128)])
def test_scaled_mm_operands_pass_torchs_checks(counts, k, n):
    """torch's `_scaled_mm_v2` meta function runs the CUDA op's shape and stride checks on the arguments of
    every cuBLAS GEMM: K/128 = 3 needs the 128x128 scales padded to 4 rows, the wgrad's right-hand 1x128
    scales are [K, tiles] outer-dim-major, one group's slots are views of any group count (an empty group
    runs none), and the scales of half the rows of [w1; w3]'s gradient are copied to strides (1, N)."""
    fp8 = torch.float8_e4m3fn
    m, groups = sum(counts), len(counts)
    gc = scaled_mm_backend.GroupCounts(torch.tensor(counts, dtype=torch.int32), counts)

    def q(*shape):
        return torch.empty(*shape, dtype=fp8, device="meta")

    def s(*shape):
        return torch.empty(*shape, device="meta")

    def run(kind, a, sa, b, sb):
        return [(g, F.scaled_mm(*args, output_dtype=torch.bfloat16).shape)
                for g, args in scaled_mm_backend.group_operands(kind, a, sa, b, sb, gc)]

    if groups == 1:
        assert run("fprop", q(m, k), s(k // 128, m), q(1, n, k), s(1, n // 128, k // 128)) == [(0, (m, n))]
        # dgrad's weight as quantize_blocks_t writes it: w^T [1, K, N], scales [1, K/128, N/128] (a view)
        assert run("dgrad", q(m, n), s(n // 128, m), q(1, k, n), s(1, n // 128, k // 128).transpose(1, 2)) \
            == [(0, (m, k))]
    else:
        with pytest.raises(ValueError, match=f"fprop on cuBLAS takes one group of all {m} rows"):
            run("fprop", q(m, k), s(k // 128, m), q(groups, n, k), s(groups, n // 128, k // 128))
    # wgrad's operands in the slot-aligned layout: [C, T * 128], scales [C, T] slot-major
    slots = m // 128 + groups
    expected = [(g, (n, k)) for g, c in enumerate(counts) if c]
    assert run("wgrad", q(n, slots * 128), s(slots, n).t(), q(k, slots * 128), s(slots, k).t()) == expected
    half = s(slots, 2 * n).t()[:n]  # [w1; w3]'s gradient scales, w1's rows: strides (1, 2N)
    assert run("wgrad", q(2 * n, slots * 128)[:n], half, q(k, slots * 128), s(slots, k).t()) == expected


@pytest.mark.parametrize("rows", [1, 130])
def test_scaled_mm_dense_rows_not_a_multiple_of_four_are_refused_naming_the_backend(rows):
    """cuBLASLt's blockwise GEMM returned NOT_SUPPORTED for 1 and 130 rows on the GPU (4, 16, 136 ran): one
    line naming the option instead."""
    q = torch.empty(rows, 128, dtype=torch.float8_e4m3fn, device="meta")
    gc = scaled_mm_backend.GroupCounts(torch.tensor([rows]), [rows])
    w = torch.empty(1, 256, 128, dtype=torch.float8_e4m3fn, device="meta")
    with pytest.raises(ValueError, match=rf"model.fp8.backend = 'torch_scaled_mm': .* multiple of 4 rows, this fprop "
                                         rf"has {rows} \(use backend 'triton'\)"):
        scaled_mm_backend.group_operands("fprop", q, torch.empty(1, rows, device="meta"), w,
                                         torch.empty(1, 2, 1, device="meta"), gc)


def test_only_a_dense_linear_runs_fprop_and_dgrad_on_cublas():
    """The rule is "a dense linear", not "one group": routed experts with one local expert (EP as wide as the
    experts) go to the Triton kernel, which takes any row count cuBLAS refuses."""
    x = torch.empty(130, 128)
    assert scaled_mm_backend.one_group(x).dense and scaled_mm_backend.one_group(x).host == [130]
    gc = scaled_mm_backend.one_group(x)
    assert gc._device is None  # cuBLAS reads the host count: nothing launched until the device count is read
    assert torch.equal(gc.device, torch.tensor([130], dtype=torch.int32)) and gc.device is gc.device
    assert not scaled_mm_backend.group_counts(torch.tensor([130])).dense


def test_group_counts_sync_only_when_read_and_slots_follow_the_counts():
    gc = scaled_mm_backend.group_counts(torch.tensor([300, 0, 128, 1]))
    assert gc._host is None  # nothing read on the host yet: a forward through the Triton kernels never syncs
    assert scaled_mm_backend._slot_ranges(gc) == [(0, 0, 3), (2, 3, 1), (3, 4, 1)]
    assert gc.host == [300, 0, 128, 1] and scaled_mm_backend.group_counts(gc) is gc


def test_block_scales_pad_to_four_rows_column_major():
    s = torch.arange(12.0).reshape(2, 2, 3)  # [G = 2, N/128 = 2, K/128 = 3]
    out = scaled_mm_backend.block_scales(s)
    assert out.shape == (2, 4, 2) and out[1].stride() == (1, 4)
    assert torch.equal(out[:, :3], s.transpose(1, 2)) and torch.equal(out[:, 3], torch.zeros(2, 2))
    # K/128 a multiple of 4 and contiguous (quantize_blocks' own output): that layout already, a view
    s = torch.arange(16.0).reshape(2, 2, 4)
    out = scaled_mm_backend.block_scales(s)
    assert out.data_ptr() == s.data_ptr() and out.shape == (2, 4, 2) and out[1].stride() == (1, 4)
    assert torch.equal(out, s.transpose(1, 2))
    # dgrad's transposed view [G, K/128, N/128] of contiguous [G, N/128, K/128]: copied into the layout
    t = torch.arange(16.0).reshape(2, 4, 2).transpose(1, 2)
    out = scaled_mm_backend.block_scales(t)
    assert out.data_ptr() != t.data_ptr() and out[1].stride() == (1, 4) and torch.equal(out, t.transpose(1, 2))
