"""LiveStorageBytes: the peak of live tensor storages while a step runs, the tracker the memory-plan tests
compare the planner's prediction with (tests/layers/test_memory_plan.py, test_master_weights_memory.py)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveStorageBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages: those given when entered plus every storage an op creates while
    the mode is on, each counted until its last reference dies."""

    def __init__(self, initial) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0
        for t in initial:
            self._add(t)

    def _add(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        storage = getattr(t, "_local_tensor", t).untyped_storage()
        key = storage._cdata
        if key in self.live or storage.nbytes() == 0:
            return
        self.live[key] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._add(t)
        return out
