"""spartron.layers.moe: router, grouped experts, dispatch/combine and the MoE layer."""

from spartron.layers.moe.dispatch import (
    AllToAllDispatcher,
    DeepEPDispatcher,
    DispatchState,
    LocalDispatcher,
    build_dispatcher,
)
from spartron.layers.moe.experts import GroupedExperts
from spartron.layers.moe.layer import MoELayer
from spartron.layers.moe.router import Router, Routing, load_balancing_loss

__all__ = [
    "AllToAllDispatcher", "DeepEPDispatcher", "DispatchState", "GroupedExperts", "LocalDispatcher",
    "MoELayer", "Router", "Routing", "build_dispatcher", "load_balancing_loss",
]
