"""The routed experts' quantised weights, kept from their first use until the weights change
(model.fp8.weight_cache): a step's micro-batches, AC replays and backward GEMMs reuse one
quantisation per expert weight (128x128 blocks and the transposed blocks dgrad reads) instead of
re-quantising at every GEMM call.

When the cache refreshes, and why two rules:
- explicitly: `invalidate_weight_caches(model)` after every optimizer step and after a state load
  (the Trainer calls it; `invalidate_on_step` hooks it to an optimizer for other loops), and a
  load_state_dict post-hook on each cached module. This is what makes it correct: the weights
  change only there, and neither rule below can see every write. FSDP2 all-gathers into the same
  unsharded parameter under `_unsafe_preserve_version_counter` (same tensor, same version, new
  values; whether its storage moves is the allocator's business), and Spartron's TritonAdamW writes
  parameters from a kernel (no version bump).
- by key: an entry remembers each weight's (data_ptr, _version, shape, strides, dtype, device) and
  the recipe (backend, pow2); any difference re-quantises. This catches in-place writes through
  torch ops outside the optimizer (a `copy_`, a test's `add_`) in the non-FSDP case.
A refresh is the same quantisation the uncached path runs, so a cached step equals an uncached one
bitwise (tests/layers/test_fp8_cache.py); a stale entry would not, and the tests check that the
explicit rule is needed.

Memory: one FP8 copy and one transposed FP8 copy (1 byte an element each) plus fp32 scales per
cached expert weight, alive from the first forward to the next invalidation (costs.py / the memory
plan count it: spartron.layers.step_memory).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def _key(weights: tuple[Tensor, ...], backend: str, pow2: bool) -> tuple:
    return (backend, pow2, *((w.data_ptr(), w._version, tuple(w.shape), w.stride(), w.dtype, str(w.device))
                             for w in weights))


class WeightCache:
    """One module's quantised weights: `get(weights, backend, pow2, quantise)` returns
    `quantise()`'s tensors, computed once per key until `clear()`."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._values: list[Tensor] | None = None
        self.refreshes = 0  # how many times it quantised (tests and benchmarks read it)

    def get(self, weights: tuple[Tensor, ...], backend: str, pow2: bool, quantise) -> list[Tensor]:
        key = _key(weights, backend, pow2)
        if self._values is None or key != self._key:
            self._values = None  # the old copies go before the new ones are made
            with torch.no_grad():
                self._values = list(quantise())
            self._key = key
            self.refreshes += 1
        return self._values

    def clear(self) -> None:
        self._key = self._values = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._values or ())


def invalidate_weight_caches(model: nn.Module) -> int:
    """Drop every FP8 weight cache in `model` and re-quantise the shards of its FP8-gathered weights
    (model.fp8.param_gather: spartron.layers.fp8.param_gather.refresh, a collective every rank calls), after
    the optimizer wrote the weights, a load, or the build; returns how many modules had a cache."""
    from spartron.layers.fp8.param_gather import refresh

    caches = [m.fp8_cache for m in model.modules() if getattr(m, "fp8_cache", None) is not None]
    for cache in caches:
        cache.clear()
    refresh(model)
    return len(caches)


def invalidate_on_step(optimizer: torch.optim.Optimizer, model: nn.Module):
    """Hook `invalidate_weight_caches(model)` to every `optimizer.step()` (a training loop other than
    the Trainer's); returns the hook's handle."""
    return optimizer.register_step_post_hook(lambda *_: invalidate_weight_caches(model))


def clear_after_load(module: nn.Module, incompatible_keys) -> None:  # noqa: ANN001
    """load_state_dict post-hook of a cached module: loaded weights are new weights."""
    module.fp8_cache.clear()
