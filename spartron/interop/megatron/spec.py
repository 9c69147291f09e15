"""Spartron MLA/DSA attention and MoE/dense FFN behind megatron-core ModuleSpecs.

A Megatron-core TransformerLayer calls `self_attention(hidden[s,b,h], attention_mask=..., ...)` and
`mlp(hidden[s,b,h], padding_mask=...)` and expects `(output, bias)` back. The adapters here turn that
into Spartron's batch-first calls and back, so the layer's residual/dropout/norm plumbing stays
Megatron's while the math inside is Spartron's (and returns Spartron's TypedDicts).

Side outputs Megatron has no slot for (DSA ids, aux and indexer losses, tokens per expert) travel
through the `SideChannel` (side_channel.py) the user creates and puts into the spec.

Initialisation: each adapter initialises its Spartron module by the rule of spartron.layers.init from
the spec param `init_seed` and the names the same layer has in SparseMoEModel (`layers.{i}.attn.*`,
`layers.{i}.ffn.*`), so a Megatron block starts from the reference model's layers under any layout.
The MLP slot learns its layer index from `set_layer_number`, so it initialises (and turns FP8) there.

Groups: attention takes Megatron's `pg_collection` (TransformerLayer passes it); the MLP slot gets
no groups from TransformerLayer, so `pg_collection` or a Spartron `ParallelGroups` is a spec param,
and without either the groups of megatron.core.parallel_state (when initialised). When both a
ParallelGroups and a ProcessGroupCollection reach an adapter their ranks must agree, and the Megatron
config's expert_model_parallel_size / context_parallel_size must be the groups' sizes
(groups.resolve_group): a spec never silently builds every expert on every rank.

Megatron's machinery: every parameter carries Megatron's DDP attributes (expert_params.py), the MoE
adapter has a `sharded_state_dict` with experts sharded over the EP group (sharded.py), its router
works with finalize_model_grads and Float16Module (router_hooks.py), and its balance loss goes
through Megatron's aux-loss scaler and tracker (aux_loss.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from spartron.comm.transport import EPTransport
from spartron.configbase import ConfigError
from spartron.interop.megatron.aux_loss import attach_and_track, balance_loss, check_definition
from spartron.interop.megatron.config import spartron_config_from_megatron
from spartron.interop.megatron.expert_params import set_megatron_param_attributes
from spartron.interop.megatron.groups import resolve_group, source_group
from spartron.interop.megatron.router_hooks import MegatronRouter
from spartron.interop.megatron.sharded import moe_sharded_state_dict
from spartron.interop.megatron.side_channel import SideChannel
from spartron.layers.attention.context_parallel import cp_size_of, local_positions
from spartron.layers.attention.dsa import ids_for_layer
from spartron.layers.attention.mla import MLA
from spartron.layers.config import ModelConfig
from spartron.layers.ffn import FeedForward
from spartron.layers.fp8 import apply_fp8
from spartron.layers.init import init_parameters_
from spartron.layers.moe import MoELayer

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from spartron.parallel.groups import ParallelGroups


def _ranks(pg: dist.ProcessGroup | None) -> list[int]:
    if pg is not None:
        return dist.get_process_group_ranks(pg)
    return [dist.get_rank()] if dist.is_initialized() else [0]


def _model_config(config, base: ModelConfig | None) -> ModelConfig:
    return spartron_config_from_megatron(config, base=base)


def _reject(**unsupported: Any) -> None:
    given = [k for k, v in unsupported.items() if v is not None]
    if given:
        raise ValueError(f"Spartron adapters do not support {given} (causal self-attention over whole "
                         "sequences: pass None)")


def _apply_fp8(module: nn.Module, cfg: ModelConfig, kinds: set[str], layer_idx: int) -> None:
    """model.fp8 (Megatron's fp8 = "e4m3", fp8_recipe = "blockwise") on one slot's Spartron module, when the slot
    holds a kind model.fp8.modules names ("dense": its linears; "experts": the routed experts) and its layer is not
    one kept in bf16 (first_last_layers_bf16). The experts' weight cache stays off: Megatron's training loop never
    tells the layers that its optimizer changed the weights."""
    fp8 = cfg.fp8
    if fp8 is None or not kinds & set(fp8.modules) or not fp8.runs_fp8(layer_idx, cfg.n_layers):
        return
    if fp8.param_gather:
        raise ConfigError("model.fp8.param_gather = true in the Megatron adapters: it hooks FSDP2's all-gather, and "
                          "Megatron's DDP gathers no parameters; set model.fp8.param_gather = false")
    if fp8.weight_cache == "on":
        raise ConfigError("model.fp8.weight_cache = 'on' in the Megatron adapters: Megatron's optimizer step does "
                          "not invalidate it, so the experts would keep the FP8 copy of old weights; use 'auto' "
                          "(off in the adapters) or 'off'")
    apply_fp8([module], fp8.model_copy(update={"weight_cache": "off"}))


class SpartronMLAAttention(nn.Module):
    """`self_attention` slot: Spartron MLA (dense, DSA source or DSA consumer by the layer's role)."""

    def __init__(self, config, layer_number: int, side_channel: SideChannel,
                 base_config: ModelConfig | None = None, groups: ParallelGroups | None = None,
                 pg_collection: ProcessGroupCollection | None = None, cp_comm_type: str | None = None,
                 submodules: Any = None, init_seed: int = 0):
        super().__init__()
        if submodules is not None:
            raise ValueError("SpartronMLAAttention takes no submodules (its projections are Spartron's)")
        self.config = config  # Megatron's, for Megatron code that reads module.config
        self.model_cfg = _model_config(config, base_config)
        self.layer_idx = layer_number - 1
        self.side_channel = side_channel
        self.cp_group = resolve_group("cp", pg_collection, groups, config)
        self.mla = MLA(self.model_cfg, self.layer_idx, cp_group=self.cp_group)
        init_parameters_(self.mla, init_seed, self.model_cfg.init_std, f"layers.{self.layer_idx}.attn.")
        _apply_fp8(self.mla, self.model_cfg, {"dense"}, self.layer_idx)
        if self.mla.indexer is not None and self.mla.indexer_mode == "frozen":
            # not trained: no grad buffer in Megatron's DDP (whose overlapped reduction would wait for a
            # gradient that never comes) and no update (its AdamW would decay them with a zero gradient)
            self.mla.indexer.requires_grad_(False)
        set_megatron_param_attributes(self, expert_parallel=False)

    @property
    def dsa_role(self):
        return self.mla.dsa_role

    def positions(self, s_local: int, device: torch.device) -> Tensor:
        """Global positions of this rank's tokens (Megatron's CP layout, chunks r and 2cp-1-r, is ours)."""
        cp = cp_size_of(self.cp_group)
        rank = 0 if self.cp_group is None else dist.get_rank(self.cp_group)
        return local_positions(s_local * cp, cp, rank, device=device)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, key_value_states=None,
                inference_context=None, rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
                rotary_pos_cos_sin=None, attention_bias=None, packed_seq_params=None,
                sequence_len_offset=None, *, inference_params=None) -> tuple[Tensor, None]:
        _reject(attention_mask=attention_mask, key_value_states=key_value_states,
                inference_context=inference_context, inference_params=inference_params,
                rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                rotary_pos_cos_sin=rotary_pos_cos_sin, attention_bias=attention_bias,
                packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset)
        x = hidden_states.transpose(0, 1)  # [b, s, h]
        if self.mla.dsa_role == "consumer" and self.side_channel.dsa_topk_ids is None:
            raise RuntimeError(f"layer {self.layer_idx} is a DSA consumer but the SideChannel holds no ids: "
                               "its source layer did not run in this forward")
        ids = ids_for_layer(self.mla.dsa_role, self.side_channel.dsa_topk_ids)
        if self.mla.dsa_role is not None:
            self._ready_absorbed_weight()
        out = self.mla(x, self.positions(x.shape[1], x.device), dsa_topk_ids=ids)
        self.side_channel.record_attention(self.layer_idx, out)
        return out["hidden_states"].transpose(0, 1), None

    def _ready_absorbed_weight(self) -> None:
        """A DSA layer reads wkv_b's weight as views (the absorbed form) and never calls wkv_b, while Megatron's
        overlapped parameter all-gather (distributed optimizer with overlap_param_gather) waits for a weight's
        bucket in the forward pre-hook of the module owning it: an empty call runs wkv_b's hooks before the
        weight is read (without it the read could race the all-gather: the other ranks' part of the last step)."""
        wkv_b = self.mla.wkv_b
        with torch.no_grad():
            wkv_b(wkv_b.weight.new_empty(0, wkv_b.in_features))


class _MLPSlot(nn.Module):
    """Common part of the `mlp` slot adapters: Megatron passes no layer_number, it calls set_layer_number."""

    def __init__(self, config, side_channel: SideChannel, base_config: ModelConfig | None, init_seed: int):
        super().__init__()
        self.config = config
        self.model_cfg = _model_config(config, base_config)
        self.side_channel = side_channel
        self.init_seed = init_seed
        self.layer_idx: int | None = None
        self.fp8_kinds: set[str] = set()  # what model.fp8.modules may convert in this slot (set by the subclass)

    def set_layer_number(self, layer_number: int) -> None:
        """Megatron's TransformerLayer calls this in its constructor: the index names the weights and says whether
        the layer runs FP8 (model.fp8's bf16 layers)."""
        self.layer_idx = layer_number - 1
        init_parameters_(self.ffn_module(), self.init_seed, self.model_cfg.init_std, f"layers.{self.layer_idx}.ffn.")
        _apply_fp8(self.ffn_module(), self.model_cfg, self.fp8_kinds, self.layer_idx)

    def ffn_module(self) -> nn.Module:
        raise NotImplementedError

    def _bsh(self, hidden_states: Tensor, padding_mask) -> Tensor:
        if self.layer_idx is None:  # neither initialised nor (model.fp8) converted yet
            raise RuntimeError(f"set_layer_number was not called: build {type(self).__name__} in a TransformerLayer")
        _reject(padding_mask=padding_mask)
        return hidden_states.transpose(0, 1)


class SpartronMoEMLP(_MLPSlot):
    """`mlp` slot: Spartron MoELayer (with a MegatronRouter); its MoEOutput goes to the SideChannel."""

    def __init__(self, config, side_channel: SideChannel, base_config: ModelConfig | None = None,
                 groups: ParallelGroups | None = None, pg_collection: ProcessGroupCollection | None = None,
                 submodules: Any = None, init_seed: int = 0, transport: EPTransport | None = None,
                 aux_loss_definition: str = "spartron"):
        """`transport`: the EP group's buffers, shared by the block's MoE slots (spartron_block_spec
        passes one to all; None: this slot's own). `aux_loss_definition`: "spartron" or "megatron"
        (aux_loss.py)."""
        super().__init__(config, side_channel, base_config, init_seed)
        if submodules is not None:
            raise ValueError("SpartronMoEMLP takes no submodules")
        check_definition(aux_loss_definition)
        self.aux_loss_definition = aux_loss_definition
        ep = source_group("ep", pg_collection, groups, config)
        self.ep_group = ep if ep is not None and dist.get_world_size(ep) > 1 else None
        self.expt_dp_group = source_group("expt_dp", pg_collection, groups)
        self.tracker_group = source_group("cp", pg_collection, groups, config)  # Megatron's tp_cp at tp = 1
        if transport is None:
            transport = EPTransport(self.ep_group, self.model_cfg.moe.copy_engine_sync)
        elif _ranks(transport.group) != _ranks(self.ep_group):
            raise ValueError(f"the transport's EP group has ranks {_ranks(transport.group)} but this MoE slot's "
                             f"has {_ranks(self.ep_group)}")
        self.moe = MoELayer(self.model_cfg, transport)
        self.moe.router = MegatronRouter.like(self.moe.router)
        self.fp8_kinds = {"experts", "dense"} if self.model_cfg.moe.n_shared_experts else {"experts"}
        set_megatron_param_attributes(self, expert_parallel=self.ep_group is not None)

    def ffn_module(self) -> nn.Module:
        return self.moe

    def forward(self, hidden_states: Tensor, padding_mask=None) -> tuple[Tensor, None]:
        x = self._bsh(hidden_states, padding_mask)
        out = self.moe(x)
        hidden = out["hidden_states"]
        aux = balance_loss(out, self.model_cfg.moe, x.shape[0], self.aux_loss_definition)
        if aux is not None:
            hidden = attach_and_track(hidden, aux, self.model_cfg.moe, self.layer_idx + 1, self.config.num_layers,
                                      self.tracker_group, self.training, self.config.calculate_per_token_loss)
        self.side_channel.record_moe(self.layer_idx, {**out, "hidden_states": hidden, "aux_loss": None})
        return hidden.transpose(0, 1), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict[str, Any]:
        """dist_checkpointing's view: experts sharded over the EP group, the rest replicated (sharded.py)."""
        return moe_sharded_state_dict(self, prefix, sharded_offsets, metadata, self.ep_group, self.expt_dp_group)


class SpartronDenseMLP(_MLPSlot):
    """`mlp` slot of dense layers: Spartron's SwiGLU FeedForward of width ffn_hidden_size."""

    def __init__(self, config, side_channel: SideChannel, base_config: ModelConfig | None = None,
                 submodules: Any = None, init_seed: int = 0, **_groups_unused_by_dense_ffn: Any):
        super().__init__(config, side_channel, base_config, init_seed)
        if submodules is not None:
            raise ValueError("SpartronDenseMLP takes no submodules")
        unknown = set(_groups_unused_by_dense_ffn) - {"groups", "pg_collection"}
        if unknown:
            raise TypeError(f"SpartronDenseMLP got unexpected arguments {sorted(unknown)}")
        self.ffn = FeedForward(self.model_cfg.dim, self.model_cfg.dense_inter_dim,
                               init_std=self.model_cfg.init_std)
        self.fp8_kinds = {"dense"}
        set_megatron_param_attributes(self, expert_parallel=False)

    def ffn_module(self) -> nn.Module:
        return self.ffn

    def forward(self, hidden_states: Tensor, padding_mask=None) -> tuple[Tensor, None]:
        return self.ffn(self._bsh(hidden_states, padding_mask)).transpose(0, 1), None


# Megatron TransformerLayer prefix -> Spartron DecoderLayer prefix (same tensors, same shapes).
_LAYER_PREFIXES = {"input_layernorm.": "attn_norm.", "self_attention.mla.": "attn.",
                   "pre_mlp_layernorm.": "ffn_norm.", "mlp.moe.": "ffn.", "mlp.ffn.": "ffn."}


def spartron_layer_key(megatron_key: str) -> str:
    """Name in Spartron's DecoderLayer of a TransformerLayer parameter/buffer built from these specs."""
    for ours, theirs in _LAYER_PREFIXES.items():
        if megatron_key.startswith(ours):
            return theirs + megatron_key[len(ours):]
    raise KeyError(f"{megatron_key!r} is not a parameter of a Spartron-spec TransformerLayer")


def moe_adapters(module: nn.Module) -> list[SpartronMoEMLP]:
    """The MoE adapters of a Megatron model (the expert bias: router_hooks.update_expert_bias)."""
    return [m for m in module.modules() if isinstance(m, SpartronMoEMLP)]


def spartron_layer_spec(side_channel: SideChannel, kind: str = "moe", base_config: ModelConfig | None = None,
                        groups: ParallelGroups | None = None,
                        pg_collection: ProcessGroupCollection | None = None, init_seed: int = 0,
                        transport: EPTransport | None = None, aux_loss_definition: str = "spartron") -> ModuleSpec:
    """ModuleSpec of a Megatron TransformerLayer with Spartron MLA and a Spartron MoE (`kind="moe"`)
    or dense SwiGLU (`kind="dense"`) FFN, and Megatron's torch RMSNorms.

    Whether the attention is dense MLA, a DSA source or a DSA consumer follows the Spartron DSA
    schedule of the layer's index (Megatron config's DSA fields + `base_config.dsa.layers/topk_freq`).
    `pg_collection`/`groups` give the MoE its EP group (TransformerLayer passes the MLP none).
    `init_seed`: the seed of the layout-invariant init (SparseMoEModel's layer i with that seed).
    `transport`: the EP group's communication buffers for the MoE slot (None: its own).
    `aux_loss_definition`: which top-k the balance loss counts, "spartron" or "megatron" (aux_loss.py).
    """
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    if kind not in ("moe", "dense"):
        raise ValueError(f"kind must be 'moe' or 'dense', got {kind!r}")
    common = {"side_channel": side_channel, "base_config": base_config, "init_seed": init_seed}
    moe_params = {**common, "groups": groups, "pg_collection": pg_collection, "transport": transport,
                  "aux_loss_definition": aux_loss_definition}
    mlp = (ModuleSpec(module=SpartronMoEMLP, params=moe_params) if kind == "moe"
           else ModuleSpec(module=SpartronDenseMLP, params=common))
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=WrappedTorchNorm,
        self_attention=ModuleSpec(module=SpartronMLAAttention, params={**common, "groups": groups}),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=WrappedTorchNorm,
        mlp=mlp,
        mlp_bda=get_bias_dropout_add,
    ))


def spartron_block_spec(config, side_channel: SideChannel, base_config: ModelConfig | None = None,
                        groups: ParallelGroups | None = None, pg_collection: ProcessGroupCollection | None = None,
                        init_seed: int = 0, aux_loss_definition: str = "spartron") -> TransformerBlockSubmodules:
    """TransformerBlock spec: model.first_k_dense dense layers then MoE layers, final torch RMSNorm.

    All MoE layers of the block share ONE transport of the EP group (one DeepEP / exchange buffer).
    Without `groups` / `pg_collection` the groups are megatron.core.parallel_state's (initialise it
    first); a config asking for EP or CP > 1 with no groups anywhere is an error."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    cfg = spartron_config_from_megatron(config, base=base_config)
    check_definition(aux_loss_definition)
    transport = EPTransport(resolve_group("ep", pg_collection, groups, config), cfg.moe.copy_engine_sync)
    specs = [spartron_layer_spec(side_channel, "dense" if i < cfg.first_k_dense else "moe", base_config,
                                 groups, pg_collection, init_seed, transport, aux_loss_definition)
             for i in range(cfg.n_layers)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=WrappedTorchNorm)
