"""Spartron layers inside megatron-core models: the public entry point.

    side = SideChannel()
    tcfg = megatron_config_from_spartron(model_cfg)            # or your own MLATransformerConfig
    block = TransformerBlock(tcfg, spartron_block_spec(tcfg, side, base_config=model_cfg,
                                                       pg_collection=pgc), pg_collection=pgc)
    side.reset(); out = block(hidden[s, b, h], attention_mask=None); loss = lm_loss + side.loss()

Config mapping and the list of Megatron settings the adapters cannot honour live in `config.py`,
the SideChannel in `side_channel.py`, the ModuleSpec adapters in `spec.py`, the ProcessGroupCollection export in
`groups.py`, activation checkpointing and offload windows (apply_spartron_checkpointing) in
`checkpointing.py`; what Megatron's machinery reads: DDP parameter attributes (`expert_params.py`),
dist_checkpointing's sharded state (`sharded.py`), the router for finalize_model_grads / Float16Module
and the expert-bias update (`router_hooks.py`), the aux loss through Megatron's scaler and tracker
(`aux_loss.py`; side.loss() no longer holds it). megatron-core is imported lazily (inside the spec
builders and the reverse config mapping) because it is optional.
"""

from spartron.interop.megatron.checkpointing import (
    MegatronCheckpointing,
    apply_spartron_checkpointing,
    megatron_checkpoint_region_of,
)
from spartron.interop.megatron.config import (
    MAPPED,
    MEGATRON_OWNED,
    REQUIRED,
    MegatronConfigError,
    megatron_config_from_spartron,
    spartron_config_from_megatron,
)
from spartron.interop.megatron.router_hooks import MegatronRouter, update_expert_bias
from spartron.interop.megatron.spec import (
    SideChannel,
    SpartronDenseMLP,
    SpartronMLAAttention,
    SpartronMoEMLP,
    moe_adapters,
    resolve_group,
    spartron_block_spec,
    spartron_layer_key,
    spartron_layer_spec,
)

__all__ = [
    "MAPPED", "MEGATRON_OWNED", "REQUIRED", "MegatronCheckpointing", "MegatronConfigError", "SideChannel",
    "SpartronDenseMLP", "SpartronMLAAttention", "SpartronMoEMLP", "megatron_config_from_spartron", "moe_adapters",
    "resolve_group", "spartron_block_spec", "spartron_config_from_megatron", "spartron_layer_key",
    "spartron_layer_spec", "apply_spartron_checkpointing", "megatron_checkpoint_region_of", "MegatronRouter",
    "update_expert_bias",
]
