"""Blockwise FP8 numerics on CPU: exact scales, round-trip bounds, and the ops equal a hand-written
dequantise-then-matmul (the reference backend is the exact model the GPU kernels are tested against)."""

from __future__ import annotations

import torch

from spartron.layers.fp8 import grouped_mm, linear
from spartron.layers.fp8.quant import (
    FP8,
    dequantize_blocks,
    dequantize_cols_grouped,
    dequantize_rows,
    quantize_blocks,
    quantize_blocks_t,
    quantize_cols_grouped,
    quantize_rows,
    token_columns,
)


def _hand_quantize(values: torch.Tensor) -> torch.Tensor:
    """One tile by hand: power-of-two scale at or above amax / 448, values rounded to e4m3, back in fp32."""
    amax = values.float().abs().max().item()
    scale = 1.0 if amax == 0 else 2.0 ** torch.tensor(amax / 448.0).log2().ceil().item()
    return (values.float() / scale).clamp(-448, 448).to(FP8).float() * scale


def _hand_rows(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape)
    for r in range(x.shape[0]):
        for c in range(0, x.shape[1], 128):
            out[r, c:c + 128] = _hand_quantize(x[r, c:c + 128])
    return out


def _hand_blocks(w: torch.Tensor) -> torch.Tensor:
    out = torch.empty(w.shape)
    for r in range(0, w.shape[0], 128):
        for c in range(0, w.shape[1], 128):
            out[r:r + 128, c:c + 128] = _hand_quantize(w[r:r + 128, c:c + 128])
    return out


def _hand_cols(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[C, M]: 128-token tiles per column restarting at every group."""
    out, start = torch.empty(x.shape[1], x.shape[0]), 0
    for count in counts:
        for lo in range(start, start + count, 128):
            hi = min(lo + 128, start + count)
            for c in range(x.shape[1]):
                out[c, lo:hi] = _hand_quantize(x[lo:hi, c])
        start += count
    return out


def test_row_scales_are_exact_powers_of_two_or_amax_over_448():
    x = torch.zeros(3, 256)
    x[0, 5] = 448 * 2.0 ** -3  # amax exactly a power of two times 448: scale 2^-3, value maps to 448
    x[1, 130] = -100.0  # second tile of row 1
    q, s = quantize_rows(x, pow2=True)
    assert s.shape == (2, 3)  # [K/128, M], column-major
    assert s[0, 0].item() == 2.0 ** -3 and q[0, 5].float().item() == 448.0
    assert s[1, 1].item() == 0.25  # 100 / 448 = 0.223 -> 2^-2
    assert q[1, 130].float().item() == -384.0  # -400 lies halfway between -384 and -416: ties to even
    assert s[0, 2].item() == 1.0 and s[1, 2].item() == 1.0  # all-zero tiles: scale 1
    _, s_plain = quantize_rows(x, pow2=False)
    assert s_plain[1, 1].item() == torch.tensor(100.0 / 448.0).item()


def test_round_trip_error_within_e4m3_bounds():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 384, generator=g) * torch.logspace(-3, 2, 384)
    q, s = quantize_blocks(w)
    assert s.shape == (2, 3)
    back = dequantize_blocks(q, s)
    scale = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    # 3 mantissa bits: half an ulp is 2^-4 relative; subnormals step 2^-9 of the scale
    assert ((back - w).abs() <= torch.maximum(w.abs() * 2.0 ** -4, scale * 2.0 ** -10)).all()
    x = torch.randn(64, 256, generator=g)
    back = dequantize_rows(*quantize_rows(x))
    assert ((back - x).abs() <= x.abs() * 2.0 ** -4 + 1e-12).all()


def test_column_tiles_restart_at_each_expert_and_unused_slots_are_zero():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 128, generator=g)
    x[129, 7] = 1000.0  # in group 0's second tile (rows 128..129): only that tile's scale grows
    counts = torch.tensor([130, 0, 170])
    q_t, s = quantize_cols_grouped(x, counts)
    assert q_t.shape == (128, 5 * 128) and s.shape == (128, 300 // 128 + 3)  # 5 slots of 128 columns
    assert s.stride() == (1, 128) and q_t.is_contiguous()  # scales slot-major; q_t row-major as the kernels read it
    assert s[7, 1].item() == 4.0  # 1000 / 448 -> 2^2
    assert s[7, 0].item() < 1 and s[7, 2].item() < 1  # tiles 0 (rows 0..127) and group 2's first tile
    assert torch.equal(s[:, 4], torch.zeros(128))  # 2 + 2 tiles used of 5 slots
    # slot-aligned: group 0 rows 0..129 at columns 0..129, group 2 rows 130..299 at columns 256..425
    cols = torch.cat([torch.arange(0, 130), torch.arange(256, 426)])
    assert torch.equal(token_columns(counts), cols)
    values = q_t.float() * s.repeat_interleave(128, dim=1)
    assert torch.equal(values[:, cols], _hand_cols(x, [130, 0, 170]))
    padding = torch.ones(640, dtype=torch.bool)
    padding[cols] = False  # rows past each group's count (130..255, 426..511) and the unused slot (512..639)
    assert torch.equal(q_t.view(torch.uint8)[:, padding], torch.zeros(128, 640 - 300, dtype=torch.uint8))
    assert torch.equal(dequantize_cols_grouped(q_t, s, counts), values[:, cols])


def test_token_columns_start_every_group_at_a_multiple_of_128():
    counts = torch.tensor([0, 1, 128, 129, 0, 3], dtype=torch.int32)
    cols = token_columns(counts)
    starts = [0, 128, 256, 512]  # groups 1, 2, 3, 5: slot starts 0, 1, 2, 4 (group 3 takes two slots)
    assert cols[0].item() == starts[0] and cols[1].item() == starts[1] and cols[129].item() == starts[2]
    assert cols[257].item() == 384  # group 3's 129th row: its second slot
    assert cols[258].item() == starts[3] and cols.tolist()[-3:] == [512, 513, 514]
    assert len(cols) == 261 and 514 < 128 * (261 // 128 + 6)  # within the static tile_slots bound


def test_counts_that_do_not_cover_the_rows_are_refused_by_the_column_quantiser():
    x = torch.zeros(256, 128)
    try:
        quantize_cols_grouped(x, torch.tensor([128, 127]))
    except ValueError as err:
        assert str(err) == "fp8 blockwise: tokens_per_expert sums to 255, x has 256 rows"
    else:
        raise AssertionError("not refused")


def test_transposed_blocks_are_the_blocks_transposed():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(2, 256, 384, generator=g) * torch.logspace(-2, 1, 384)
    (q, s), (qt, st) = quantize_blocks(w), quantize_blocks_t(w)
    assert qt.shape == (2, 384, 256) and qt.is_contiguous() and st.shape == (2, 3, 2)
    assert torch.equal(qt.view(torch.uint8), q.transpose(1, 2).view(torch.uint8))
    assert torch.equal(st, s.transpose(1, 2))
    assert torch.equal(dequantize_blocks(qt, st), dequantize_blocks(q, s).transpose(1, 2))


def test_grouped_mm_forward_and_gradients_equal_dequantise_then_matmul():
    g = torch.Generator().manual_seed(2)
    counts = [130, 0, 126]
    x = torch.randn(256, 256, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(3, 128, 256, generator=g) * 0.05).bfloat16().requires_grad_()
    grad = torch.randn(256, 128, generator=g).bfloat16()
    out = grouped_mm(x, w, torch.tensor(counts, dtype=torch.int32), "reference", True, True)
    out.backward(grad)

    xd, gd = _hand_rows(x.detach()), _hand_rows(grad)
    wd = [_hand_blocks(w.detach()[e]) for e in range(3)]
    gt, xt = _hand_cols(grad, counts), _hand_cols(x.detach(), counts)
    ref_out, ref_dx = torch.zeros(256, 128), torch.zeros(256, 256)
    ref_dw = torch.zeros(3, 128, 256)
    bounds = [(0, 130), (130, 130), (130, 256)]
    for e, (lo, hi) in enumerate(bounds):
        ref_out[lo:hi] = xd[lo:hi] @ wd[e].t()
        ref_dx[lo:hi] = gd[lo:hi] @ wd[e]
        ref_dw[e] = gt[:, lo:hi] @ xt[:, lo:hi].t()
    assert torch.equal(out, ref_out.bfloat16())
    assert torch.equal(x.grad, ref_dx.bfloat16())
    assert torch.equal(w.grad, ref_dw.bfloat16())
    assert torch.equal(w.grad[1], torch.zeros(128, 256, dtype=torch.bfloat16))  # the empty expert


def test_linear_forward_and_gradients_equal_dequantise_then_matmul_and_stay_near_bf16():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 64, 128, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(256, 128, generator=g) * 0.05).bfloat16().requires_grad_()
    grad = torch.randn(2, 64, 256, generator=g).bfloat16()
    out = linear(x, w, "reference", True, True, [])
    out.backward(grad)
    x2, g2 = x.detach().reshape(128, 128), grad.reshape(128, 256)
    assert torch.equal(out, (_hand_rows(x2) @ _hand_blocks(w.detach()).t()).bfloat16().reshape(2, 64, 256))
    assert torch.equal(x.grad, (_hand_rows(g2) @ _hand_blocks(w.detach())).bfloat16().reshape(2, 64, 128))
    assert torch.equal(w.grad, (_hand_cols(g2, [128]) @ _hand_cols(x2, [128]).t()).bfloat16())
    exact = x.detach().float() @ w.detach().float().t()
    rel = ((out.float() - exact).norm() / exact.norm()).item()
    assert 1e-3 < rel < 0.05, rel  # measured 0.03: the FP8 error, not zero (the op does quantise)


def test_deep_gemm_padded_rows_put_each_group_where_deep_gemms_psum_layout_reads_it():
    """The "deep_gemm" backend's slot layout: each packed row goes to its token column (the wgrad's slot layout),
    the padded rows read row 0 (no output keeps them), and each group's end row is where DeepGEMM's psum layout
    ends it, its start being the previous end rounded up to 128 rows (how DeepGEMM's sm90 scheduler walks it)."""
    from spartron.layers.fp8.deep_gemm_backend import padded_rows

    counts = torch.tensor([0, 1, 128, 129, 0, 3], dtype=torch.int32)
    source, dest, ends = padded_rows(counts, 261)
    assert torch.equal(dest, token_columns(counts))
    assert source.shape == (128 * (261 // 128 + 6),)
    assert torch.equal(source[dest], torch.arange(261))
    unused = torch.ones(len(source), dtype=torch.bool)
    unused[dest] = False
    assert not source[unused].any()
    assert ends.dtype == torch.int32 and ends.tolist() == [0, 1, 256, 385, 512, 515]
    starts = [0] + [-(-e // 128) * 128 for e in ends.tolist()[:-1]]
    for g, (start, end) in enumerate(zip(starts, ends.tolist(), strict=True)):
        assert end - start == counts[g].item() and torch.equal(source[start:end], torch.arange(
            int(counts[:g].sum()), int(counts[:g + 1].sum()))), g
    empty = padded_rows(torch.zeros(3, dtype=torch.int32), 0)
    assert empty[0].shape == (3 * 128,) and empty[1].numel() == 0 and empty[2].tolist() == [0, 0, 0]
