"""The "deep_gemm" backend's row plumbing on CPU: operands quantised into the slot layout (gemm_rows), the grouped
GEMM's psum layout, the output gathered back to the packed rows. DeepGEMM itself runs only on sm90; here a
stand-in computes what its `m_grouped_fp8_gemm_nt_contiguous(..., use_psum_layout=True)` computes (group g's
rows from its previous end rounded up to 128 to its end, dequantise and multiply), so the test holds Spartron's
side of that contract: the result must equal the reference backend's GEMM on the packed rows bitwise. The GPU
test (test_fp8_gpu.py) holds the real kernel to the Triton one."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from spartron.layers.fp8 import deep_gemm_backend as dg
from spartron.layers.fp8 import quant, reference


def _psum_grouped_gemm(a, b, out, ends, use_psum_layout=False):
    assert use_psum_layout
    (aq, sa_t), (bq, sb) = a, b
    start = 0
    for g, end in enumerate(ends.tolist()):
        if end > start:
            x = quant.dequantize_rows(aq[start:end], sa_t[start:end].t())
            out[start:end] = (x @ quant.dequantize_blocks(bq[g], sb[g]).t()).to(out.dtype)
        start = -(-end // 128) * 128


@pytest.fixture
def stand_in(monkeypatch):
    module = types.ModuleType("deep_gemm")
    module.m_grouped_fp8_gemm_nt_contiguous = _psum_grouped_gemm
    monkeypatch.setitem(sys.modules, "deep_gemm", module)


def _rows(t, index):
    return t if index is None else t.index_select(0, index)


@pytest.mark.parametrize("counts", [[130, 0, 126], [1, 0, 63, 64, 65, 0, 63], [256], [130]])
def test_slot_layout_operands_give_the_packed_rows_gemm(stand_in, counts):
    """Any groups (one group of whole tiles, 256 rows, reads its rows as they are: no slot rows)."""
    c = torch.tensor(counts, dtype=torch.int32)
    m = int(c.sum())
    g = torch.Generator().manual_seed(len(counts))
    x = torch.randn(m, 256, generator=g).bfloat16()
    grad = torch.randn(m, 384, generator=g).bfloat16()
    w = (torch.randn(len(counts), 384, 256, generator=g) * 0.05).bfloat16()
    wq, wt = quant.quantize_blocks(w, True), quant.quantize_blocks_t(w, True)
    order = torch.randperm(m, generator=g)
    for index in (None, order):  # the EP regrouping read through the index, composed with the slot rows
        slots = dg.group_counts(c)
        rows = dg.gemm_rows(slots, m, index)
        assert (rows is index) == (counts == [256])
        out = dg.fprop(*quant.quantize_rows(_rows(x, rows), True), *wq, slots, torch.bfloat16)
        packed = x if index is None else x.index_select(0, index)
        assert torch.equal(out, reference.fprop(*quant.quantize_rows(packed, True), *wq, c, torch.bfloat16))
    slots = dg.group_counts(c)
    rows = dg.gemm_rows(slots, m, None)
    dx = dg.dgrad(*quant.quantize_rows(_rows(grad, rows), True), *wt, slots, torch.bfloat16)
    want = reference.dgrad(*quant.quantize_rows(grad, True), *wt, c, torch.bfloat16)
    assert torch.equal(dx, want)
    # the output's rows in another order (the experts' gradient through their regrouping's inverse): one gather
    # from the slot layout gives what the reference's rows gathered give
    for backend in (dg, reference):
        got = backend.dgrad(*quant.quantize_rows(_rows(grad, rows if backend is dg else None), True), *wt,
                            slots if backend is dg else c, torch.bfloat16, order)
        assert torch.equal(got, want.index_select(0, order)), backend.__name__
    # the one-rank replication's top-k: each token's k rows (consecutive in that order) summed in the same gather
    for backend in (dg, reference):  # every count sums to an even row count: 2 slots a token
        got = backend.dgrad(*quant.quantize_rows(_rows(grad, rows if backend is dg else None), True), *wt,
                            slots if backend is dg else c, torch.bfloat16, order, 2)
        assert torch.equal(got, want.index_select(0, order).view(-1, 2, want.shape[-1]).sum(dim=1)), backend.__name__


def test_the_experts_layout_computed_once_serves_every_gemm_of_their_ops(stand_in):
    """FP8GroupedExperts computes the rows' slot layout once per forward (slot_layout) and hands it to both ops and
    their backward: the counts built from it read the rows through that very layout (no layout kernel per op), give
    the reference GEMM's values, and refuse another row count."""
    c = torch.tensor([130, 0, 126], dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 256, generator=g).bfloat16()
    w = (torch.randn(3, 384, 256, generator=g) * 0.05).bfloat16()
    wq = quant.quantize_blocks(w, True)
    layout = dg.slot_layout(c, 256)
    assert [t.shape for t in layout] == [(quant.tile_slots(256, 3) * 128,), (256,), (3,)]
    for want, got in zip(dg.padded_rows(c, 256), layout, strict=True):
        assert torch.equal(want, got)
    for _ in range(2):  # each op builds its counts from the same layout
        slots = dg.group_counts(c, layout)
        assert dg.gemm_rows(slots, 256, None) is layout[0]
        out = dg.fprop(*quant.quantize_rows(x.index_select(0, layout[0]), True), *wq, slots, torch.bfloat16)
        assert torch.equal(out, reference.fprop(*quant.quantize_rows(x, True), *wq, c, torch.bfloat16))
    with pytest.raises(ValueError, match="one op's GEMMs take 256 rows, got 128"):
        dg.gemm_rows(dg.group_counts(c, layout), 128, None)
    assert quant.slot_layout(c, 256) == [] and quant.group_counts(c, []) is c  # packed rows: nothing to share


def test_rows_not_in_the_slot_layout_are_refused_and_no_rows_give_none(stand_in):
    c = torch.tensor([128, 0], dtype=torch.int32)
    x = torch.randn(128, 256).bfloat16()
    wq = quant.quantize_blocks((torch.randn(2, 128, 256) * 0.05).bfloat16(), True)
    with pytest.raises(ValueError, match="must be quantised through gemm_rows"):
        dg.fprop(*quant.quantize_rows(x, True), *wq, c, torch.bfloat16)
    slots = dg.group_counts(c)
    rows = dg.gemm_rows(slots, 128, None)
    with pytest.raises(ValueError, match="one op's GEMMs take 128 rows, got 64"):
        dg.gemm_rows(slots, 64, None)
    with pytest.raises(ValueError, match="the slot layout of 128 has 384"):
        dg.fprop(*quant.quantize_rows(x.index_select(0, rows[:256]), True), *wq, slots, torch.bfloat16)
    none = torch.zeros(2, dtype=torch.int32)
    assert dg.slot_layout(none, 0) == []  # an EP rank that received no rows: the experts' shared layout is empty
    for empty in (dg.group_counts(none), dg.group_counts(none, dg.slot_layout(none, 0)), dg.one_group(x[:0])):
        assert dg.gemm_rows(empty, 0, None) is None
        out = dg.fprop(*quant.quantize_rows(x[:0], True), *wq, empty, torch.bfloat16)
        assert out.shape == (0, 128)


@pytest.mark.parametrize("rows", [130, 256])
def test_a_dense_linear_runs_as_one_group_in_the_slot_layout(stand_in, rows):
    """A dense linear on "deep_gemm" is one group on DeepGEMM's grouped GEMM (cuBLAS's blockwise GEMM cost 2.46 ms
    of host time per linear and refused rows not a multiple of 4): the reference GEMMs' values bitwise, any row
    count, and its bf16 wgrad grad^T @ x without reading the count on the device. Rows in whole tiles (256) are
    their own slot layout: no slot rows to read through (gemm_rows None) and no gather of the output."""
    from spartron.layers.fp8 import gemms

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=g).bfloat16()
    grad = torch.randn(rows, 384, generator=g).bfloat16()
    w = (torch.randn(1, 384, 256, generator=g) * 0.05).bfloat16()
    one = torch.tensor([rows], dtype=torch.int32)

    def slot_operand(t, slots):
        index = dg.gemm_rows(slots, rows, None)
        assert (index is None) == (rows % 128 == 0)
        return quant.quantize_rows(t if index is None else t.index_select(0, index), True)

    slots = dg.one_group(x)
    assert isinstance(slots, dg.SlotCounts) and not slots.dense and torch.equal(slots.device, one)
    out = dg.fprop(*slot_operand(x, slots), *quant.quantize_blocks(w, True), slots, torch.bfloat16)
    assert torch.equal(out, reference.fprop(*quant.quantize_rows(x, True), *quant.quantize_blocks(w, True), one,
                                            torch.bfloat16))
    slots = dg.one_group(x)
    dx = dg.dgrad(*slot_operand(grad, slots), *quant.quantize_blocks_t(w, True), slots, torch.bfloat16)
    assert torch.equal(dx, reference.dgrad(*quant.quantize_rows(grad, True), *quant.quantize_blocks_t(w, True), one,
                                           torch.bfloat16))
    assert torch.equal(gemms.unquantised_wgrad(grad, x, dg.one_group(x)), (grad.t() @ x).unsqueeze(0))
    if rows % 128 == 0:  # the packed operand is the layout: another row count is refused, as in the slot layout
        with pytest.raises(ValueError, match=f"one op's GEMMs take {rows} rows, got 128"):
            dg.gemm_rows(dg.one_group(x), 128, None)
        slots = dg.one_group(x)
        assert dg.gemm_rows(slots, rows, None) is None
        with pytest.raises(ValueError, match=f"128 operand rows, the slot layout of {rows} has {rows}"):
            dg.fprop(*quant.quantize_rows(x[:128], True), *quant.quantize_blocks(w, True), slots, torch.bfloat16)
