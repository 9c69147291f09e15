"""Runtime op boundaries: torch.library custom ops. Importing this package registers all of them.

Namespaces (the strings users put in `[ac] targets`):
- `spartron_collectives`: all_to_all, all_gather, reduce_scatter, splits_to_host (collectives.py)
- `spartron`: record_routing_stats (telemetry.py), moe_topk (routing.py), sparse_mla (sparse_mla.py; its CUDA
  kernels are Triton, sparse_mla_triton.py, imported when a CUDA input first reaches the op)
- `spartron_deepep`: dispatch, combine, dispatch_backward, cached_dispatch (deepep.py; DeepEP is imported
  only when a layer selects it)
- `spartron_symm`: exchange (copy_engine.py; the MoE token exchange over the copy engines)
"""

import spartron.layers.attention  # noqa: F401
from spartron.runtime.ops import routing, telemetry  # noqa: F401
