"""Packed documents through the layers: the document mask, per-document RoPE, DSA top-k and MTP targets.

The reference everywhere is each document run ALONE (positions 0..n-1, plain causal attention): a
packed row must give every document exactly what it gets on its own.
"""

from __future__ import annotations

import pytest
import torch

from spartron.layers.attention.doc_mask import (
    document_block_mask,
    document_shifted_labels,
    document_visible,
    flex_document_attention,
    reference_block_mask,
    reference_document_attention,
)
from spartron.layers.attention.mla import MLA
from spartron.layers.config import ModelConfig
from spartron.layers.model import build_model
from spartron.runtime.config import ConfigError, load_config

MLA_SHAPES = dict(q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)
LENGTHS = [[3, 5, 4], [12]]  # documents of each packed row of 12 tokens


def positions_of(lengths: list[list[int]]) -> torch.Tensor:
    return torch.tensor([[p for n in row for p in range(n)] for row in lengths])


def make_cfg(dsa=None, **kw) -> ModelConfig:
    return ModelConfig.model_validate(dict(dim=16, n_heads=3, n_layers=3, first_k_dense=1, mla=MLA_SHAPES, dsa=dsa,
                                           **kw))


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3 + (1.0 if p.dim() == 1 else 0.0))


def test_document_visible_is_causal_within_each_document():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    expected = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                             [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(document_visible(pos)[0], expected)
    assert torch.equal(document_visible(pos, slice(2, 5))[0], expected[2:5])


def test_reference_and_flex_attention_equal_each_document_alone():
    g = torch.Generator().manual_seed(0)
    pos = positions_of(LENGTHS)
    q, k = torch.randn(2, 3, 12, 10, generator=g, dtype=torch.float64), torch.randn(2, 3, 12, 10, generator=g,
                                                                                      dtype=torch.float64)
    v = torch.randn(2, 3, 12, 5, generator=g, dtype=torch.float64)
    ref = reference_document_attention(q, k, v, pos, 0.3)
    for b, row in enumerate(LENGTHS):
        start = 0
        for n in row:
            part = slice(start, start + n)
            alone = torch.nn.functional.scaled_dot_product_attention(q[b:b + 1, :, part], k[b:b + 1, :, part],
                                                                     v[b:b + 1, :, part], is_causal=True, scale=0.3)
            torch.testing.assert_close(ref[b:b + 1, :, part], alone, rtol=1e-12, atol=1e-12)
            start += n
    with pytest.warns(UserWarning, match="without torch.compile"):  # eager flex: the unfused implementation
        flex = flex_document_attention(q.float(), k.float(), v.float(), pos, 0.3, compiled=False)
    torch.testing.assert_close(flex, ref.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seq, block, mean", [(512, 128, 100), (1024, 64, 300), (256, 128, 1000), (200, 128, 50)])
def test_block_mask_from_document_starts_equals_create_block_mask(seq, block, mean):
    from benchmarks.doc_mask import document_positions

    pos = document_positions(2, seq, mean, seed=seq)
    fast, ref = document_block_mask(pos, block), reference_block_mask(pos, block)
    assert torch.equal(fast.to_dense(), ref.to_dense())
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks"):
        assert torch.equal(getattr(fast, name), getattr(ref, name)), name
    if seq % (4 * block) == 0:  # CP = 2, rank 1: the local queries are chunks 1 and 2 of 4, keys all of them
        from spartron.layers.attention.context_parallel import local_positions

        q_index = local_positions(seq, 2, 1)
        fast = document_block_mask(pos[:, q_index], block, q_index=q_index, n_keys=seq)
        ref = reference_block_mask(pos[:, q_index], block, q_index=q_index, n_keys=seq)
        assert torch.equal(fast.to_dense(), ref.to_dense())
        assert torch.equal(fast.full_kv_indices, ref.full_kv_indices) and torch.equal(fast.kv_indices, ref.kv_indices)


def _alone(layer: MLA, x: torch.Tensor, lengths: list[list[int]]) -> list[tuple[int, slice, dict]]:
    out = []
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            part = slice(start, start + n)
            out.append((b, part, layer(x[b:b + 1, part], torch.arange(n))))
            start += n
    return out


def test_dense_mla_on_packed_documents_equals_each_document_alone():
    layer = MLA(make_cfg(), 0).double()
    randomize(layer)
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    packed = layer(x, positions_of(LENGTHS))["hidden_states"]
    for b, part, alone in _alone(layer, x, LENGTHS):
        torch.testing.assert_close(packed[b:b + 1, part], alone["hidden_states"], rtol=1e-10, atol=1e-10)
    # without the document mask the second document of row 0 would see the first
    plain = layer(x, torch.arange(12))["hidden_states"]
    assert not torch.allclose(plain[0, 3:8], packed[0, 3:8])


@pytest.mark.parametrize("mode", ["frozen", "kl_dense", "kl_sparse"])
def test_dsa_source_selects_within_documents_and_equals_each_document_alone(mode):
    coeff = 0.0 if mode == "frozen" else 0.5
    # top-k 5: every key of row 0's short documents (so ReLU ties cannot pick differently at another offset),
    # a real selection in row 1's long document; without the mask row 0's picks would reach earlier documents
    cfg = make_cfg(dsa=dict(n_index_heads=2, index_head_dim=8, index_topk=5, topk_freq=2, indexer_mode=mode,
                            indexer_loss_coeff=coeff))
    layer = MLA(cfg, 1).double()
    randomize(layer)
    x = torch.randn(2, 12, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    pos = positions_of(LENGTHS)
    out = layer(x, pos)
    ids = out["dsa_topk_ids"]
    start = torch.arange(12)[None, :] - pos  # each query's document start
    chosen = ids >= 0
    assert torch.all((ids <= torch.arange(12)[None, :, None]) | ~chosen)
    assert torch.all((ids >= start[..., None]) | ~chosen)  # never a key of an earlier document
    kl_sum = 0.0
    for b, part, alone in _alone(layer, x, LENGTHS):
        torch.testing.assert_close(out["hidden_states"][b:b + 1, part], alone["hidden_states"], rtol=1e-10,
                                   atol=1e-10)
        if mode != "frozen":  # the KL target and scores see the document too: the loss is the query mean
            kl_sum = kl_sum + alone["indexer_loss"] * (part.stop - part.start)
        local = torch.where(ids[b:b + 1, part] >= 0, ids[b:b + 1, part] - part.start, -1)
        k = alone["dsa_topk_ids"].shape[-1]  # the same key sets (ties may come in another order)
        assert torch.equal(local[..., :k].sort(-1).values, alone["dsa_topk_ids"].sort(-1).values)
        assert torch.all(local[..., k:] == -1)
    if mode != "frozen":
        torch.testing.assert_close(out["indexer_loss"], kl_sum / 24, rtol=1e-10, atol=1e-12)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_runs_on_cuda_outside_checkpoint_regions_only():
    from spartron.checkpointing import checkpoint
    from spartron.layers.attention.doc_mask import uses_flex

    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # device objects only: nothing runs on them
    assert uses_flex(cuda) and not uses_flex(cpu)
    seen, failures = [], []
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 12, 10, generator=g) for _ in range(3))

    def region(x):
        seen.append(uses_flex(cuda))
        try:  # why the rule exists: FlexAttention's higher-order op refuses the policy's dispatch mode
            flex_document_attention(q, k, v, positions_of(LENGTHS), 0.3, compiled=False)
        except NotImplementedError as err:
            failures.append(str(err))
        return x * 2

    x = torch.ones(3, requires_grad=True)
    checkpoint(region, x).sum().backward()  # original pass and replay, each under the AC policy's mode
    assert seen == [False, False] and len(failures) == 2
    assert "no rule registered for HigherOrderOperator flex_attention" in failures[0]


def test_mtp_targets_stop_at_document_boundaries():
    labels = torch.tensor([[10, 11, -100, 20, 21, 22]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    assert document_shifted_labels(labels, pos, 1).tolist() == [[11, -100, -100, 21, 22, -100]]
    assert document_shifted_labels(labels, pos, 2).tolist() == [[-100, -100, -100, 22, -100, -100]]
    assert torch.equal(document_shifted_labels(labels, pos, 0), labels)


def test_model_loss_on_packed_row_is_the_token_mean_of_each_document_alone():
    cfg = load_config("configs/tiny.toml", ["model.mtp.depth=1", "model.dtype=float32"]).model
    model = build_model(cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(2, 512, (n,), generator=g) for n in (9, 14, 9)]
    tokens = torch.cat(docs)[None]
    labels = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in docs])[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    packed = model(tokens, labels, positions=pos)
    lm_sum, mtp_sum, n_lm, n_mtp = 0.0, 0.0, 0, 0
    for d in docs:
        own_labels = torch.cat([d[1:], torch.tensor([-100])])[None]
        alone = model(d[None], own_labels)
        n = len(d) - 1
        lm_sum, n_lm = lm_sum + alone["lm_loss"] * n, n_lm + n
        mtp_sum, n_mtp = mtp_sum + alone["mtp_losses"][0] * (n - 1), n_mtp + n - 1  # depth 1: n - 1 targets
    torch.testing.assert_close(packed["lm_loss"], lm_sum / n_lm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed["mtp_losses"][0], mtp_sum / n_mtp, rtol=1e-5, atol=1e-5)
    plain = model(tokens, labels)  # the same row without positions: documents see each other
    assert abs(plain["lm_loss"].detach().item() - packed["lm_loss"].detach().item()) > 1e-4


def _packed_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    docs = [[torch.randint(2, 512, (n,), generator=g) for n in lengths] for lengths in ([5, 11, 16], [20, 12])]
    tokens = torch.stack([torch.cat(row) for row in docs])
    labels = torch.stack([torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in row]) for row in docs])
    positions = torch.stack([torch.cat([torch.arange(len(d)) for d in row]) for row in docs])
    return tokens, labels, positions


def _cp_worker(rank, world):  # noqa: ANN001, ARG001
    from spartron.parallel.dims import ParallelDims
    from spartron.parallel.groups import ParallelGroups

    groups = ParallelGroups.build(ParallelDims(world, fsdp=1, cp=2), "cpu")
    tokens, labels, positions = _packed_batch()
    got = {}
    for mode in ("frozen", "kl_dense"):  # the indexer_topk path with document starts, and the KL path's mask
        over = ["model.mtp.depth=1", f"model.dsa.indexer_mode={mode}", "model.dsa.index_topk=4"]
        over += [] if mode == "frozen" else ["model.dsa.indexer_loss_coeff=0.5"]
        cfg = load_config("configs/tiny.toml", over).model
        ref = build_model(cfg, seed=0)(tokens, labels, positions=positions)
        out = build_model(cfg, groups, seed=0)(tokens, labels, positions=positions)
        pairs = {"lm_loss": (out["lm_loss"], ref["lm_loss"]), "mtp": (out["mtp_losses"][0], ref["mtp_losses"][0])}
        if mode != "frozen":
            pairs["indexer_loss"] = (out["indexer_loss"], ref["indexer_loss"])
        for key, (a, b) in pairs.items():
            value = a.detach().clone()
            torch.distributed.all_reduce(value)  # each rank's loss is scaled so the mean over ranks is global
            got[f"{mode} {key}"] = (float(value / world), float(b))
    return got


def test_packed_documents_under_context_parallelism_equal_one_rank():
    from spartron.testing import run_distributed

    results = run_distributed(_cp_worker, 2, timeout=120)
    assert set(results[0]) == {"frozen lm_loss", "frozen mtp", "kl_dense lm_loss", "kl_dense mtp",
                               "kl_dense indexer_loss"}
    for key, (cp2, one) in results[0].items():
        assert cp2 == pytest.approx(one, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("scope", ["layer", "experts"])
def test_intra_layer_micro_batches_split_the_document_positions_with_the_rows(scope):
    cfg = load_config("configs/tiny.toml", ["model.mtp.depth=1"]).model
    tokens, labels, positions = _packed_batch()
    whole = build_model(cfg, seed=0)(tokens, labels, positions=positions)
    split = build_model(cfg, seed=0, micro_batches=2, micro_batch_scope=scope)(tokens, labels, positions=positions)
    for key in ("lm_loss", "aux_loss"):
        torch.testing.assert_close(split[key], whole[key], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(split["mtp_losses"][0], whole["mtp_losses"][0], rtol=1e-5, atol=1e-6)


def test_document_mask_config_errors():
    load_config("configs/tiny.toml", ["train.data.kind=packed", "train.data.path=/x", "parallel.cp=2"])
    with pytest.raises(ConfigError, match="train.data.doc_mask is set but a flat token file"):
        load_config("configs/tiny.toml", ["train.data.kind=mmap", "train.data.path=/x", "train.data.doc_mask=true"])
    with pytest.raises(ConfigError, match="train.data.token_dtype is set but train.data.kind = 'packed'"):
        load_config("configs/tiny.toml", ["train.data.kind=packed", "train.data.path=/x",
                                          "train.data.token_dtype=uint32"])
    with pytest.raises(ConfigError, match="train.data.val_fraction is set but train.data.kind = 'synthetic'"):
        load_config("configs/tiny.toml", ["train.data.val_fraction=0.1"])
    with pytest.raises(ConfigError, match="train.data.path is required when train.data.kind = 'packed'"):
        load_config("configs/tiny.toml", ["train.data.kind=packed"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's compiled kernel needs CUDA")
def test_flex_document_attention_on_cuda_matches_the_masked_reference():
    from benchmarks.doc_mask import document_positions
    from spartron.layers.attention.doc_mask import document_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    pos = document_positions(2, 1024, 200).cuda()
    q, k = (torch.randn(2, 4, 1024, 192, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in "qk")
    v = torch.randn(2, 4, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    out = document_attention(q, k, v, pos, 192**-0.5)
    out.float().square().sum().backward()
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = reference_document_attention(qr, kr, vr, pos, 192**-0.5)
    ref.square().sum().backward()
    for got, want in ((out, ref), (q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
        err = (got.float() - want).norm() / want.norm()
        assert err < 1e-2, float(err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's compiled kernel needs CUDA")
def test_model_on_cuda_packed_row_equals_each_document_alone():
    """The CUDA path end to end (FlexAttention with the block mask from document starts in every layer, MTP
    targets), forward and backward, against each document alone. Without DSA: the sparse-MLA CUDA kernel
    takes DeepSeek-V3 shapes only (head dim 576), not the tiny preset's; the indexer's document bound is
    tested on CPU above."""
    cfg = load_config("configs/tiny.toml", ["model.mtp.depth=1", "model.max_seq_len=512"]).model
    cfg = cfg.model_copy(update={"dsa": None})
    with torch.device("cuda"):
        model = build_model(cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(2, 512, (n,), generator=g) for n in (100, 156)]  # 256 tokens: two 128-blocks
    tokens = torch.cat(docs)[None].cuda()
    labels = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in docs])[None].cuda()
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None].cuda()
    packed = model(tokens, labels, positions=pos)
    packed["lm_loss"].backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    lm_sum, n_lm = 0.0, 0
    with torch.no_grad():
        for d in docs:
            alone = model(d[None].cuda(), torch.cat([d[1:], torch.tensor([-100])])[None].cuda())
            lm_sum, n_lm = lm_sum + alone["lm_loss"] * (len(d) - 1), n_lm + len(d) - 1
    torch.testing.assert_close(packed["lm_loss"].detach(), lm_sum / n_lm, rtol=1e-4, atol=1e-4)
