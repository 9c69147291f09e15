"""`spartron plan`: what a config will do before it runs — resolved config, rank groups, memory per rank.

The parameter count and the bytes of parameters, gradients and optimizer state per rank after FSDP/EP
sharding come from the one cost model (spartron.layers.costs). Activations are not estimated (they
depend on AC, offload and sequence length): the line says so.
"""

from __future__ import annotations

from spartron.layers.costs import count_parameters, state_bytes_per_rank
from spartron.parallel.dims import GROUP_DIMS
from spartron.runtime.config import RunConfig, dump_config


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**24 else f"{n / 2**20:.2f} MiB"


def render_plan(cfg: RunConfig, world_size: int, max_groups: int = 16) -> str:
    """The text `spartron plan` prints (at most `max_groups` groups listed per dimension)."""
    dims = cfg.parallel.dims(world_size)
    out = ["# resolved config", dump_config(cfg).rstrip(), "", f"# parallel layout: {dims.describe()}"]
    for name in GROUP_DIMS:
        groups = dims.rank_groups(name)
        shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:max_groups])
        more = f" ... ({len(groups) - max_groups} more)" if len(groups) > max_groups else ""
        out.append(f"{name:<13} size {dims.group_size(name):<4} {len(groups)} group(s): {shown}{more}")
    params = count_parameters(cfg.model)
    mem = state_bytes_per_rank(cfg.model, dims, cfg.train.optimizer)
    out += ["", f"# memory per rank (estimate; activations not included): parameters {params.total:,} "
                f"({params.dense:,} dense, {params.experts:,} in routed experts)"]
    out += [f"{key:<16} {_gib(value)}" for key, value in mem.items()]
    return "\n".join(out) + "\n"
