"""spartron.comm: how bytes move between ranks. Importing it registers the op namespaces.

- `spartron_collectives` (collectives.py): all_to_all (uneven splits), all_gather, reduce_scatter,
  splits_to_host, as torch.library ops with fake impls and autograd;
- `spartron_symm` (copy_engine.py): the MoE token exchange over the GPUs' copy engines (symmetric memory);
- `spartron_deepep` (deepep.py): DeepEP's intranode dispatch / combine (DeepEP is imported only when used), its
  FP8 dispatch included;
- fp8_rows.py: rows sent as E4M3 with 1x128 scales (model.fp8.dispatch) back in the compute dtype, one rule for
  every dispatcher;
- `EPTransport` (transport.py): the buffers of one EP group (exchange, DeepEP), made, shared and destroyed
  in one place, handed to every MoE dispatcher of a model when it is built;
- `labelled` (mirror.py): names what the collectives called inside are for, recorded by a rehearsal's
  mirrored group (spartron rehearse's report files them by it) and ignored elsewhere.
"""

from spartron.comm.collectives import all_gather, all_to_all, exchange_split_sizes, reduce_scatter, splits_to_host
from spartron.comm.copy_engine import ExchangeBuffer, HostSharedMemory, exchange, exchange_plan
from spartron.comm.deepep import DeepEPHandle, deepep_cached_dispatch, deepep_combine, deepep_dispatch
from spartron.comm.deepep_buffer import DeepEPBuffer, check_deepep_shape, load_deep_ep
from spartron.comm.mirror import labelled
from spartron.comm.transport import EPTransport

__all__ = [
    "DeepEPBuffer", "DeepEPHandle", "EPTransport", "ExchangeBuffer", "HostSharedMemory", "all_gather", "all_to_all",
    "check_deepep_shape", "deepep_cached_dispatch", "deepep_combine", "deepep_dispatch", "exchange",
    "exchange_plan", "exchange_split_sizes", "labelled", "load_deep_ep", "reduce_scatter", "splits_to_host",
]
