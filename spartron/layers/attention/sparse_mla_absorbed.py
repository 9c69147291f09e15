"""`spartron::sparse_mla_absorbed`: a DSA layer's whole absorbed attention (absorb_query -> sparse_mla ->
absorb_output) in query chunks of `model.dsa.attention_chunk` rows, so nothing [S, H, 576]-wide outlives a chunk.

Why (issue 39): at 128 heads the absorbed form's per-token tensors are 4.5x dense MLA's per-head width. Unchunked,
one DSA layer's backward holds the absorbed query [S, H, 576], the latent output [S, H, 512] and both their
gradients (34 GiB at 64k), and selective AC keeps the latent output of every DSA layer (8 GiB each at 64k): that
is what made DSA hold more than dense attention. This op keeps what dense attention keeps: its inputs (q_nope is
a view of wq's output, which the AC policy keeps anyway; q_pe; the latent rows; the ids) and its output
[B, S, H * v], which is wo's input. Its backward recomputes each chunk's absorbed query and sparse forward (one
more sparse forward per step than keeping the latent output), then runs the unchunked path's three backward
formulas (absorb.output_grads, spartron::sparse_mla_backward, absorb.query_grads) on the chunk.

Numerics: each chunk makes the unchunked path's calls on its rows. The output and the query gradients are per
query row: bitwise the unchunked path's when the kernels' per-row results do not depend on the rows in a call (the
sparse kernels run one program per query; one chunk covering every row is the unchunked path bitwise, tested).
The w_uk / w_uv and latent-row (kv) gradients sum over rows: each chunk's partial comes rounded to the inputs' dtype
(the unchunked backward's calls return them so), the partials are added in float32 (float64 inputs: float64) and
the sum rounded once: with n chunks in bf16 up to about n roundings of a partial apart from one sum over all rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from spartron.layers.attention.absorb import absorb_output, absorb_query, output_grads, query_grads
from spartron.layers.attention.sparse_mla import default_chunk_size, sparse_mla


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def chunk_rows(s: int, chunk: int) -> Iterator[slice]:
    """The query-row slices of one call: `chunk` rows each (the last may be shorter); chunk >= 1."""
    if chunk < 1:
        raise ValueError(f"sparse_mla_absorbed: chunk must be >= 1 query row, got {chunk}")
    return (slice(c0, min(c0 + chunk, s)) for c0 in range(0, s, chunk))


@dataclass(frozen=True)
class AbsorbedQuery:
    """The absorbed query cat(q_nope W_uk, q_pe) [B, S, H, c + r] without materialising it: what both KL forms read
    chunk by chunk when the attention runs chunked (indexer_kl.sparse_attention_target, indexer_kl_dense)."""

    q_nope: Tensor
    q_pe: Tensor
    w_uk: Tensor
    chunk: int

    def rows(self) -> Iterator[slice]:
        return chunk_rows(self.q_nope.shape[1], self.chunk)

    def at(self, rows: slice) -> Tensor:
        """Rows `rows` of the absorbed query, detached (the KL target is detached)."""
        with torch.no_grad():
            return absorb_query(self.q_nope[:, rows], self.q_pe[:, rows], self.w_uk)


def _latent(q_nope: Tensor, q_pe: Tensor, kv: Tensor, ids: Tensor, w_uk: Tensor, scale: float,
            deterministic: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One chunk's absorbed query, ids, latent output and lse, by the unchunked path's calls."""
    q_abs = absorb_query(q_nope, q_pe, w_uk)
    ids = ids.contiguous()
    lat, lse = sparse_mla(q_abs, kv, ids, scale, w_uk.shape[-1], deterministic=deterministic)
    return q_abs, ids, lat, lse


@torch.library.custom_op("spartron::sparse_mla_absorbed", mutates_args=())
def _absorbed(q_nope: Tensor, q_pe: Tensor, kv: Tensor, ids: Tensor, w_uk: Tensor, w_uv: Tensor, scale: float,
              chunk: int, deterministic: bool) -> Tensor:
    b, s, h, _ = q_nope.shape
    slices = list(chunk_rows(s, chunk))
    if len(slices) == 1:  # the unchunked path's tensor itself
        return absorb_output(_latent(q_nope, q_pe, kv, ids, w_uk, scale, deterministic)[2], w_uv)
    out = q_nope.new_empty(b, s, h * w_uv.shape[1])
    for rows in slices:
        lat = _latent(q_nope[:, rows], q_pe[:, rows], kv, ids[:, rows], w_uk, scale, deterministic)[2]
        out[:, rows] = absorb_output(lat, w_uv)
    return out


@_absorbed.register_fake
def _(q_nope, q_pe, kv, ids, w_uk, w_uv, scale, chunk, deterministic):
    b, s, h, _ = q_nope.shape
    return q_nope.new_empty(b, s, h * w_uv.shape[1])


@torch.library.custom_op("spartron::sparse_mla_absorbed_backward", mutates_args=())
def _absorbed_backward(grad: Tensor, q_nope: Tensor, q_pe: Tensor, kv: Tensor, ids: Tensor, w_uk: Tensor,
                       w_uv: Tensor, scale: float, chunk: int, deterministic: bool,
                       needs: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of (q_nope, q_pe, kv, w_uk, w_uv) that `needs` asks for (a frozen weight's, or a frozen
    layer's inputs', are never computed: an empty tensor stands in); the sparse backward runs only when a query or
    latent-row gradient, or w_uk's, is needed."""
    n_nope, n_pe, n_kv, n_uk, n_uv = needs
    acc = _acc(q_nope.dtype)
    d_nope, d_pe = (torch.empty_like(t) if n else t.new_empty(0) for t, n in ((q_nope, n_nope), (q_pe, n_pe)))
    d_kv, d_w_uk, d_w_uv = (torch.zeros(t.shape, dtype=acc, device=t.device) if n else t.new_empty(0)
                            for t, n in ((kv, n_kv), (w_uk, n_uk), (w_uv, n_uv)))
    need_lat = n_nope or n_pe or n_kv or n_uk
    for rows in chunk_rows(q_nope.shape[1], chunk):
        q_abs, ids_c, lat, lse = _latent(q_nope[:, rows], q_pe[:, rows], kv, ids[:, rows], w_uk, scale,
                                         deterministic)
        d_lat, dw_uv = output_grads(grad[:, rows], lat, w_uv, need_lat, n_uv)
        if n_uv:
            d_w_uv += dw_uv
        if need_lat:
            dq, dkv = torch.ops.spartron.sparse_mla_backward(
                d_lat.contiguous(), torch.zeros_like(lse), q_abs, kv, ids_c, lat, lse, scale, w_uk.shape[-1],
                default_chunk_size(q_abs, kv, ids_c), deterministic)
            del q_abs, lat, d_lat
            dn, dp, dw_uk = query_grads(dq, q_nope[:, rows], w_uk, n_nope, n_uk)
            if n_nope:
                d_nope[:, rows] = dn
            if n_pe:
                d_pe[:, rows] = dp
            if n_kv:
                d_kv += dkv
            if n_uk:
                d_w_uk += dw_uk
    return d_nope, d_pe, d_kv.to(kv.dtype), d_w_uk.to(w_uk.dtype), d_w_uv.to(w_uv.dtype)


@_absorbed_backward.register_fake
def _(grad, q_nope, q_pe, kv, ids, w_uk, w_uv, scale, chunk, deterministic, needs):
    inputs = (q_nope, q_pe, kv, w_uk, w_uv)
    return tuple(torch.empty_like(t) if n else t.new_empty(0) for t, n in zip(inputs, needs, strict=True))


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    q_nope, q_pe, kv, ids, w_uk, w_uv, scale, chunk, deterministic = inputs
    ctx.save_for_backward(q_nope, q_pe, kv, ids, w_uk, w_uv)
    ctx.args = (scale, chunk, deterministic)


def _backward(ctx, grad: Tensor):  # noqa: ANN001, ANN202
    q_nope, q_pe, kv, ids, w_uk, w_uv = ctx.saved_tensors
    n = ctx.needs_input_grad
    needs = [n[0], n[1], n[2], n[4], n[5]]
    grads = _absorbed_backward(grad.contiguous(), q_nope, q_pe, kv, ids, w_uk, w_uv, *ctx.args, needs)
    d_nope, d_pe, d_kv, d_w_uk, d_w_uv = (g if need else None for g, need in zip(grads, needs, strict=True))
    return d_nope, d_pe, d_kv, None, d_w_uk, d_w_uv, None, None, None


_absorbed.register_autograd(_backward, setup_context=_setup_context)


def sparse_mla_absorbed(q_nope: Tensor, q_pe: Tensor, kv: Tensor, ids: Tensor, w_uk: Tensor, w_uv: Tensor,
                        scale: float, chunk: int, deterministic: bool = False) -> Tensor:
    """absorb_output(sparse_mla(absorb_query(q_nope, q_pe, w_uk), kv, ids)[0], w_uv) -> [B, S, H * v], `chunk`
    query rows at a time. q_nope [B,S,H,n], q_pe [B,S,H,r], kv [B,S_kv,c+r], ids [B,S,K] int32, w_uk [H,n,c],
    w_uv [H,v,c]; `deterministic` as for sparse_mla."""
    if q_nope.dim() != 4 or q_pe.shape[:3] != q_nope.shape[:3] or ids.shape[:2] != q_nope.shape[:2]:
        raise ValueError(f"sparse_mla_absorbed: q_nope [B,S,H,n], q_pe [B,S,H,r] and ids [B,S,K] must agree; got "
                         f"{tuple(q_nope.shape)}, {tuple(q_pe.shape)}, {tuple(ids.shape)}")
    if chunk < 1:
        raise ValueError(f"sparse_mla_absorbed: chunk must be >= 1 query row, got {chunk}")
    return _absorbed(q_nope, q_pe, kv, ids, w_uk, w_uv, float(scale), int(chunk), bool(deterministic))
