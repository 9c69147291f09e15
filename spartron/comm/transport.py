"""EPTransport: the communication buffers of one EP group, owned in one place.

Why an object: the copy-engine exchange (`ExchangeBuffer`: symmetric memory, two receive slots)
and DeepEP (`DeepEPBuffer`: NVLink IPC memory and a communication stream) pin memory that every
rank of the group creates collectively. A model has one EP group, so it builds ONE transport and
hands it to every MoE layer's dispatcher when the layers are built: all layers share its buffers,
nothing is re-pointed afterwards. Buffers are made on first use (constructing a model costs
nothing; the memory itself is allocated at the first exchange or dispatch) and released together
by `destroy()`, a collective every rank of the group calls while all are alive (the trainer does
it through the model's `close()` when a run ends well). A layer built without one gets its own.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch.distributed as dist

from spartron.comm.copy_engine import ExchangeBuffer, SymmetricMemory
from spartron.comm.deepep_buffer import FEATURE, DeepEPBuffer
from spartron.comm.mirror import MirrorError, is_mirrored


class EPTransport:
    """The buffers of one EP group's token exchanges, for every dispatcher that moves tokens over it.

    `copy_engine_sync`: model.moe.copy_engine_sync of the exchange buffer. `memory`: the exchange's
    receive memory (None: CUDA symmetric memory, grown as needed; tests pass process-shared CPU memory).
    `deepep_library`: what provides DeepEP's `Buffer` / `Config` (None: `deep_ep`; tests pass a double).
    """

    def __init__(self, group: dist.ProcessGroup | None, copy_engine_sync: str = "barrier",
                 memory: SymmetricMemory | None = None, deepep_library: ModuleType | Any | None = None):
        self.group = group
        self.copy_engine_sync = copy_engine_sync
        self.deepep_library = deepep_library
        self._memory = memory
        self._exchange: ExchangeBuffer | None = None
        self._deepep: DeepEPBuffer | None = None

    def exchange_buffer(self) -> ExchangeBuffer:
        """The copy-engine exchange buffer of the group (the same object for every caller)."""
        if self._exchange is None:
            _refuse_mirrored(self.group, "the copy-engine exchange (model.moe.all_to_all_transport)")
            self._exchange = ExchangeBuffer(self.group, self._memory, sync=self.copy_engine_sync)
        return self._exchange

    def deepep_buffer(self, top_k: int, n_experts: int, num_sms: int, hidden: int | None) -> DeepEPBuffer:
        """The DeepEP buffer of the group (the same object for every caller, who must agree on its shape)."""
        if self._deepep is None:
            _refuse_mirrored(self.group, FEATURE)
            self._deepep = DeepEPBuffer(self.group, top_k, n_experts, num_sms, hidden, library=self.deepep_library)
            return self._deepep
        mine, theirs = (top_k, n_experts, num_sms), (self._deepep.top_k, self._deepep.n_experts, self._deepep.num_sms)
        if mine != theirs or None not in (hidden, self._deepep.hidden) and hidden != self._deepep.hidden:
            raise ValueError(f"{FEATURE}: MoE layers on one EP group disagree on (top_k, n_routed_experts, "
                             f"deepep_num_sms), dim: {mine}, {hidden} vs {theirs}, {self._deepep.hidden}")
        return self._deepep

    def destroy(self) -> int:
        """Release every live buffer (a collective over the group: every rank calls it); returns how many
        were live. Idempotent; a later exchange or dispatch creates them again."""
        live = 0
        if self._deepep is not None and self._deepep.created:
            self._deepep.destroy()
            live += 1
        if self._exchange is not None and self._exchange.allocated:
            self._exchange.destroy()
            live += 1
        return live


def _refuse_mirrored(group: dist.ProcessGroup | None, what: str) -> None:
    """Peer-memory buffers have no mirrored meaning (spartron.comm.mirror): refused before any is made."""
    if group is not None and is_mirrored(group):
        raise MirrorError(f"{what} cannot run on a mirrored process group (spartron rehearse): its buffers map "
                          "peer GPUs' memory, and a mirrored rank has no peer; use model.moe.dispatcher = "
                          "'all_to_all' over NCCL")
