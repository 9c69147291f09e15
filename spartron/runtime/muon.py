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
for bfloat16 gradients, as Muon's own recipe runs it; train.muon_ns_dtype can fix it); the scale keeps
tall matrices' update RMS like square ones' (the rule of the first Spartron Muon, kept).

Each matrix is orthogonalised once per data-parallel replica, never on every rank:
- A tensor already whole on this rank (one rank; a replicated tensor; routed experts sharded over
  expert_fsdp on their expert dim, whole experts per rank, distinct per EP rank) is orthogonalised here,
  the experts of one tensor as one batched Newton-Schulz over [E_local, out, in].
- A tensor sharded on a matrix dim (FSDP2's dense weights; experts split on dim 1) is owned by one rank of
  its shard group, assigned largest-first to the least-loaded rank. Per bucket (shard group, dtype) one
  all-to-all brings every owned tensor's shards to its owner, which orthogonalises the whole tensors
  (same-shape matrices batched), and one all-to-all sends each rank the rows of its shards.
Bounded temporaries (`ns_batch_bytes`): a step's working set is sized by the cap, not by the model. The
momentum updates are formed per run of tensors, a sharded bucket is exchanged in rounds of whole tensors of
at most the cap (by their full size; every rank splits alike), and Newton-Schulz runs on batches of at most
the cap of input matrices (a tensor larger than the cap alone; experts of one stack in slices); its
temporaries are a few times its input. Each matrix's result is the same as in one batch: every matrix is
orthogonalised by itself (its own norm, batched matmuls), only the batching changes.
Shard sizes come from the shapes (torch.chunk's split, checked against each local shard): the step makes
no host sync and branches on no tensor value; AdamW's bias corrections use a per-parameter step tensor.

State is torch's usual per-parameter dict: `momentum_buffer` (a DTensor with the parameter's placement)
for Muon, `step` / `exp_avg` / `exp_avg_sq` for AdamW, so DCP saves and reshards it like AdamW's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_BATCH_BYTES = 512 * 2**20  # default cap of one Newton-Schulz batch's input / one exchange round


def ns_working_dtype(update: torch.dtype, override: torch.dtype | None) -> torch.dtype:
    """The dtype Newton-Schulz runs in: `override`, else bfloat16 for a bfloat16 update, else float32."""
    return override or (torch.bfloat16 if update == torch.bfloat16 else torch.float32)


def newton_schulz_orthogonalize(g: Tensor, steps: int = 5, dtype: torch.dtype | None = None) -> Tensor:
    """Approximate U V^T of each matrix g = U S V^T (g: [..., m, n]) by the quintic Newton-Schulz iteration
    x <- (a I + b A + c A A) x with A = x x^T (a tall matrix: x <- x (a I + b A + c A A) with A = x^T x, the same
    iteration on its transpose, so the result keeps g's layout). Each step is three batched GEMMs: A; the
    polynomial, b A + c A A in one GEMM's epilogue (baddbmm's beta / alpha), a added on its diagonal; its product
    with x. No elementwise pass over x, and no copy of x into a GEMM's output (an epilogue term costs one). In
    `dtype` (None: bfloat16 for a bfloat16 g, else float32); the result in g's dtype."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(ns_working_dtype(g.dtype, dtype))
    tall = x.shape[-2] > x.shape[-1]
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=torch.float32)
    x = torch.div(x, norm + 1e-7, out=torch.empty_like(x)).reshape(-1, *x.shape[-2:])  # no float32 copy of x
    for _ in range(steps):
        gram = torch.bmm(x.mT, x) if tall else torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        poly.diagonal(dim1=-2, dim2=-1).add_(a)
        x = torch.bmm(x, poly) if tall else torch.bmm(poly, x)
    return x.reshape(g.shape).to(g.dtype)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _Pending(NamedTuple):
    """A Muon parameter's step after weight decay and the momentum buffer's update: its Nesterov update
    grad + momentum * buf is formed when its run of tensors is orthogonalised."""

    grad: Tensor
    buf: Tensor
    momentum: float
    lr: float
    ns_steps: int

    @property
    def dtype(self) -> torch.dtype:
        return torch.result_type(self.grad, self.buf)

    def update(self) -> Tensor:
        return torch.add(self.grad, self.buf, alpha=self.momentum)


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


def split_by_bytes(sizes: list[int], cap: int) -> list[list[int]]:
    """Consecutive runs of indices whose sizes sum to at most `cap` (one larger than `cap` alone)."""
    runs: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if not runs or total + size > cap:
            runs.append([])
            total = 0
        runs[-1].append(i)
        total += size
    return runs


def _spans(counts: list[int], per: int) -> list[list[tuple[int, int, int]]]:
    """Batches of at most `per` matrices over stacks of `counts` matrices, in order: (stack, start, stop)."""
    batches: list[list[tuple[int, int, int]]] = []
    room = 0
    for k, n in enumerate(counts):
        a = 0
        while a < n:
            if room == 0:
                batches.append([])
                room = per
            b = min(n, a + room)
            batches[-1].append((k, a, b))
            room -= b - a
            a = b
    return batches


def _nbytes(item: _Item) -> int:
    """The whole tensor's bytes (the same on every rank): what sizes its exchange round and batch."""
    return item.param.numel() * _local(item.param).element_size()


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
    rank orthogonalised in its last step (an expert stack counts its experts); `exchanges`: the all-to-all
    rounds of sharded tensors it took part in (two all-to-alls each); `ns_batch_bytes`: the byte cap
    of a Newton-Schulz batch and of an exchange round (see the module docstring); `ns_dtype`: the dtype the
    iteration runs in (None: the update's, see newton_schulz_orthogonalize)."""

    def __init__(self, param_groups: list[dict], lr: float, betas: tuple[float, float], eps: float = 1e-8,
                 momentum: float = 0.95, ns_steps: int = 5, ns_batch_bytes: int = NS_BATCH_BYTES,
                 ns_dtype: torch.dtype | None = None) -> None:
        if ns_batch_bytes < 1:
            raise ValueError(f"Muon: ns_batch_bytes must be positive, got {ns_batch_bytes}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0, momentum=momentum, ns_steps=ns_steps,
                        muon=False)
        super().__init__(param_groups, defaults)
        self.ns_batch_bytes = ns_batch_bytes
        self.ns_dtype = ns_dtype
        self.orthogonalized = 0
        self.exchanges = 0
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
        self.orthogonalized = self.exchanges = 0
        updates: dict[int, _Pending] = {}
        for group in self.param_groups:
            if group["muon"]:
                updates.update(self._momentum(group))
            else:
                self._adamw(group)
        local, buckets = self._muon_layout()
        self._orthogonalize_whole([it for it in local if id(it.param) in updates], updates)
        for bucket in buckets:
            # the same on every rank of the group: FSDP2 gives all or none of them a gradient; full sizes
            active = [it for it in bucket.items if id(it.param) in updates]
            owned = self._groups([it for it in active if it.owner == bucket.rank], updates)
            lone = {id(g[0].param) for g in owned if len(g) == 1 and g[0].param.ndim == 2}
            for run in split_by_bytes([_nbytes(it) for it in active], self.ns_batch_bytes):
                self._orthogonalize_sharded(bucket, [active[i] for i in run], updates, lone)
        return loss

    def _momentum(self, group: dict) -> dict[int, _Pending]:
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
        return {id(p): _Pending(g, b, mu, lr, group["ns_steps"]) for p, g, b in zip(params, grads, bufs, strict=True)}

    def _apply(self, item: _Item, ortho: Tensor, updates: dict) -> None:
        _local(item.param).add_(ortho.view(_local(item.param).shape), alpha=-updates[id(item.param)].lr * item.scale)

    def _per_batch(self, item: _Item, updates: dict) -> int:
        """Matrices of the item's shape in one Newton-Schulz batch: the byte cap of input in its working dtype."""
        working = ns_working_dtype(updates[id(item.param)].dtype, self.ns_dtype).itemsize
        return max(1, self.ns_batch_bytes // max(1, item.rows * item.cols * working))

    def _groups(self, items: list[_Item], updates: dict) -> list[list[_Item]]:
        """Tensors orthogonalised together: 2-D ones of one shape, dtype and ns_steps; each 3-D stack alone."""
        groups: dict[tuple, list[_Item]] = {}
        for i, it in enumerate(items):
            pending = updates[id(it.param)]
            key = (tuple(it.param.shape), pending.dtype, pending.ns_steps) if it.param.ndim == 2 else (i,)
            groups.setdefault(key, []).append(it)
        return list(groups.values())

    def _ns(self, parts: list[Tensor], ns_steps: int) -> list[Tensor]:
        """One Newton-Schulz batch over `parts` ([k, rows, cols] each); each part's result."""
        out = newton_schulz_orthogonalize(parts[0] if len(parts) == 1 else torch.cat(parts), ns_steps, self.ns_dtype)
        self.orthogonalized += len(out)
        return list(out.split([len(p) for p in parts])) if len(parts) > 1 else [out]

    def _lone(self, item: _Item, full: Tensor, updates: dict) -> Tensor:
        """A matrix alone in its group: orthogonalised as a 2-D tensor (as it always was)."""
        self.orthogonalized += 1
        return newton_schulz_orthogonalize(full, updates[id(item.param)].ns_steps, self.ns_dtype)

    def _orthogonalize_whole(self, items: list[_Item], updates: dict) -> None:
        """Tensors whole here, in capped batches. A tensor's update is formed when its first batch needs it and
        applied whole after its last (whole-tensor elementwise ops: CPU bfloat16 kernels round slices apart)."""
        for members in self._groups(items, updates):
            if len(members) == 1 and members[0].param.ndim == 2:
                self._apply(members[0], self._lone(members[0], updates[id(members[0].param)].update(), updates),
                            updates)
                continue
            rows, cols = members[0].rows, members[0].cols
            counts = [it.param.numel() // max(1, rows * cols) for it in members]
            ns_steps = updates[id(members[0].param)].ns_steps
            formed: dict[int, Tensor] = {}
            results: dict[int, Tensor] = {}
            for batch in _spans(counts, self._per_batch(members[0], updates)):
                for k, _, _ in batch:
                    if k not in formed:
                        formed[k] = updates[id(members[k].param)].update().reshape(-1, rows, cols)
                for (k, a, b), out in zip(batch, self._ns([formed[k][a:b] for k, a, b in batch], ns_steps),
                                          strict=True):
                    if a > 0 or b < counts[k]:  # a stack split over batches: gathered, applied after its last
                        results.setdefault(k, torch.empty_like(formed[k]))[a:b].copy_(out)
                        out = results[k]
                    if b == counts[k]:
                        self._apply(members[k], out, updates)
                        del formed[k]
                        results.pop(k, None)

    def _orthogonalize_fulls(self, mine: list[_Item], fulls: list[Tensor], updates: dict,
                             lone: set[int]) -> list[Tensor]:
        """NS of the gathered tensors this rank owns in a round, in capped batches; `lone`: the 2-D ones alone
        in their group over the whole bucket (2-D as ever, whichever round they fall in)."""
        outs: list[Tensor | None] = [None] * len(mine)
        index = {id(it.param): i for i, it in enumerate(mine)}
        for members in self._groups(mine, updates):
            if id(members[0].param) in lone:
                i = index[id(members[0].param)]
                outs[i] = self._lone(members[0], fulls[i], updates)
                continue
            rows, cols = members[0].rows, members[0].cols
            stacks = [fulls[index[id(it.param)]].view(-1, rows, cols) for it in members]
            results = [torch.empty_like(st) for st in stacks]
            ns_steps = updates[id(members[0].param)].ns_steps
            for batch in _spans([len(st) for st in stacks], self._per_batch(members[0], updates)):
                for (k, a, b), out in zip(batch, self._ns([stacks[k][a:b] for k, a, b in batch], ns_steps),
                                          strict=True):
                    results[k][a:b].copy_(out)
            for it, res in zip(members, results, strict=True):
                outs[index[id(it.param)]] = res.view(it.param.shape)
        return outs  # type: ignore[return-value]

    def _orthogonalize_sharded(self, bucket: _Bucket, active: list[_Item], updates: dict, lone: set[int]) -> None:
        """One round: shards to owners (one all-to-all), NS on the owners, owners' rows back (one all-to-all)."""
        n, me = bucket.size, bucket.rank
        sent = sorted(active, key=lambda it: (it.owner, it.index))  # by destination, then item
        mine = [it for it in sent if it.owner == me]
        in_splits = [sum(it.numel_at(me) for it in sent if it.owner == k) for k in range(n)]
        out_splits = [sum(it.numel_at(k) for it in mine) for k in range(n)]
        send = torch.cat([updates[id(it.param)].update().reshape(-1) for it in sent])
        recv = send.new_empty(sum(out_splits))
        self.exchanges += 1
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
        outs = self._orthogonalize_fulls(mine, fulls, updates, lone)
        back = [o.narrow(it.dim, it.start_at(k), it.sizes[k]).reshape(-1)
                for k in range(n) for it, o in zip(mine, outs, strict=True)]
        send_back = torch.cat(back) if back else send.new_empty(0)
        got = send.new_empty(sum(in_splits))
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
