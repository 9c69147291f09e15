"""The link table of a cluster: what a collective costs on it, for `spartron rehearse`'s communication model.

A rehearsal measures compute and memory on one device and MODELS communication: for each collective a
step would run (kind, group, bytes in the nccl-tests sense, from spartron.comm.mirror's ledger), the time
is `calls x latency + bytes x factor / busbw`, with nccl-tests' bus-bandwidth factors ((n-1)/n for
all-gather, reduce-scatter and all-to-all, 2(n-1)/n for all-reduce, 1 for broadcast) and the link classes
the group crosses (`launch.gpus_per_node` consecutive ranks per node; one NIC per GPU):
- every member in this rank's node: NVLink alone;
- a ring collective (all-gather, reduce-scatter, all-reduce, broadcast) spanning nodes with k members in
  this node: its NVLink hops carry the whole bus volume, and the (n-k)/(n-1) of it that enters the node
  arrives through the k members' NICs together, so time = max(NVLink time, network time at k x the
  per-GPU bandwidth) (k = 1: one NIC carries it all);
- an all-to-all spanning nodes: (k-1)/n of the input goes over NVLink and (n-k)/n over this GPU's own NIC
  at the same time; the slower of the two sets its time.

Defaults: an HGX H100 or H200 node (NVLink 4, 450 GB/s per direction per GPU; one 400 Gb/s NIC per GPU),
in GB/s (1e9 bytes/s). Sources and the cross-check against this project's own measurements:
docs/LINK_TABLE.md. Measure your own cluster (nccl-tests, benchmarks/collectives.py) and set `[cluster]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import Field, model_validator

from spartron.configbase import ConfigSection

GB = 1e9


class LinkConfig(ConfigSection):
    """One link class for one kind of collective: bus bandwidth (GB/s) and latency per call (us)."""

    busbw_gbps: float = Field(gt=0)
    latency_us: float = Field(ge=0)


DEFAULTS: dict[str, dict[str, float]] = {  # sources: docs/LINK_TABLE.md
    "nvlink": {"busbw_gbps": 360.0, "latency_us": 10.0},  # nccl-tests ring busbw on 8 x H100 (NCCL's maintainers)
    "network": {"busbw_gbps": 40.0, "latency_us": 30.0},  # per GPU: 46-48 GB/s per 400G NIC at 2 nodes, less at 256
    "nvlink_all_to_all": {"busbw_gbps": 280.0, "latency_us": 10.0},  # NCCL all-to-all, 2 x H200, 256 MiB per rank
    "network_all_to_all": {"busbw_gbps": 40.0, "latency_us": 30.0},  # DeepEP internode EP 16-64: 43-58 GB/s (H800)
}


class ClusterConfig(ConfigSection):
    """`[cluster]`: the link table `spartron rehearse` models communication with (module docstring). A link
    given in part (`cluster.network.busbw_gbps = 25.0`) keeps the default of the key it does not set."""

    nvlink: LinkConfig = Field(default_factory=lambda: LinkConfig(**DEFAULTS["nvlink"]))
    network: LinkConfig = Field(default_factory=lambda: LinkConfig(**DEFAULTS["network"]))
    nvlink_all_to_all: LinkConfig = Field(default_factory=lambda: LinkConfig(**DEFAULTS["nvlink_all_to_all"]))
    network_all_to_all: LinkConfig = Field(default_factory=lambda: LinkConfig(**DEFAULTS["network_all_to_all"]))

    @model_validator(mode="before")
    @classmethod
    def _fill(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {key: {**DEFAULTS[key], **value} if key in DEFAULTS and isinstance(value, dict) else value
                for key, value in data.items()}


BUS_FACTOR = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_to_all": lambda n: (n - 1) / n, "all_reduce": lambda n: 2 * (n - 1) / n,
              "broadcast": lambda n: 1.0}


@dataclass(frozen=True)
class LinkTime:
    """The modelled time of some calls of one collective on one group, and the link class it used."""

    seconds: float
    link: str  # "nvlink", "network" or "nvlink+network" (an all-to-all spanning nodes)


def _time(link: LinkConfig, calls: int, nbytes: float) -> float:
    return calls * link.latency_us * 1e-6 + nbytes / (link.busbw_gbps * GB)


def collective_time(cluster: ClusterConfig, kind: str, ranks: Sequence[int], calls: int, nbytes: int,
                    rank: int, gpus_per_node: int) -> LinkTime:
    """The modelled time of `calls` calls of `kind` moving `nbytes` (nccl-tests size, summed) on the group
    of global `ranks`, seen from global `rank`, with `gpus_per_node` consecutive ranks per node."""
    n = len(ranks)
    if n <= 1 or calls == 0:
        return LinkTime(0.0, "none")
    moved = nbytes * BUS_FACTOR[kind](n)
    node = rank // gpus_per_node
    local = sum(1 for r in ranks if r // gpus_per_node == node)
    a2a = kind == "all_to_all"
    nvlink, network = ((cluster.nvlink_all_to_all, cluster.network_all_to_all) if a2a
                       else (cluster.nvlink, cluster.network))
    if local == n:
        return LinkTime(_time(nvlink, calls, moved), "nvlink")
    if a2a:  # (local-1) of the n-1 peers over NVLink, the rest over this GPU's NIC, at the same time
        inside, outside = nbytes * (local - 1) / n, nbytes * (n - local) / n
        if local == 1:
            return LinkTime(_time(network, calls, outside), "network")
        return LinkTime(max(_time(nvlink, calls, inside), _time(network, calls, outside)), "nvlink+network")
    # a ring spanning nodes: the bus volume entering the node comes through the `local` members' NICs
    outside = _time(network, calls, moved * (n - local) / (n - 1) / local)
    if local == 1:
        return LinkTime(outside, "network")
    return LinkTime(max(_time(nvlink, calls, moved), outside), "nvlink+network")
