"""spartron.layers: the model pieces, each returning a TypedDict (outputs.py).

attention/ (MLA, DSA, RoPE, context parallelism, the sparse-MLA op), moe/ (router and the moe_topk op,
routing telemetry op, grouped experts, dispatchers, the MoE layer), overlap.py (the intra-layer
micro-batch overlap plan), decoder.py / mtp.py / model.py (the reference SparseMoEModel),
parallelize.py (AC, compile, FSDP2 over a ParallelizableModel), costs.py (THE parameter / FLOP /
memory model), init.py (layout-invariant initialisation), config.py (the `[model]` section).
Importing this package registers the layers' ops (and, through the MoE dispatch, spartron.comm's).
"""

from spartron.layers.attention import MLA, LightningIndexer, dsa_schedule, sparse_mla
from spartron.layers.config import DSAConfig, MLAConfig, ModelConfig, MoEConfig, MTPConfig, YarnConfig
from spartron.layers.costs import ParamCount, count_parameters, state_bytes_per_rank, training_flops_per_token
from spartron.layers.decoder import DecoderLayer, run_decoder_stack
from spartron.layers.init import init_parameters_, materialize_
from spartron.layers.model import SparseMoEModel, build_model
from spartron.layers.moe import GroupedExperts, MoELayer, Router, build_dispatcher
from spartron.layers.mtp import MTP
from spartron.layers.outputs import AttentionOutput, DecoderLayerOutput, ModelOutput, MoEOutput, MTPOutput
from spartron.layers.parallelize import Block, ParallelizableModel, parallelize

__all__ = [
    "MLA", "MTP", "AttentionOutput", "Block", "DSAConfig", "DecoderLayer", "DecoderLayerOutput", "GroupedExperts",
    "LightningIndexer", "MLAConfig", "MTPConfig", "MTPOutput", "ModelConfig", "ModelOutput", "MoEConfig", "MoELayer",
    "MoEOutput", "ParallelizableModel", "ParamCount", "Router", "SparseMoEModel", "YarnConfig", "build_dispatcher",
    "build_model", "count_parameters", "dsa_schedule", "init_parameters_", "materialize_", "parallelize",
    "run_decoder_stack", "sparse_mla", "state_bytes_per_rank", "training_flops_per_token",
]
