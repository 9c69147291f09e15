"""Layout-invariant parameter initialisation: the one init rule of Spartron's layers and models.

A parameter's initial value depends only on the seed and its global identity: its fully-qualified
name in the 1-rank model and, for routed-expert weights, the global expert index. Each identity
draws from its own `torch.Generator`, seeded by a stable hash (SHA-256, never Python's salted
`hash()`) of (seed, name[, expert]). Nothing depends on the global RNG, on the order modules are
built in or on the rank that builds them, so every EP / CP / FSDP layout builds exactly the 1-rank
model (a rank holding experts [a, b) generates exactly those, each expert's slice on its own).
`materialize_` does it for a model built and parallelised on the meta device: each rank fills only
its shards, from the same global values.

The rule: matrices and embeddings (ndim >= 2) Normal(0, std), drawn in float32 whatever the
parameter dtype (a bf16 model is the fp32 model cast); norm weights ones, norm biases zeros. Any
other parameter is an error naming it, so a new kind of parameter cannot silently go uninitialised.
Values depend on the device type the generator runs on (CPU and CUDA generators differ), as the
ranks of one run share it. Buffers (the router's expert bias) are their modules' business.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor, nn

from spartron.layers.norms import RMSNorm

_NORMS = (RMSNorm, nn.LayerNorm, nn.RMSNorm)


def identity_seed(seed: int, name: str, expert: int | None = None) -> int:
    """The generator seed of one identity: 63 bits of SHA-256 over (seed, name[, expert])."""
    key = f"{seed}\x1f{name}" + ("" if expert is None else f"\x1f{expert}")
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def _normal_(out: Tensor, std: float, seed: int) -> None:
    gen = torch.Generator(device=out.device).manual_seed(seed)
    if out.dtype == torch.float32:
        out.normal_(0.0, std, generator=gen)
    else:
        out.copy_(torch.empty(out.shape, dtype=torch.float32, device=out.device).normal_(0.0, std, generator=gen))


def rule_of(module: nn.Module, local_name: str, param: Tensor, full_name: str) -> str:
    """'normal', 'ones' or 'zeros' for parameter `local_name` of `module` (`full_name` for errors)."""
    if param.dim() >= 2:
        return "normal"
    if isinstance(module, _NORMS) and local_name in ("weight", "bias"):
        return "ones" if local_name == "weight" else "zeros"
    raise ValueError(f"no initialisation rule for parameter {full_name!r} ({param.dim()}-d, in "
                     f"{type(module).__name__}): add it to spartron.layers.init.rule_of")


@torch.no_grad()
def init_tensor_(tensor: Tensor, name: str, seed: int, std: float, rule: str = "normal",
                 first_expert: int | None = None) -> Tensor:
    """Fill `tensor` in place with the initial value of parameter `name`.

    `first_expert` not None: dim 0 indexes routed experts and slice i is global expert
    first_expert + i, drawn from its own generator (a shard of experts [a, b) passes a).
    """
    if tensor.is_meta:
        raise ValueError(f"cannot initialise {name!r} on the meta device: materialise it first (to_empty)")
    if rule == "ones":
        return tensor.fill_(1.0)
    if rule == "zeros":
        return tensor.zero_()
    if rule != "normal":
        raise ValueError(f"unknown init rule {rule!r} for {name!r}: normal, ones or zeros")
    if first_expert is None:
        _normal_(tensor, std, identity_seed(seed, name))
    else:
        for i in range(tensor.shape[0]):
            _normal_(tensor[i], std, identity_seed(seed, name, first_expert + i))
    return tensor


def _named_parameters(module: nn.Module, prefix: str):
    """(global name, owning module, local name, parameter, first expert or None) of every parameter."""
    for mod_name, mod in module.named_modules():
        first = mod.first_expert if getattr(mod, "is_expert_module", False) else None
        for local, p in mod.named_parameters(recurse=False):
            yield prefix + (f"{mod_name}.{local}" if mod_name else local), mod, local, p, first


@torch.no_grad()
def init_parameters_(module: nn.Module, seed: int, std: float, prefix: str = "") -> None:
    """Initialise every parameter of `module` by the rule; `prefix` + its name is the global name.

    Routed-expert modules (`is_expert_module`, e.g. GroupedExperts) say which global expert their
    first slice is through `first_expert`. A model calls this once with prefix ""; a layer used
    alone in a larger model passes the name it has there (the Megatron adapters do). Parameters on
    the meta device are left alone (a model built there is initialised by `materialize_`).
    """
    for name, mod, local, p, first in _named_parameters(module, prefix):
        if p.is_meta:
            continue
        init_tensor_(p, name, seed, std, rule_of(mod, local, p, name), first_expert=first)


@torch.no_grad()
def materialize_(module: nn.Module, device: torch.device | str, seed: int, std: float) -> nn.Module:
    """Give a model built on the meta device (and parallelised there) storage on `device` and its
    initial values, shard by shard; returns it.

    Each rank allocates only its local shards (`to_empty`). A sharded parameter (a DTensor, e.g. under
    FSDP2) gets the slice of its global value that its placements give this rank: the global value
    (the routed experts this EP rank holds, for expert weights) is drawn whole by the init rule, one
    parameter at a time, and sliced without communication, so the temporary is one parameter and the
    values equal a 1-rank build's bitwise. Buffers are their modules' business: every module holding
    one must have `reset_buffers()` (an error names the buffer otherwise).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    for mod_name, mod in module.named_modules():
        own = [n for n, _ in mod.named_buffers(recurse=False)]
        if own and not callable(getattr(mod, "reset_buffers", None)):
            raise ValueError(f"cannot materialise buffer {(mod_name + '.' if mod_name else '') + own[0]!r} "
                             f"({type(mod).__name__} has no reset_buffers()): give it one")
    module.to_empty(device=device)
    for name, mod, local, p, first in _named_parameters(module, ""):
        rule = rule_of(mod, local, p, name)
        if not isinstance(p, DTensor):
            init_tensor_(p, name, seed, std, rule, first_expert=first)
            continue
        shard = p.to_local()
        whole = init_tensor_(torch.empty(p.shape, dtype=p.dtype, device=shard.device), name, seed, std, rule,
                             first_expert=first)
        shard.copy_(distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local())
        del whole
    for mod in module.modules():
        if any(True for _ in mod.named_buffers(recurse=False)):
            mod.reset_buffers()
    return module
