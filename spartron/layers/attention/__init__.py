"""spartron.layers.attention: multi-head latent attention with DeepSeek sparse attention.

`MLA` (mla.py), the lightning indexer and the source/consumer schedule of DSA (dsa.py), RoPE / YaRN
(rope.py), context-parallel sharding and gathers (context_parallel.py), and the `spartron::sparse_mla`
op (sparse_mla.py: PyTorch reference, Triton kernels on CUDA in sparse_mla_triton*.py). Importing it
registers the op.
"""

from spartron.layers.attention.context_parallel import cp_positions, cp_shard, gather_sequence
from spartron.layers.attention.dsa import LightningIndexer, dsa_schedule, ids_for_layer
from spartron.layers.attention.mla import MLA
from spartron.layers.attention.rope import apply_rope, rope_cos_sin
from spartron.layers.attention.sparse_mla import sparse_mla

__all__ = ["MLA", "LightningIndexer", "apply_rope", "cp_positions", "cp_shard", "dsa_schedule", "gather_sequence",
           "ids_for_layer", "rope_cos_sin", "sparse_mla"]
