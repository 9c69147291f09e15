"""The link table of a cluster: what a collective costs on it, for `spartron rehearse`'s communication model.

A rehearsal measures compute and memory on one device and MODELS communication: for each collective a
step would run (kind, group, bytes in the nccl-tests sense, from spartron.comm.mirror's ledger), the time
is `calls x latency + bytes x factor / busbw`, with nccl-tests' bus-bandwidth factors ((n-1)/n for
all-gather, reduce-scatter and all-to-all, 2(n-1)/n for all-reduce, 1 for broadcast) and the bus
bandwidth of the link class the group crosses: NVLink when every member sits in this rank's node
(`launch.gpus_per_node` consecutive ranks per node), the per-GPU network otherwise. An all-to-all that
spans nodes sends (k-1)/(n-1) of its bytes over NVLink and the rest over the network at the same time (k:
members in this node); the slower of the two sets its time.

Defaults: an HGX H100 or H200 node (both NVLink 4, 450 GB/s per direction per GPU; one 400 Gb/s
ConnectX-7 NIC per GPU, 50 GB/s line rate), bandwidths as published, in GB/s (1e9 bytes/s):
- ring collectives over NVLink, 300 GB/s: nccl-tests all_gather / reduce_scatter bus bandwidth on 8 x
  H100 SXM, large messages, is 300-370 GB/s (NVIDIA's DGX H100 / nccl-tests reports);
- ring collectives over the network, 40 GB/s per GPU: nccl-tests multi-node bus bandwidth on 400 Gb/s
  InfiniBand NDR is 40-48 GB/s per GPU;
- all-to-all over NVLink, 150 GB/s: DeepEP's normal kernels, intranode EP 8, measured 153 GB/s dispatch /
  158 GB/s combine (github.com/deepseek-ai/DeepEP README, H800 whose NVLink tops at ~160 GB/s); the NCCL
  all-to-all of model.moe.dispatcher = 'all_to_all' is of the same order (this project's 2-rank H200
  exchange: benchmarks/results/deepep/deepep.json);
- all-to-all over the network, 40 GB/s per GPU: DeepEP internode normal kernels, EP 16 / 32 / 64: 43 / 58
  / 51 GB/s over RDMA with 400 Gb/s ConnectX-7 (same README); NCCL's all-to-all gets less, hence 40;
- latency per call: 10 us over NVLink, 30 us over the network (nccl-tests small-message times).
Measure your own cluster (nccl-tests, benchmarks/collectives.py) and set `[cluster]`.
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


DEFAULTS: dict[str, dict[str, float]] = {  # the module docstring's sources
    "nvlink": {"busbw_gbps": 300.0, "latency_us": 10.0},
    "network": {"busbw_gbps": 40.0, "latency_us": 30.0},
    "nvlink_all_to_all": {"busbw_gbps": 150.0, "latency_us": 10.0},
    "network_all_to_all": {"busbw_gbps": 40.0, "latency_us": 30.0},
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
    if local == n:
        link = cluster.nvlink_all_to_all if kind == "all_to_all" else cluster.nvlink
        return LinkTime(_time(link, calls, moved), "nvlink")
    if kind != "all_to_all" or local == 1:
        link = cluster.network_all_to_all if kind == "all_to_all" else cluster.network
        return LinkTime(_time(link, calls, moved), "network")
    # nbytes * (n-1)/n leave this rank: (local-1) of the n-1 peers over NVLink, the rest over the network
    inside = nbytes * (local - 1) / n
    outside = nbytes * (n - local) / n
    return LinkTime(max(_time(cluster.nvlink_all_to_all, calls, inside),
                        _time(cluster.network_all_to_all, calls, outside)), "nvlink+network")
