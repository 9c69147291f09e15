"""Optimizers, the learning-rate schedule and global-norm gradient clipping.

The schedule is a pure function of the step (linear warmup, then cosine down to
``lr * min_lr_ratio``): resuming only needs the step number, nothing pickled.

Clipping computes the norm over the WHOLE model although each rank holds only shards: every
gradient contributes the sum of squares of its local shard, and that partial sum is all-reduced over
exactly the process groups the tensor is sharded over (the mesh dims where a DTensor placement is
``Shard``, plus any extra groups the caller names for plain tensors that hold a rank-local slice,
e.g. expert weights split over EP). Replicated dims are not reduced, so replicas are never counted
twice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from spartron.comm import labelled
from spartron.layers.config import master_optimizer_refusal
from spartron.layers.costs import muon_takes
from spartron.runtime.adamw_triton import TritonAdamW
from spartron.runtime.config import TrainConfig
from spartron.runtime.master_weights import MasterAdamW, grad_of, has_master
from spartron.runtime.muon import MuonWithAdamW, newton_schulz_orthogonalize

__all__ = ["MuonWithAdamW", "build_optimizer", "clip_and_step_", "clip_grads_", "global_grad_norm", "lr_at",
           "newton_schulz_orthogonalize", "set_lr"]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of 1-based optimizer step `step`: warmup to cfg.lr, cosine to lr*min_lr_ratio."""
    if step < 1:
        raise ValueError(f"optimizer steps are 1-based, got {step}")
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    decay_steps = cfg.steps - cfg.warmup_steps
    if decay_steps <= 0:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def _decay_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Matrices decay; vectors (norm weights, biases, expert bias) do not."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return decay, no_decay


def vocab_size_of(model: nn.Module) -> int:
    """The vocabulary size Muon leaves to AdamW: the model's nn.Embedding rows, else the largest first dim of its
    2-D weights, frozen ones included (a stage training only some matrices must not make one of them the
    'vocabulary': the largest trainable one was taken for it, and went to AdamW)."""
    embeddings = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    if embeddings:
        return max(embeddings)
    return max((p.shape[0] for p in model.parameters() if p.ndim == 2), default=0)


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (TritonAdamW for CUDA parameters unless train.adamw_kernel = 'torch', torch's fused kernel then;
    torch's AdamW on the CPU), or distributed Muon (spartron.runtime.muon) for hidden matrices and routed
    experts with AdamW for the rest."""
    decay, no_decay = _decay_split(model)
    if not decay and not no_decay:
        raise ValueError("the model has no trainable parameters")
    on_cuda = all(p.is_cuda for p in decay + no_decay)
    adam_kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, fused=True if on_cuda else None)
    if any(has_master(p) for p in decay + no_decay):  # model.master_weights = "optimizer"
        return _master_adamw(decay, no_decay, cfg, on_cuda)
    if cfg.optimizer == "adamw":
        groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        triton = cfg.adamw_kernel == "triton" or (cfg.adamw_kernel == "auto" and on_cuda)
        if triton and not on_cuda:
            devices = sorted({str(p.device) for p in decay + no_decay})
            raise ValueError(f"train.adamw_kernel = 'triton' needs CUDA parameters and the triton package; the "
                             f"parameters are on {', '.join(devices)} (use 'torch')")
        if triton or cfg.adamw_moments_dtype is not None:  # torch's AdamW keeps its moments in the params' dtype
            adam_kwargs.pop("fused")
            return TritonAdamW([g for g in groups if g["params"]], **adam_kwargs, reference=not triton,
                               moments_dtype=moments_dtype(cfg))
        return torch.optim.AdamW([g for g in groups if g["params"]], **adam_kwargs)
    # Muon (spartron.runtime.muon) takes what muon_takes says: hidden matrices and routed-expert stacks;
    # embeddings and the LM head stay on AdamW (as in the Muon paper), recognised by their vocabulary-sized dim.
    vocab = vocab_size_of(model)
    matrices = [p for p in decay if muon_takes(tuple(p.shape), vocab)]
    ids = {id(p) for p in matrices}
    rest_decay = [p for p in decay if id(p) not in ids]
    adam_groups = [{"params": rest_decay, "weight_decay": cfg.weight_decay, "muon": False},
                   {"params": no_decay, "weight_decay": 0.0, "muon": False}]
    groups = [{"params": matrices, "weight_decay": cfg.weight_decay, "muon": True}] + adam_groups
    ns_dtype = None if cfg.muon_ns_dtype == "auto" else getattr(torch, cfg.muon_ns_dtype)
    return MuonWithAdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                         ns_dtype=ns_dtype)


def _master_adamw(decay: list[nn.Parameter], no_decay: list[nn.Parameter], cfg: TrainConfig,
                  on_cuda: bool) -> MasterAdamW:
    """AdamW over the fp32 masters of spartron.runtime.master_weights: the Triton kernel on CUDA (train.adamw_kernel
    'auto' or 'triton'), the torch reference otherwise."""
    refusal = master_optimizer_refusal("optimizer", cfg.optimizer)
    if refusal:
        raise ValueError(refusal)
    if not all(has_master(p) for p in decay + no_decay):
        raise ValueError("model.master_weights = 'optimizer': some trainable parameters have no fp32 master")
    if cfg.adamw_kernel == "triton" and not on_cuda:
        raise ValueError("train.adamw_kernel = 'triton' needs CUDA parameters and the triton package (use 'torch')")
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return MasterAdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                       reference=cfg.adamw_kernel == "torch" or not on_cuda, moments_dtype=moments_dtype(cfg))


def moments_dtype(cfg: TrainConfig) -> torch.dtype | None:
    """train.adamw_moments_dtype as a torch dtype (None: the updated tensors' own)."""
    return getattr(torch, cfg.adamw_moments_dtype) if cfg.adamw_moments_dtype else None


def _reduce_groups(t: Tensor, extra: Sequence[dist.ProcessGroup]) -> tuple:
    from torch.distributed.tensor import DTensor

    groups = list(extra)
    if isinstance(t, DTensor):
        for dim, placement in enumerate(t.placements):
            if placement.is_partial():
                raise ValueError("gradient norm: a gradient with a Partial placement is not reduced "
                                 "yet (call clipping after backward has finished its reduce-scatter)")
            if placement.is_shard():
                groups.append(t.device_mesh.get_group(dim))
    return tuple(groups)


def global_grad_norm(params: Iterable[nn.Parameter],
                     extra_shard_groups: Mapping[int, Sequence[dist.ProcessGroup]] | None = None) -> Tensor:
    """L2 norm of all gradients across every shard, equal on every rank (fp32 scalar).

    extra_shard_groups maps id(param) to groups over which that tensor holds a rank-local slice not
    described by a DTensor placement (e.g. plain local expert weights split over EP).
    """
    from torch.distributed.tensor import DTensor

    extra_shard_groups = extra_shard_groups or {}
    buckets: dict[tuple, Tensor] = {}
    device = None
    for p in params:
        grad = grad_of(p)  # p.main_grad under model.master_weights = "optimizer"
        if grad is None:
            continue
        key = _reduce_groups(grad, extra_shard_groups.get(id(p), ()))
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        device = local.device
        sq = torch.linalg.vector_norm(local.detach(), dtype=torch.float32).square()  # no fp32 copy of the grad
        buckets[key] = buckets[key] + sq if key in buckets else sq
    if device is None:
        return torch.zeros(())
    total = torch.zeros((), device=device)
    # Buckets in the order of their first parameter: the same on every rank (same model, same order).
    # Not sorted by member ranks: those differ between ranks (EP group [0, 1] on rank 0, [2, 3] on
    # rank 2), which ordered the collectives differently per rank and hung EP2 x CP2 on 4 ranks.
    for key in buckets:
        partial = buckets[key].clone()
        # Successive sums over each group = the sum over their product (the groups are orthogonal).
        for group in key:
            with labelled("grad_norm", group):
                dist.all_reduce(partial, group=group)
        total += partial
    return total.sqrt()


def clip_coefficient(max_norm: float, total_norm: Tensor) -> Tensor:
    """min(1, max_norm / (total_norm + 1e-6)): what every gradient is multiplied by (a tensor: no sync)."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


def clip_and_step_(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter], max_norm: float,
                   total_norm: Tensor, norm: float) -> None:
    """Clip the gradients to max_norm (0: never) and take the optimizer step; `norm` is float(total_norm).

    Below max_norm the coefficient is exactly 1 and no pass over the gradients is made. A TritonAdamW takes the
    coefficient into its update (one read of every gradient); other optimizers get clip_grads_ first.
    """
    if not (norm + 1e-6 > max_norm > 0):
        optimizer.step()
    elif isinstance(optimizer, TritonAdamW):
        optimizer.step(grad_scale=clip_coefficient(max_norm, total_norm))
    else:
        clip_grads_(params, max_norm, total_norm)
        optimizer.step()


@torch.no_grad()
def clip_grads_(params: Sequence[nn.Parameter], max_norm: float, total_norm: Tensor) -> None:
    """Scale every local gradient shard by min(1, max_norm / total_norm) (no-op when max_norm is 0)."""
    from torch.distributed.tensor import DTensor

    if max_norm <= 0:
        return
    coef = clip_coefficient(max_norm, total_norm)
    # One foreach multiply per (device, dtype): a per-tensor `mul_` by a 0-dim device tensor runs the
    # broadcasting (non-vectorised) kernel, ~3x the HBM time (17.7 ms per dsv3-12l step on the H200).
    by_kind: dict[tuple, list[Tensor]] = {}
    for p in params:
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            by_kind.setdefault((local.device, local.dtype), []).append(local)
    for (device, dtype), grads in by_kind.items():
        torch._foreach_mul_(grads, coef.to(device, dtype))
