"""Spartron's operator libraries, loaded by one named call.

A config that names operators (`ac.targets = ["spartron::sparse_mla", "spartron_collectives"]`) is checked
against torch's dispatcher, which knows an operator only once the module defining it has been imported.
Whoever validates such a config calls `load_ops()` first: the dependency is a call, not an import kept
for its side effect.
"""

from __future__ import annotations


def load_ops() -> frozenset[str]:
    """Register every operator library of Spartron's layers and comm; returns their namespaces."""
    from spartron.comm import collectives, copy_engine, deepep
    from spartron.layers import swiglu  # noqa: F401 (defines spartron::swiglu_backward_)
    from spartron.layers.attention import (  # noqa: F401 (each defines spartron:: ops)
        absorb,
        indexer_kl,
        indexer_kl_dense,
        indexer_topk,
        sparse_mla,
        sparse_mla_absorbed,
    )
    from spartron.layers.fp8 import ops as fp8_ops  # noqa: F401 (defines spartron_fp8:: ops)
    from spartron.layers.moe import combine, telemetry, topk  # noqa: F401 (each defines spartron:: ops)

    return frozenset({"spartron", "spartron_fp8", collectives.NAMESPACE, copy_engine.NAMESPACE, deepep.NAMESPACE})
