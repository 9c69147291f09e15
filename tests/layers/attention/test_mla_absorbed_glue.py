"""The absorbed-MLA products (attention.absorbed): the einsum form's values and gradients bitwise, with
fewer copies of latent-wide rows; compiled, the einsum form itself with no graph break."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from spartron.checkpointing import CheckpointOptions, CheckpointRegion, build_policy
from spartron.layers.attention.absorbed import absorbed_query, latent_values
from spartron.layers.attention.mla import MLA
from spartron.layers.attention.sparse_mla import sparse_mla
from spartron.layers.config import ModelConfig

B, S, H, NOPE, ROPE, C, V, K = 2, 24, 4, 16, 8, 32, 12, 6
COPIES = ("aten::cat", "aten::clone", "aten::copy_", "aten::_to_copy", "aten::contiguous")


class CopyLog(TorchDispatchMode):
    """(phase, op, output shape) of every copy-like op as it reaches the dispatcher (what a GPU launches)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[str, str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name
        if name in COPIES:
            written = args[0] if name == "aten::copy_" else next(t for t in tree_leaves(out)
                                                                 if isinstance(t, torch.Tensor))
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            self.copies.append((phase, name, tuple(written.shape)))
        return out


def einsum_query(q_nope, q_pe, w_uk):
    return torch.cat((torch.einsum("bshn,hnc->bshc", q_nope, w_uk), q_pe), dim=-1)


def einsum_values(latent, w_uv):
    return torch.einsum("bshc,hvc->bshv", latent, w_uv)


def inputs(seed=0, dtype=torch.float32):
    """Leaves laid out as in MLA: q [B,S,H,NOPE+ROPE] split, W_uk / W_uv views of one wkv_b weight."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, NOPE + ROPE, generator=g, dtype=dtype).requires_grad_()
    wkv_b = torch.randn(H * (NOPE + V), C, generator=g, dtype=dtype).requires_grad_()
    kv = torch.randn(B, S, C + ROPE, generator=g, dtype=dtype).requires_grad_()
    ids = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(B * S)]).view(B, S, K).int()
    ids[:, :, -1] = -1  # an empty slot
    cotangent = torch.randn(B, S, H * V, generator=g, dtype=dtype)
    return q, wkv_b, kv, ids, cotangent


def absorbed_attention(query, values, q, wkv_b, kv, ids):
    """MLA._sparse's absorbed path: q_abs -> spartron::sparse_mla -> per-head values -> [B, S, H*V]."""
    w = wkv_b.view(H, NOPE + V, C)
    q_nope, q_pe = q.split([NOPE, ROPE], dim=-1)
    q_abs = query(q_nope, q_pe * 0.5, w[:, :NOPE])  # q_pe through an op, as RoPE does
    out_latent, _ = sparse_mla(q_abs, kv, ids, 0.3, C)
    return values(out_latent, w[:, NOPE:]).reshape(B, S, H * V)


def values_and_grads(query, values, seed=0):
    q, wkv_b, kv, ids, cotangent = inputs(seed)
    out = absorbed_attention(query, values, q, wkv_b, kv, ids)
    out.backward(cotangent)
    return [out.detach(), q.grad, wkv_b.grad, kv.grad]


def test_absorbed_products_equal_the_einsum_form_bitwise_in_float32():
    expected = values_and_grads(einsum_query, einsum_values)
    got = values_and_grads(absorbed_query, latent_values)
    for name, a, b in zip(("out", "dq", "dwkv_b", "dkv"), got, expected, strict=True):
        assert torch.equal(a, b), name
    assert all(torch.count_nonzero(t) > 0 for t in got)


def test_q_abs_is_one_contiguous_buffer_with_the_rope_part_last():
    q, wkv_b, *_ = inputs()
    w = wkv_b.view(H, NOPE + V, C)[:, :NOPE]
    q_abs = absorbed_query(q[..., :NOPE], q[..., NOPE:], w)
    assert q_abs.shape == (B, S, H, C + ROPE) and q_abs.is_contiguous()
    assert torch.equal(q_abs[..., C:], q[..., NOPE:])
    torch.testing.assert_close(q_abs[1, 5, 2, :C], q[1, 5, 2, :NOPE] @ w[2], rtol=1e-5, atol=1e-5)  # head 2's W_uk


def test_no_copy_of_latent_wide_rows_forward_or_backward():
    """Every copy of the chain, per form. Both keep the reference op's int64 ids and q's split backward
    (cat of the q_nope and q_pe grads); the absorbed form drops the cat of q_abs (only q_pe is copied
    into its tail), the values' reshape copy for wo and the copy of the latent grad for sparse_mla."""
    logs = {}
    for name, fns in (("einsum", (einsum_query, einsum_values)), ("absorbed", (absorbed_query, latent_values))):
        with CopyLog() as log:
            values_and_grads(*fns)
        logs[name] = log.copies
    ids, split = ("forward", "aten::_to_copy", (B, S, K)), ("backward", "aten::cat", (B, S, H, NOPE + ROPE))
    assert logs["einsum"] == [ids, ("forward", "aten::cat", (B, S, H, C + ROPE)),
                              ("forward", "aten::clone", (B, S, H, V)),
                              ("backward", "aten::clone", (B, S, H, C)), split]
    assert logs["absorbed"] == [ids, ("forward", "aten::copy_", (B, S, H, ROPE)), split]


def test_compiled_form_matches_eager_with_no_graph_break():
    torch._dynamo.reset()
    q, wkv_b, kv, ids, cotangent = inputs(seed=1)
    fn = torch.compile(lambda *a: absorbed_attention(absorbed_query, latent_values, *a), backend="aot_eager",
                       fullgraph=True)
    out = fn(q, wkv_b, kv, ids)
    out.backward(cotangent)
    expected = values_and_grads(absorbed_query, latent_values, seed=1)
    for name, a, b in zip(("out", "dq", "dwkv_b", "dkv"), [out.detach(), q.grad, wkv_b.grad, kv.grad], expected,
                          strict=True):
        assert torch.equal(a, b), name
    torch._dynamo.reset()


def test_dsa_layer_gradients_equal_dense_mla_with_all_keys():
    """Layer level, float64: a DSA layer selecting every key is dense MLA, gradients included."""
    mla = dict(q_lora_rank=0, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)

    def cfg(dsa=None):
        return ModelConfig.model_validate(dict(dim=16, n_heads=3, n_layers=3, first_k_dense=1, mla=mla, dsa=dsa))

    dense = MLA(cfg(), 0).double()
    sparse = MLA(cfg(dict(n_index_heads=2, index_head_dim=8, index_topk=64)), 1).double()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in dense.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    sparse.load_state_dict(dense.state_dict(), strict=False)
    x = torch.randn(2, 7, 16, dtype=torch.float64, generator=g)
    cotangent = torch.randn(2, 7, 16, dtype=torch.float64, generator=g)
    grads = []
    for layer in (dense, sparse):
        xi = x.clone().requires_grad_()
        with CopyLog() as log:
            layer(xi, torch.arange(7))["hidden_states"].backward(cotangent)
        grads.append([xi.grad] + [p.grad for n, p in layer.named_parameters() if not n.startswith("indexer.")])
        if layer is sparse:
            assert [c for c in log.copies if torch.Size(c[2]).numel() >= 2 * 7 * 3 * 12] == []
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


def test_selective_ac_replays_the_in_place_products_bitwise():
    """Selective AC saves aten::bmm; the query's bmm writes into q_abs (`out=`), so the region keeps what
    it wrote and the replay copies it into the replay's own q_abs: gradients as without AC."""
    results = []
    for mode in (None, "selective", "full"):
        q, wkv_b, kv, ids, cotangent = inputs(seed=2)
        args = (absorbed_query, latent_values, q, wkv_b, kv, ids)
        region = CheckpointRegion(CheckpointOptions(policy=build_policy(mode), name="mla")) if mode else None
        out = region(absorbed_attention, *args) if region else absorbed_attention(*args)
        out.backward(cotangent)
        if mode == "selective":
            assert region.last_stats.saved_by_op["aten::bmm"] == 2 and region.last_stats.replay_count == 1
        results.append([out.detach(), q.grad, wkv_b.grad, kv.grad])
    for got in results[1:]:
        for name, a, b in zip(("out", "dq", "dwkv_b", "dkv"), got, results[0], strict=True):
            assert torch.equal(a, b), name
