"""spartron.layers.moe: router (+ the `spartron::moe_topk` op, topk.py), routing telemetry (the
`spartron::record_routing_stats` op), grouped experts, dispatch/combine and the MoE layer."""

from spartron.layers.moe.dispatch import (
    AllToAllDispatcher,
    CopyEngineDispatcher,
    DeepEPDispatcher,
    DispatchState,
    GatheredRows,
    LocalDispatcher,
    build_dispatcher,
    check_dispatcher,
)
from spartron.layers.moe.experts import GroupedExperts
from spartron.layers.moe.layer import MoELayer
from spartron.layers.moe.router import Router, Routing, load_balancing_loss
from spartron.layers.moe.telemetry import record_routing_stats
from spartron.layers.moe.topk import moe_topk

__all__ = [
    "AllToAllDispatcher", "CopyEngineDispatcher", "DeepEPDispatcher", "DispatchState", "GatheredRows", "GroupedExperts",
    "LocalDispatcher", "MoELayer", "Router", "Routing", "build_dispatcher", "check_dispatcher", "load_balancing_loss",
    "moe_topk", "record_routing_stats",
]
