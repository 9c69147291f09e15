"""`spartron rehearse --suggest`: the layouts the planner recommends for a GPU count and per-GPU memory.

Nothing runs. For every layout of the config's model on `world` GPUs (EP over the divisors of the routed
experts, CP in 1, 2, 4, 8, AC none / selective / full; FSDP fills the rest) the planner's predicted peak
(spartron.runtime.memory.plan_memory, the same number `spartron plan` prints) decides whether the rank fits
the device, and a step time is MODELLED, not measured:
- compute: the model's training FLOPs of this rank's tokens (spartron.layers.costs) at `mfu` of the peak
  FLOP/s, plus the forward that AC replays (a third of the replayed FLOPs: all under full AC; under
  selective AC the projections unless its targets keep the matmuls, never the attention it keeps);
- communication, from the link table (spartron.runtime.linktable) on rank 0's groups: FSDP2's all-gathers
  (forward and backward, in model.dtype) and reduce-scatters (model.reduce_dtype; once per micro-batch with
  train.grad_sync = 'every_micro_batch', else once per step) of the dense parameters over fsdp x cp and of
  the routed experts over expert_fsdp; with parallel.dp_replicate > 1 (HSDP) FSDP2's all-reduce of each
  reduce-scattered gradient shard over the replicas (the reduce-scatter's bytes / its group size, in
  model.reduce_dtype, as many calls as reduce-scatters); the MoE all-to-alls (dispatch and combine of
  top_k rows of `dim` per token, forward, backward, and the forward again where AC replays them); CP's
  all-gather of the latent KV rows per layer (again where AC replays it) and its reduce-scatter in
  backward. Whether AC replays an operator is the checkpoint policy's own rule
  (spartron.checkpointing.replays): full AC replays the all-to-alls and all-gathers, selective AC with
  its default targets keeps them (distributed communication is a default target), as a rehearsal measures;
- the headline hides what the runtime overlaps (spartron.launch.rehearse_report's rule: FSDP always, the
  HSDP all-reduce included, since FSDP2 runs it on its own stream right after each reduce-scatter during
  backward; the all-to-alls with train.intra_layer_micro_batches > 1).
A rehearsal (`spartron rehearse`) then measures the chosen layout's compute and peak.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

from spartron.checkpointing import replays
from spartron.launch.rehearse_report import HGX_GPUS
from spartron.layers.costs import PARAM_BYTES, is_routed_expert, param_shapes, receives_gradient, training_flop_parts
from spartron.layers.fp8.wire import wire_row_bytes
from spartron.parallel.dims import ParallelDimsError
from spartron.runtime.config import ConfigError, RunConfig, apply_overrides, config_from_dict
from spartron.runtime.linktable import ClusterConfig, collective_time
from spartron.runtime.memory import plan_memory

AC_MODES = ("none", "selective", "full")
CP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class Suggestion:
    """One layout: its keys, the planner's peak, whether it fits, and its modelled step."""

    ep: int
    cp: int
    fsdp: int
    ac_mode: str
    peak_bytes: int
    fits: bool
    compute_s: float
    comm_s: dict[str, float]  # fsdp, ep, cp: modelled seconds per step
    step_s: float  # headline: the runtime's overlaps only
    tokens_per_s_per_gpu: float
    overrides: tuple[str, ...] = ()  # layout_changes' --set values
    removed: tuple[str, ...] = ()  # layout_changes' keys to delete from the file


def layout_changes(cfg: RunConfig, ep: int, cp: int, ac_mode: str) -> tuple[list[str], list[str]]:
    """What turns `cfg` into the layout: (`--set` overrides, keys to delete from the config file). What only
    the config's own AC mode uses goes with it: `ac.targets` (selective only; `--set` cannot delete a key)
    and, without AC, offload (it offloads checkpoint regions' inputs) - else every other mode of a preset that
    sets them would be refused and silently missing from the suggestions, and the printed command would not
    run (it named only the parallel keys and ac.mode until the V3 preset's suggestion was rehearsed)."""
    sets = [f"parallel.ep={ep}", f"parallel.cp={cp}", "parallel.fsdp=-1", f"ac.mode='{ac_mode}'"]
    removed = ["ac.targets"] if ac_mode != "selective" and cfg.ac.targets is not None else []
    if ac_mode == "none" and cfg.offload.enabled:
        sets.append("offload.enabled=false")
    return sets, removed


def layout_config(cfg: RunConfig, ep: int, cp: int, ac_mode: str) -> RunConfig:
    """`cfg` with EP `ep`, CP `cp`, FSDP filling the world and AC `ac_mode` (layout_changes), validated as a
    file would be."""
    sets, removed = layout_changes(cfg, ep, cp, ac_mode)
    data = cfg.model_dump(mode="json", exclude_none=True)
    for key in removed:
        section, name = key.split(".")
        data[section].pop(name, None)
    return config_from_dict(apply_overrides(data, sets))


def replayed_flops(cfg: RunConfig, parts) -> float:  # noqa: ANN001 - FlopParts
    """Training FLOPs per token whose forward AC runs again: all under full AC; under selective AC the
    projections unless its targets keep the matmuls (the default targets do), never the attention cores."""
    if cfg.ac.mode == "none":
        return 0.0
    if cfg.ac.mode == "full":
        return parts.total
    targets = cfg.ac.targets
    keeps_matmuls = targets is None or any(t in ("aten", "aten::mm", "aten::_grouped_mm") for t in targets)
    return 0.0 if keeps_matmuls else parts.total - parts.attention


def dispatch_op(cfg: RunConfig) -> str:
    """The operator that moves the MoE tokens between EP ranks (what the checkpoint policy keeps or replays)."""
    moe = cfg.model.moe
    if moe.dispatcher == "deepep":
        return "spartron_deepep::dispatch"
    if moe.all_to_all_transport == "copy_engine":
        return "spartron_symm::exchange"
    return "spartron_collectives::all_to_all"


def _group(dims, name: str) -> list[int]:  # noqa: ANN001 - ParallelDims
    return next(g for g in dims.rank_groups(name) if 0 in g)


@dataclass(frozen=True)
class Traffic:
    """One modelled collective of a step on rank 0's group `group` (a ParallelDims group name): its report
    category (rehearse_report.CATEGORIES), kind, calls and bytes per step (the mirror's byte rules)."""

    category: str
    kind: str
    group: str
    calls: float
    bytes: float


def modelled_traffic(cfg: RunConfig, world: int) -> list[Traffic]:
    """The collectives of one step of `cfg` on `world` ranks, as the module docstring models them."""
    m, t = cfg.model, cfg.train
    dims = cfg.parallel.dims(world)
    n_micro = t.micro_steps(dims.dp)
    tokens = t.micro_batch_size * t.seq_len // dims.cp  # this rank's tokens per micro-batch
    a2a_replay = float(replays(dispatch_op(cfg), cfg.ac.mode, cfg.ac.targets))
    kv_replay = float(replays("spartron_collectives::all_gather", cfg.ac.mode, cfg.ac.targets))
    shapes = param_shapes(m)

    def runs(fqn: str) -> int:  # a weight-shared MTP block's layer (its FSDP unit) is gathered and reduce-scattered
        return m.mtp.depth if m.mtp.share_weights and ".layer." in fqn and fqn.startswith("mtp.blocks.") else 1

    dense = sum(math.prod(s) * runs(f) for f, s in shapes.items() if not is_routed_expert(f))
    # FSDP2 reduce-scatters only the gradients that exist (a frozen indexer's stay None)
    dense_grads = sum(math.prod(s) * runs(f) for f, s in shapes.items()
                      if not is_routed_expert(f) and receives_gradient(m, f))
    experts = sum(math.prod(s) * runs(f) for f, s in shapes.items() if is_routed_expert(f)) // dims.ep
    width, reduce = PARAM_BYTES[m.dtype], PARAM_BYTES[m.reduce_dtype or m.dtype]
    syncs = n_micro if t.grad_sync == "every_micro_batch" else 1
    moe_layers = m.n_layers - m.first_k_dense + m.mtp.depth
    blocks = m.n_layers + m.mtp.depth + 1
    a2a_passes = 4 + 2 * a2a_replay  # dispatch + combine, forward and backward, the forward again if AC replays it
    dispatch_passes = 1 + a2a_replay  # the forward dispatches: FP8 rows with model.fp8.dispatch, the rest model.dtype
    row = m.dim * width
    fp8_wire_layers = 0 if m.fp8 is None or not m.fp8.dispatch else \
        sum(m.runs_fp8(i) for i in range(m.first_k_dense, m.n_layers)) + m.mtp.depth
    # the dispatched row's mean bytes over the MoE layers: FP8 in those that run FP8 with model.fp8.dispatch
    wire = (fp8_wire_layers * wire_row_bytes(m.dim) + (moe_layers - fp8_wire_layers) * row) / max(moe_layers, 1)
    a2a_bytes = tokens * m.moe.top_k * ((a2a_passes - dispatch_passes) * row + dispatch_passes * wire) / a2a_passes
    kv_bytes = tokens * dims.cp * (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim) * width
    a2a_calls, kv_gathers = a2a_passes * n_micro * moe_layers, (1 + kv_replay) * n_micro * m.n_layers
    out = [
        Traffic("fsdp", "all_gather", "fsdp_cp", 2 * n_micro * blocks, 2 * n_micro * dense * width),
        Traffic("fsdp", "reduce_scatter", "fsdp_cp", syncs * blocks, syncs * dense_grads * reduce),
        Traffic("fsdp", "all_gather", "expert_fsdp", 2 * n_micro * moe_layers, 2 * n_micro * experts * width),
        Traffic("fsdp", "reduce_scatter", "expert_fsdp", syncs * moe_layers, syncs * experts * reduce),
    ]
    if dims.dp_replicate > 1:  # HSDP: each reduce-scattered shard all-reduced over the replicas
        shards = (syncs * blocks, syncs * dense_grads * reduce / (dims.fsdp * dims.cp)), \
            (syncs * moe_layers, syncs * experts * reduce / dims.expert_fsdp)
        out += [Traffic("fsdp", "all_reduce", "dp_replicate", calls, nbytes) for calls, nbytes in shards]
    return out + [
        Traffic("ep", "all_to_all", "ep", a2a_calls, a2a_calls * a2a_bytes),
        Traffic("cp", "all_gather", "cp", kv_gathers, kv_gathers * kv_bytes),
        Traffic("cp", "reduce_scatter", "cp", n_micro * m.n_layers, n_micro * m.n_layers * kv_bytes),
    ]


def modelled_step(cfg: RunConfig, world: int, cluster: ClusterConfig, mfu: float, peak_tflops: float,
                  gpus_per_node: int) -> tuple[float, dict[str, float], float]:
    """(compute seconds, communication seconds by category, headline step seconds) of one step of `cfg`."""
    m, t = cfg.model, cfg.train
    dims = cfg.parallel.dims(world)
    n_micro = t.micro_steps(dims.dp)
    tokens = t.micro_batch_size * t.seq_len // dims.cp  # this rank's tokens per micro-batch
    parts = training_flop_parts(m, t.seq_len)
    flops = tokens * n_micro * (parts.total + replayed_flops(cfg, parts) / 3)
    compute = flops / (mfu * peak_tflops * 1e12)
    comm = {"fsdp": 0.0, "ep": 0.0, "cp": 0.0}
    for c in modelled_traffic(cfg, world):
        comm[c.category] += collective_time(cluster, c.kind, _group(dims, c.group), round(c.calls), round(c.bytes),
                                            0, gpus_per_node).seconds
    overlapped = comm["fsdp"] + (comm["ep"] if t.intra_layer_micro_batches > 1 else 0.0)
    exposed = sum(comm.values()) - overlapped
    return compute, comm, max(compute, overlapped) + exposed


def suggest(cfg: RunConfig, world: int, device_bytes: int, cluster: ClusterConfig, mfu: float,
            peak_tflops: float, candidates: list | None = None) -> list[Suggestion]:
    """Every valid layout of `cfg` on `world` GPUs, those that fit `device_bytes` first, fastest first.
    `candidates`: candidate_layouts(cfg, world) when the caller has them (each is validated once)."""
    gpus = cfg.launch.gpus_per_node or HGX_GPUS
    out = []
    for ep, cp, mode, lcfg in candidate_layouts(cfg, world) if candidates is None else candidates:
        if isinstance(lcfg, str):
            continue  # not a layout of this world / batch (refused_layouts says why)
        dims = lcfg.parallel.dims(world)
        peak = plan_memory(lcfg, world).peak
        compute, comm, step = modelled_step(lcfg, world, cluster, mfu, peak_tflops, gpus)
        tps = lcfg.train.global_batch_size * lcfg.train.seq_len / world / step
        sets, removed = layout_changes(cfg, ep, cp, mode)
        out.append(Suggestion(ep=ep, cp=cp, fsdp=dims.fsdp, ac_mode=mode, peak_bytes=peak,
                              fits=peak <= device_bytes, compute_s=compute, comm_s=comm, step_s=step,
                              tokens_per_s_per_gpu=tps, overrides=tuple(sets), removed=tuple(removed)))
    return sorted(out, key=lambda s: (not s.fits, -s.tokens_per_s_per_gpu, s.peak_bytes))


def candidate_layouts(cfg: RunConfig, world: int) -> Iterator[tuple[int, int, str, RunConfig | str]]:
    """(ep, cp, AC mode, the layout's validated config or why the config refuses it) for every EP dividing the
    routed experts and the world, every CP of CP_SIZES and every AC mode."""
    n_experts = cfg.model.moe.n_routed_experts
    for ep in (e for e in range(1, min(world, n_experts) + 1) if n_experts % e == 0 and world % e == 0):
        for cp in CP_SIZES:
            for mode in AC_MODES:
                try:
                    lcfg = layout_config(cfg, ep, cp, mode)
                    lcfg.train.micro_steps(lcfg.parallel.dims(world).dp)
                except (ConfigError, ParallelDimsError, ValueError) as err:
                    yield ep, cp, mode, str(err).removeprefix("invalid config: ")
                    continue
                yield ep, cp, mode, lcfg


def refused_layouts(cfg: RunConfig, world: int, candidates: list | None = None) -> dict[str, int]:
    """Why candidate layouts are not suggested: one reason per rule (the first layout's message; layouts whose
    messages differ only in numbers count under it) and how many layouts it refused. The table says so
    instead of leaving them out silently. `candidates` as in `suggest`."""
    first: dict[str, str] = {}
    out: dict[str, int] = {}
    for _, _, _, why in candidate_layouts(cfg, world) if candidates is None else candidates:
        if isinstance(why, str):
            message = first.setdefault(re.sub(r"\d+", "N", why), why)
            out[message] = out.get(message, 0) + 1
    return out


def render_suggestions(rows: list[Suggestion], world: int, device_bytes: int, mfu: float, peak_tflops: float,
                       limit: int, refused: dict[str, int] | None = None) -> str:
    """The table `--suggest` prints: the `limit` best layouts (fitting ones first), then the layouts the config
    refused, by reason (`refused`: refused_layouts)."""
    head = (f"spartron rehearse --suggest: {world} GPUs of {device_bytes / 2**30:.1f} GiB; compute modelled at "
            f"{100 * mfu:.0f}% MFU of {peak_tflops:.0f} TFLOP/s, communication from the link table; "
            f"{sum(r.fits for r in rows)} of {len(rows)} layouts fit")
    lines = [head, f"{'ep':>4} {'cp':>3} {'fsdp':>5} {'ac':>9} {'peak GiB':>9} {'fits':>4} {'compute s':>9} "
                   f"{'fsdp s':>7} {'ep s':>7} {'cp s':>7} {'step s':>7} {'tok/s/GPU':>9}"]
    for r in rows[:limit]:
        lines.append(f"{r.ep:>4} {r.cp:>3} {r.fsdp:>5} {r.ac_mode:>9} {r.peak_bytes / 2**30:>9.1f} "
                     f"{'yes' if r.fits else 'no':>4} {r.compute_s:>9.3f} {r.comm_s['fsdp']:>7.3f} "
                     f"{r.comm_s['ep']:>7.3f} {r.comm_s['cp']:>7.3f} {r.step_s:>7.3f} {r.tokens_per_s_per_gpu:>9.0f}")
    if rows and rows[0].fits:
        first = rows[0]
        lines.append("rehearse the first: --set " + " --set ".join(first.overrides)
                     + "".join(f" (after deleting {key} from the config: only ac.mode = 'selective' reads it)"
                               for key in first.removed))
        lines.append(f"the ranking models every layout at {100 * mfu:.0f}% MFU: rehearse the first few before "
                     "choosing (per-rank efficiency differs by layout: a CP rank runs more, shorter micro-batches)")
    elif rows:
        lines.append("no layout fits: more GPUs, offload (offload.enabled) or a shorter train.seq_len")
    for why, n in (refused or {}).items():
        lines.append(f"not suggested, {n} layout{'s' if n > 1 else ''} refused like this one: {why}")
    return "\n".join(lines) + "\n"
