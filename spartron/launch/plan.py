"""`spartron plan`: what a config will do before it runs — resolved config, rank groups, memory per rank.

The memory estimate counts parameters from the ModelConfig shapes (the same projections the layers
build) and the bytes of parameters, gradients and optimizer state per rank after FSDP/EP sharding.
Activations are not estimated (they depend on AC, offload and sequence length): the line says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from spartron.layers.config import ModelConfig
from spartron.parallel.dims import GROUP_DIMS, ParallelDims
from spartron.runtime.config import RunConfig, dump_config

_BYTES = {"float32": 4, "bfloat16": 2}
_OPTIMIZER_STATE_BYTES = {"adamw": 8, "muon": 4}  # fp32 exp_avg + exp_avg_sq / fp32 momentum


@dataclass(frozen=True)
class ParamCount:
    """Parameters split the way they are sharded: dense (over fsdp x cp) and routed experts (over ep)."""

    dense: int
    experts: int

    @property
    def total(self) -> int:
        return self.dense + self.experts


def _mla_params(m: ModelConfig) -> int:
    a = m.mla
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    q = (m.dim * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * m.n_heads * qk) if a.q_lora_rank \
        else m.dim * m.n_heads * qk
    kv = m.dim * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank \
        + a.kv_lora_rank * m.n_heads * (a.qk_nope_head_dim + a.v_head_dim)
    return q + kv + m.n_heads * a.v_head_dim * m.dim


def _indexer_params(m: ModelConfig) -> int:
    d = m.dsa
    q_in = m.mla.q_lora_rank or m.dim
    return q_in * d.n_index_heads * d.index_head_dim + m.dim * d.index_head_dim + 2 * d.index_head_dim \
        + m.dim * d.n_index_heads


def _moe_params(m: ModelConfig) -> ParamCount:
    e = m.moe
    shared = 3 * m.dim * e.moe_inter_dim * e.n_shared_experts
    router = m.dim * e.n_routed_experts  # the expert bias is a buffer, not a parameter
    return ParamCount(dense=shared + router, experts=3 * m.dim * e.moe_inter_dim * e.n_routed_experts)


def count_parameters(m: ModelConfig) -> ParamCount:
    """Parameter count of the reference model (spartron.layers.model), norms included.

    Only DSA source layers own an indexer; consumers reuse the source's top-k ids.
    """
    from spartron.layers.dsa import dsa_schedule

    roles = dsa_schedule(m)
    dense, experts = m.vocab_size * m.dim * (1 if m.tie_embeddings else 2) + m.dim, 0
    for layer in range(m.n_layers):
        dense += 2 * m.dim + _mla_params(m) + (_indexer_params(m) if roles[layer] == "source" else 0)
        if layer < m.first_k_dense:
            dense += 3 * m.dim * m.dense_inter_dim
        else:
            moe = _moe_params(m)
            dense, experts = dense + moe.dense, experts + moe.experts
    mtp_blocks = (1 if m.mtp.share_weights else m.mtp.depth) if m.mtp.depth else 0
    for depth in range(mtp_blocks):
        moe = _moe_params(m)
        indexer = _indexer_params(m) if roles[m.n_layers + depth] == "source" else 0
        dense += 2 * m.dim * m.dim + 5 * m.dim + _mla_params(m) + indexer + moe.dense
        experts += moe.experts
    return ParamCount(dense=dense, experts=experts)


def estimate_memory_per_rank(cfg: RunConfig, dims: ParallelDims) -> dict[str, int]:
    """Bytes per rank of parameters, gradients and optimizer state (+ fp32 master copy for bf16)."""
    params = count_parameters(cfg.model)
    local = params.dense / (dims.fsdp * dims.cp) + params.experts / (dims.ep * dims.expert_fsdp)
    width = _BYTES[cfg.model.dtype]
    out = {
        "parameters": int(local * width),
        "gradients": int(local * width),
        "optimizer_state": int(local * _OPTIMIZER_STATE_BYTES[cfg.train.optimizer]),
        "master_weights": int(local * 4) if width < 4 else 0,
    }
    out["total"] = sum(out.values())
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**24 else f"{n / 2**20:.2f} MiB"


def render_plan(cfg: RunConfig, world_size: int, max_groups: int = 16) -> str:
    """The text `spartron plan` prints (at most `max_groups` groups listed per dimension)."""
    p = cfg.parallel
    dims = ParallelDims(world_size=world_size, fsdp=p.resolve_fsdp(world_size), cp=p.cp, ep=p.ep,
                        dp_replicate=p.dp_replicate, order=p.order)
    out = ["# resolved config", dump_config(cfg).rstrip(), "", f"# parallel layout: {dims.describe()}"]
    for name in GROUP_DIMS:
        groups = dims.rank_groups(name)
        shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:max_groups])
        more = f" ... ({len(groups) - max_groups} more)" if len(groups) > max_groups else ""
        out.append(f"{name:<13} size {dims.group_size(name):<4} {len(groups)} group(s): {shown}{more}")
    params = count_parameters(cfg.model)
    mem = estimate_memory_per_rank(cfg, dims)
    out += ["", f"# memory per rank (estimate; activations not included): parameters {params.total:,} "
                f"({params.dense:,} dense, {params.experts:,} in routed experts)"]
    out += [f"{key:<16} {_gib(value)}" for key, value in mem.items()]
    return "\n".join(out) + "\n"
