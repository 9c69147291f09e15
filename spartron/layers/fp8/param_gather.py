"""model.fp8.param_gather (Megatron's --fp8-param-gather): FSDP2 all-gathers the FP8-run weights as E4M3,
quantised once per optimizer step on each shard.

How, through FSDP2's all-gather extension (`fsdp_pre_all_gather` / `fsdp_post_all_gather` on a parameter's
sharded local tensor, as torchao's float8 weights use it):
- `install(model)` (apply_fsdp, after fully_shard) gives each FP8-run weight of a shard group over more than one
  rank a `ShardState` and swaps its local shard for an `FP8Shard`: the SAME tensor (storage, version counter,
  data_ptr: an alias like nn.Parameter's, whose ops return plain tensors) plus the two methods. The optimizers
  (TritonAdamW's raw pointers included), clipping, saving and loading (it pickles as a plain tensor), init and
  the HF export see the tensor they saw before; only FSDP2 calls the methods.
- `refresh(model)` (weight_cache.invalidate_weight_caches: after each optimizer step, after a load, and once
  before the first forward) casts each shard to the compute dtype (the value FSDP2 would gather), takes each
  shard's local amax (its rows' 1x128 tile amax, or its own blocks'), all-gathers those of all the weights of
  one shard group in ONE all-gather, reduces them into the full weight's block amax and quantises the shard
  with the full weight's scales (shard_quant: bitwise quantize_blocks' of the full weight; exact in a
  rehearsal's mirrored group too). A collective: every rank calls it.
- the all-gather sends the E4M3 shard (1 byte an element, as uint8); `fsdp_post_all_gather` writes it into its
  GEMM's JointBlocks (spartron.layers.fp8.gathered: q, and q^T by transposing the gathered values) and gives
  FSDP2 a GatheredFP8Weight as the unsharded parameter. Its gradient is the bf16 one, reduce-scattered as before.

FSDP2's private state is read here and nowhere else (FSDPParam: the shard's padded data, the shard group,
the local tensor's DTensor slot, `_extensions_data`, which FSDP2 creates only for a local tensor that has
the methods when fully_shard runs): no public API swaps a parameter's all-gather after fully_shard. The
names are those of torch 2.11 and 2.13; a torch that lays them out otherwise fails here, naming the option.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from spartron.comm import labelled
from spartron.layers.fp8.gathered import GatheredFP8Weight, JointBlocks
from spartron.layers.fp8.quant import FP8, tile_scales
from spartron.layers.fp8.shard_quant import block_amax, local_amax, quantize_shard


class ShardState:
    """One FP8-gathered weight: its FSDPParam (FSDP2's), its place in its GEMM's JointBlocks, and this step's
    E4M3 shard (`q`, padded as FSDP2 pads) and full block scales."""

    def __init__(self, fsdp_param, joint: JointBlocks, index: int, pow2: bool) -> None:  # noqa: ANN001
        self.fsdp_param, self.joint, self.index, self.pow2 = fsdp_param, joint, index, pow2
        self.shape = torch.Size(fsdp_param._orig_size)
        self.dim = fsdp_param.fsdp_placement.dim
        self.group = fsdp_param.mesh_info.shard_process_group
        self.rank = fsdp_param.mesh_info.shard_mesh_rank
        self.dtype = fsdp_param.mp_policy.param_dtype or fsdp_param.sharded_param.dtype
        self.q: Tensor | None = None
        self.quantisations = 0  # how many times this weight was quantised (tests count them)

    def shard(self) -> Tensor:
        """The padded local shard in the compute dtype: FSDP2's all-gather input without this option."""
        p = self.fsdp_param
        return p._sharded_param_data.view(p.padded_sharded_param_size).to(self.dtype)


class FP8Shard(torch.Tensor):
    """A parameter's local shard (an alias of FSDP2's) whose all-gather is its E4M3 values (ShardState)."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    fp8_state: ShardState

    @staticmethod
    def wrap(local: Tensor, state: ShardState) -> FP8Shard:
        t = torch.Tensor._make_subclass(FP8Shard, local, local.requires_grad)
        t.fp8_state = state
        return t

    def __reduce_ex__(self, protocol):  # noqa: ANN001, ANN204 - saved as the plain tensor it is
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo):  # noqa: ANN001, ANN204
        return self.as_subclass(torch.Tensor).__deepcopy__(memo)

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):  # noqa: ANN001, ANN201
        state = self.fp8_state
        if state.q is None:
            raise RuntimeError("model.fp8.param_gather: a weight is all-gathered before its FP8 shard was quantised: "
                               "call spartron.layers.fp8.invalidate_weight_caches(model) after building, loading "
                               "and each optimizer step (the Trainer does)")
        return (state.q.view(torch.uint8),), state

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):  # noqa: ANN001, ANN201
        state: ShardState = metadata
        (gathered,) = outputs
        q = gathered.view(FP8).view(-1)[:state.shape.numel()].view(state.shape)
        inner = state.joint.write(state.index, q)
        if len(state.joint.shapes) > 1:  # copied into the pair's joint buffer: the all-gather's own bytes go now
            gathered.untyped_storage().resize_(0)
        if out is not None:
            return None
        return GatheredFP8Weight(state.shape, param_dtype, q.device, state.joint), tuple(inner)


def _groups(module: nn.Module) -> list[tuple[tuple[nn.Module, str], ...]]:
    """The weights of each FP8 GEMM of an FP8 module (its `fp8_gemm_weights`: parameter paths concatenated along
    N), as (owning module, parameter name)."""
    def owner(path: str) -> tuple[nn.Module, str]:
        parent, _, name = path.rpartition(".")
        return (module.get_submodule(parent) if parent else module, name)

    return [tuple(owner(p) for p in gemm) for gemm in getattr(module, "fp8_gemm_weights", ())]


def _fsdp_params(model: nn.Module) -> dict[tuple[int, str], object]:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    found = {}
    for unit in model.modules():
        if not isinstance(unit, FSDPModule):
            continue
        state = fully_shard.state(unit)
        try:
            groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
            params = [p for g in groups if g is not None for p in g.fsdp_params]
            for p in params:
                found[(id(p._module_info.module), p._module_info.param_name)] = p
        except AttributeError as err:
            raise RuntimeError(f"model.fp8.param_gather hooks FSDP2's parameter all-gather, but torch "
                               f"{torch.__version__}'s FSDP2 state has no {err.name!r}: set "
                               "model.fp8.param_gather = false") from err
    return found


def install(model: nn.Module) -> int:
    """Give every FP8-run weight whose FSDP2 shard group spans more than one rank an FP8 all-gather (module
    docstring); returns how many. Weights of a 1-rank shard group are left as they are (nothing is gathered)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ExtensionsData  # FSDP2-private: see the docstring

    params, count = _fsdp_params(model), 0
    for module in model.modules():
        states = []
        for group in _groups(module):
            found = [params.get((id(m), name)) for m, name in group]
            if any(p is None or p.mesh_info.shard_mesh_size == 1 for p in found):
                continue
            joint = JointBlocks([p._orig_size for p in found])
            for index, p in enumerate(found):
                if hasattr(p, "_unsharded_param"):
                    raise RuntimeError("model.fp8.param_gather: install it before the first forward")
                state = ShardState(p, joint, index, module.fp8_pow2)
                p._extensions_data = ExtensionsData()
                _wrap(state)
                states.append(state)
        if states:
            module.fp8_gather = states
            count += len(states)
    return count


def _wrap(state: ShardState) -> None:
    """The parameter's current local shard as an FP8Shard (again where a load or `to_empty` replaced it)."""
    p = state.fsdp_param
    local = p.sharded_param._local_tensor
    if type(local) is not FP8Shard or local.fp8_state is not state:
        p.sharded_param._local_tensor = FP8Shard.wrap(local, state)


def states_of(model: nn.Module) -> list[ShardState]:
    return [s for m in model.modules() for s in getattr(m, "fp8_gather", ())]


@torch.no_grad()
def refresh(model: nn.Module) -> int:
    """Quantise every FP8-gathered weight's shard afresh (module docstring): one all-gather of the shards' local
    amax per shard group (shard_quant). Returns how many weights. Every rank of the model calls it."""
    states = states_of(model)
    by_group: dict[int, list[tuple[ShardState, Tensor, Tensor]]] = {}
    for state in states:
        _wrap(state)
        shard = state.shard()
        by_group.setdefault(id(state.group), []).append((state, shard, local_amax(shard, state.shape, state.dim)))
    for members in by_group.values():
        group = members[0][0].group
        world = dist.get_world_size(group)
        flat = torch.cat([local.reshape(-1) for _, _, local in members])
        gathered = flat.new_empty(world * flat.numel())
        with labelled("fp8_amax", group):
            dist.all_gather_into_tensor(gathered, flat, group=group)
        parts = gathered.view(world, -1).split([local.numel() for _, _, local in members], dim=1)
        for (state, shard, local), part in zip(members, parts, strict=True):
            every = torch.cat(list(part.reshape(world, *local.shape).unbind(0)), dim=state.dim)  # rank order
            scales = tile_scales(block_amax(every, state.shape, state.dim), state.pow2)
            state.q = quantize_shard(shard, scales, state.dim, state.rank)
            state.joint.set_scales(state.index, scales)
            state.quantisations += 1
    return len(states)
