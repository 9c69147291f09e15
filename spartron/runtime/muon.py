"""Distributed Muon for sharded MoE models, with AdamW for what Muon does not take.

Which parameters: `spartron.layers.costs.muon_takes` (one rule for the optimizer and the memory model):
2-D weights and the 3-D routed-expert stacks [experts, out, in] (each expert its own matrix), unless a
matrix dim is the vocabulary size (embedding, head). Vectors (norms, biases) and those go to AdamW.
Experts join Muon because each expert is a linear layer like any other; leaving them to AdamW (as
before) gave most of an MoE model's weights the other optimizer.

One update, per matrix M with gradient G (lr and weight decay from its group):
  M *= 1 - lr * wd;  buf = momentum * buf + G;  U = G + momentum * buf (Nesterov)
  M -= lr * sqrt(max(1, rows / cols)) * NS5(U)
NS5 is the quintic Newton-Schulz iteration (Muon's coefficients) on U / ||U||_F, in float32 (bfloat16
for bfloat16 gradients, as Muon's own recipe runs it); the scale keeps tall matrices' update RMS like
square ones' (the rule of the first Spartron Muon, kept).

Each matrix is orthogonalised once per data-parallel replica, never on every rank:
- A tensor already whole on this rank (one rank; a replicated tensor; routed experts sharded over
  expert_fsdp on their expert dim, whole experts per rank, distinct per EP rank) is orthogonalised here,
  the experts of one tensor as one batched Newton-Schulz over [E_local, out, in].
- A tensor sharded on a matrix dim (FSDP2's dense weights; experts split on dim 1) is owned by one rank of
  its shard group, assigned largest-first to the least-loaded rank. Per bucket (shard group, dtype) one
  all-to-all brings every owned tensor's shards to its owner, which orthogonalises the whole tensors
  (same-shape matrices batched), and one all-to-all sends each rank the rows of its shards.
Shard sizes come from the shapes (torch.chunk's split, checked against each local shard): the step makes
no host sync and branches on no tensor value; AdamW's bias corrections use a per-parameter step tensor.

State is torch's usual per-parameter dict: `momentum_buffer` (a DTensor with the parameter's placement)
for Muon, `step` / `exp_avg` / `exp_avg_sq` for AdamW, so DCP saves and reshards it like AdamW's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz_orthogonalize(g: Tensor, steps: int = 5) -> Tensor:
    """Approximate U V^T of each matrix g = U S V^T (g: [..., m, n]) by the quintic Newton-Schulz iteration."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(torch.bfloat16 if g.dtype == torch.bfloat16 else torch.float32)
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=torch.float32)
    x = (x / (norm + 1e-7)).to(x.dtype)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if transposed else x).to(g.dtype)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class _Item:
    """One Muon parameter: how its matrices are laid out over the ranks."""

    param: Tensor
    index: int
    rows: int
    cols: int
    scale: float  # sqrt(max(1, rows / cols))
    dim: int = -1  # the tensor dim sharded over the bucket's group; -1: whole on this rank
    sizes: list[int] = field(default_factory=list)  # that dim's length on each rank of the group
    owner: int = -1

    def shape_at(self, k: int) -> list[int]:
        shape = list(self.param.shape)
        shape[self.dim] = self.sizes[k]
        return shape

    def numel_at(self, k: int) -> int:
        return math.prod(self.shape_at(k))

    def start_at(self, k: int) -> int:
        return sum(self.sizes[:k])


@dataclass
class _Bucket:
    """Tensors sharded over one process group with one dtype: exchanged by one all-to-all each way."""

    group: dist.ProcessGroup
    size: int
    rank: int
    items: list[_Item] = field(default_factory=list)


def _chunk_sizes(length: int, n: int) -> list[int]:
    """torch.chunk's split of `length` over n ranks (DTensor's Shard and FSDP2 use it): ceil-sized chunks."""
    c = -(-length // n)
    return [max(0, min(c, length - k * c)) for k in range(n)]


def _layout(item: _Item) -> tuple[dist.ProcessGroup, int, int] | None:
    """(shard group, group size, my index) of a tensor split over a matrix dim; None when whole here."""
    p = item.param
    if not isinstance(p, DTensor):
        return None
    shards = [(d, pl) for d, pl in enumerate(p.placements) if not pl.is_replicate()]
    if any(not pl.is_shard() for _, pl in shards) or len(shards) > 1:
        raise ValueError(f"Muon: a {tuple(p.shape)} parameter has placements {p.placements}; it supports one "
                         "Shard (FSDP2) with Replicate (HSDP) only")
    if not shards:
        return None
    mesh_dim, placement = shards[0]
    n = p.device_mesh.size(mesh_dim)
    if n == 1 or (p.ndim == 3 and placement.dim == 0):
        return None  # whole matrices here (routed experts split on their expert dim)
    group, me = p.device_mesh.get_group(mesh_dim), p.device_mesh.get_local_rank(mesh_dim)
    if dist.get_rank(group) != me:
        raise ValueError(f"Muon: shard index {me} of a {tuple(p.shape)} parameter is not its rank in its group")
    item.dim = placement.dim
    item.sizes = _chunk_sizes(p.shape[placement.dim], n)
    if _local(p).shape[item.dim] != item.sizes[me]:
        raise ValueError(f"Muon: a {tuple(p.shape)} parameter's local shard {tuple(_local(p).shape)} is not "
                         f"torch.chunk's split of dim {item.dim} over {n} ranks")
    return group, n, me


def _plan(params: list[Tensor]) -> tuple[list[_Item], list[_Bucket]]:
    """Whole-here items, and the buckets with each item's owner (largest first to the least loaded)."""
    local, buckets = [], {}
    for i, p in enumerate(params):
        if p.ndim not in (2, 3):
            raise ValueError(f"Muon takes matrices and expert stacks, got a {tuple(p.shape)} parameter")
        rows, cols = p.shape[-2], p.shape[-1]
        item = _Item(p, i, rows, cols, max(1.0, rows / cols) ** 0.5)
        where = _layout(item)
        if where is None:
            local.append(item)
            continue
        group, n, me = where
        key = (id(group), _local(p).dtype, _local(p).device)
        buckets.setdefault(key, _Bucket(group, n, me)).items.append(item)
    for bucket in buckets.values():
        load = [0] * bucket.size
        for item in sorted(bucket.items, key=lambda it: (-it.param.numel() * min(it.rows, it.cols), it.index)):
            item.owner = min(range(bucket.size), key=lambda k: (load[k], k))
            load[item.owner] += item.param.numel() * min(item.rows, item.cols)
    return local, list(buckets.values())


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on groups with ``muon=True`` (see the module docstring), AdamW on the others; one standard
    optimizer, so its state dict is the usual per-parameter one. `orthogonalized`: the matrices this
    rank orthogonalised in its last step (an expert stack counts its experts)."""

    def __init__(self, param_groups: list[dict], lr: float, betas: tuple[float, float], eps: float = 1e-8,
                 momentum: float = 0.95, ns_steps: int = 5) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0, momentum=momentum, ns_steps=ns_steps,
                        muon=False)
        super().__init__(param_groups, defaults)
        self.orthogonalized = 0
        self._layout: tuple[tuple[int, ...], list[_Item], list[_Bucket]] | None = None

    def _muon_layout(self) -> tuple[list[_Item], list[_Bucket]]:
        params = [p for g in self.param_groups if g["muon"] for p in g["params"]]
        ids = tuple(id(p) for p in params)
        if self._layout is None or self._layout[0] != ids:
            self._layout = (ids, *_plan(params))
        return self._layout[1], self._layout[2]

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch.optim signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.orthogonalized = 0
        updates: dict[int, tuple[Tensor, float, int]] = {}  # id(param) -> (momentum update, lr, ns_steps)
        for group in self.param_groups:
            if group["muon"]:
                updates.update(self._momentum(group))
            else:
                self._adamw(group)
        local, buckets = self._muon_layout()
        self._orthogonalize_whole([it for it in local if id(it.param) in updates], updates)
        for bucket in buckets:
            active = [it for it in bucket.items if id(it.param) in updates]
            if active:  # the same on every rank of the group: FSDP2 gives all or none of them a gradient
                self._orthogonalize_sharded(bucket, active, updates)
        return loss

    def _momentum(self, group: dict) -> dict[int, tuple[Tensor, float, int]]:
        """Weight decay and the Nesterov momentum update of the group's parameters with a gradient."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return {}
        lr, mu = group["lr"], group["momentum"]
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
        weights = [_local(p) for p in params]
        grads = [_local(p.grad) for p in params]
        bufs = [_local(self.state[p]["momentum_buffer"]) for p in params]
        if group["weight_decay"]:
            torch._foreach_mul_(weights, 1 - lr * group["weight_decay"])
        torch._foreach_mul_(bufs, mu)
        torch._foreach_add_(bufs, grads)
        new = torch._foreach_add(grads, bufs, alpha=mu)
        return {id(p): (u, lr, group["ns_steps"]) for p, u in zip(params, new, strict=True)}

    def _apply(self, item: _Item, ortho: Tensor, updates: dict) -> None:
        _local(item.param).add_(ortho.view(_local(item.param).shape), alpha=-updates[id(item.param)][1] * item.scale)

    def _batched(self, mats: list[Tensor], ns_steps: int) -> list[Tensor]:
        """Orthogonalise matrices / expert stacks of one [out, in] shape together; returns each one's result."""
        if len(mats) == 1:
            batch = mats[0]
        else:
            batch = torch.cat([m.reshape(-1, *m.shape[-2:]) for m in mats])
        self.orthogonalized += batch.numel() // (batch.shape[-2] * batch.shape[-1]) if batch.numel() else 0
        out = newton_schulz_orthogonalize(batch, ns_steps)
        if len(mats) == 1:
            return [out]
        sizes = [m.numel() // (m.shape[-2] * m.shape[-1]) for m in mats]
        return [o.view(m.shape) for o, m in zip(out.split(sizes), mats, strict=True)]

    def _by_shape(self, items: list[_Item], mats: list[Tensor], updates: dict) -> list[Tensor]:
        """NS of every (item, whole tensor): 2-D ones of a shape batched together, each 3-D stack one batch."""
        results: list[Tensor | None] = [None] * len(items)
        groups: dict[tuple, list[int]] = {}
        for i, (item, m) in enumerate(zip(items, mats, strict=True)):
            key = (tuple(m.shape), m.dtype, updates[id(item.param)][2]) if m.ndim == 2 else (i,)
            groups.setdefault(key, []).append(i)
        for members in groups.values():
            ns_steps = updates[id(items[members[0]].param)][2]
            for i, out in zip(members, self._batched([mats[i] for i in members], ns_steps), strict=True):
                results[i] = out
        return results  # type: ignore[return-value]

    def _orthogonalize_whole(self, items: list[_Item], updates: dict) -> None:
        outs = self._by_shape(items, [updates[id(it.param)][0] for it in items], updates)
        for item, out in zip(items, outs, strict=True):
            self._apply(item, out, updates)

    def _orthogonalize_sharded(self, bucket: _Bucket, active: list[_Item], updates: dict) -> None:
        """Shards to owners (one all-to-all), NS on the owners, owners' rows back (one all-to-all)."""
        n, me = bucket.size, bucket.rank
        sent = sorted(active, key=lambda it: (it.owner, it.index))  # by destination, then item
        mine = [it for it in sent if it.owner == me]
        in_splits = [sum(it.numel_at(me) for it in sent if it.owner == k) for k in range(n)]
        out_splits = [sum(it.numel_at(k) for it in mine) for k in range(n)]
        like = updates[id(sent[0].param)][0]
        send = torch.cat([updates[id(it.param)][0].reshape(-1) for it in sent])
        recv = send.new_empty(sum(out_splits))
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=bucket.group)
        by_source = list(recv.split(out_splits))
        fulls = []
        for item in mine:
            pieces = []
            for k in range(n):
                size = item.numel_at(k)
                pieces.append(by_source[k][:size].view(item.shape_at(k)))
                by_source[k] = by_source[k][size:]
            fulls.append(torch.cat(pieces, dim=item.dim))
        outs = self._by_shape(mine, fulls, updates)
        back = [o.narrow(it.dim, it.start_at(k), it.sizes[k]).reshape(-1)
                for k in range(n) for it, o in zip(mine, outs, strict=True)]
        send_back = torch.cat(back) if back else like.new_empty(0)
        got = like.new_empty(sum(in_splits))
        dist.all_to_all_single(got, send_back, in_splits, out_splits, group=bucket.group)
        offset = 0
        for item in sent:
            size = item.numel_at(me)
            self._apply(item, got[offset:offset + size], updates)
            offset += size

    def _adamw(self, group: dict) -> None:
        """AdamW over the group's local shards with per-parameter step tensors (no host sync)."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        weights = [_local(p) for p in params]
        grads = [_local(p.grad) for p in params]
        avgs = [_local(self.state[p]["exp_avg"]) for p in params]
        sqs = [_local(self.state[p]["exp_avg_sq"]) for p in params]
        steps = [self.state[p]["step"] for p in params]
        if wd:
            torch._foreach_mul_(weights, 1 - lr * wd)
        torch._foreach_add_(steps, 1.0)
        torch._foreach_lerp_(avgs, grads, 1 - beta1)
        torch._foreach_mul_(sqs, beta2)
        torch._foreach_addcmul_(sqs, grads, grads, value=1 - beta2)
        for w, avg, sq, step in zip(weights, avgs, sqs, steps, strict=True):
            denom = (sq / (1 - beta2**step)).sqrt_().add_(eps)
            w.addcdiv_(avg * (-lr / (1 - beta1**step)), denom)
