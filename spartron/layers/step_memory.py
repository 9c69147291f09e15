"""The peak memory of one training step per rank, from the model shapes, the parallel layout and the
step's train / ac / offload keys: what `spartron plan` prints and the trainer checks before it starts
(tests/layers/test_memory_plan.py compares it with measured peaks). Parameters and optimizer state come
from the cost model (spartron.layers.costs); this module adds activations, saved tensors and buffers."""

from __future__ import annotations

import math
from dataclasses import dataclass

from spartron.checkpointing.policy import keeps_output
from spartron.comm.copy_engine import GROWTH_QUANTUM
from spartron.comm.deepep_buffer import nvl_buffer_bytes
from spartron.layers.attention.dsa import dsa_schedule
from spartron.layers.attention.indexer_kl_dense import chunk_elements, chunk_rows
from spartron.layers.config import ModelConfig, master_layout_refusal
from spartron.layers.costs import (
    PARAM_BYTES,
    fp8_gemm_weight,
    is_routed_expert,
    optimizer_masters,
    optimizer_state_bytes,
    param_shapes,
    param_shards,
    receives_gradient,
    state_bytes_per_rank,
)
from spartron.layers.fp8.apply import weight_cache_on
from spartron.layers.parallelize import expert_shard_dim
from spartron.parallel.dims import ParallelDims


@dataclass(frozen=True)
class StepShape:
    """What besides the model shapes a step's memory: the run config's train / ac / offload keys
    (spartron.launch.plan.plan_memory builds it from a RunConfig)."""

    seq_len: int
    micro_batch_size: int
    micro_steps: int = 1  # gradient-accumulation micro-batches per optimizer step
    optimizer: str = "adamw"
    moments_dtype: str | None = None  # train.adamw_moments_dtype (None: the stored dtype)
    ac_mode: str = "none"  # none | full | selective
    ac_freq: int = 1
    ac_targets: tuple[str, ...] | None = None  # None: the default targets
    offload: bool = False
    offload_keep_last: int = 1
    offload_prefetch_depth: int = 1
    keep_grad_buffers: bool = False
    device: str = "cuda"  # cpu: SDPA's math path keeps the [B, H, S, S] probabilities
    grad_sync: str = "last_micro_batch"  # train.grad_sync; "every_micro_batch": no unsharded grads accumulate
    # A training stage ([[train.stages]], planned per stage by spartron.runtime.memory): the DSA mode its layers
    # run in (None: model.dsa.indexer_mode; "dense_warmup": dense attention, the indexer trained by kl_dense's
    # loss) and the names of the parameters it trains (None: all). Frozen ones have no gradient, no optimizer
    # state, no gradient reduction; their activations are planned as if they trained (an upper bound).
    dsa_mode: str | None = None
    trainable: frozenset[str] | None = None


@dataclass(frozen=True)
class MemoryPlan:
    """Predicted bytes on one rank. `parts`: what is live at the predicted peak, by kind; `peak` their
    sum; `phase`: when it happens (forward end = inside the loss of the last micro-batch, loss backward = inside
    an LM loss's backward, before any block's, backward = the last block's backward, root reduction = the end of
    backward, where FSDP2's root unit (embedding, head, final norm) reduce-scatters its gradients, optimizer =
    after backward with every gradient)."""

    parts: dict[str, int]
    phase: str
    phases: dict[str, int]  # the peak of each phase

    @property
    def peak(self) -> int:
        return sum(self.parts.values())

    def fits(self, device_bytes: int) -> bool:
        return self.peak <= device_bytes


# The operators whose outputs the planner counts as kept matmul / attention outputs under selective AC; whether
# a target list keeps each is checkpointing.policy's rule (keeps_output)
_MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm", "aten::_addmm_activation",
               "aten::baddbmm")
_ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
                  "aten::_scaled_dot_product_cudnn_attention", "aten::_flash_attention_forward",
                  "aten::_efficient_attention_forward", "aten::_scaled_dot_product_flash_attention_for_cpu",
                  "spartron::sparse_mla", "spartron::sparse_mla_absorbed", "spartron::kl_sparse_target",
                  "spartron::kl_selected_scores")
# DSA's absorbed projections: not default targets (checkpointing.policy), kept only when ac.targets lists them
_ABSORB_OPS = ("spartron::absorb_query", "spartron::absorb_output")


def _keeps_any(ops: tuple[str, ...], targets: list[str] | None) -> bool:
    return any(keeps_output(op, targets) for op in ops)


@dataclass(frozen=True)
class _Block:
    """Bytes per micro-batch of one decoder block: `saved` without AC, `kept` the outputs selective AC
    keeps (matmuls, attention), `work` the backward's temporaries beyond what is saved."""

    saved: int
    kept_matmul: int
    kept_attention: int
    work: int
    kept_absorb: int  # DSA's absorbed query and output projections (kept only when ac.targets names them)
    kept_replay: int  # held by replay frames (checkpointing.replay) in every AC mode: a DSA source's top-k ids
    params: int  # elements (its FSDP unit: all-gathered in the compute dtype)
    trained: int  # elements of those that train (gradients made and reduce-scattered)


def _norm(tokens: int, width: int, a: int) -> int:
    """RMSNorm saves its input, the normalised input and the output (the next matmul's input), + rstd."""
    return tokens * (3 * width * a + 4)


@dataclass(frozen=True)
class _Attention:
    """Bytes of one MLA layer's attention per micro-batch (built by keyword: five ints)."""

    saved: int
    kept_matmul: int  # kept by matmul targets
    kept_attention: int  # kept by attention targets
    kept_absorb: int  # kept by the absorb targets
    kept_replay: int  # held by replay frames in every AC mode
    work: int = 0  # a DSA layer's backward temporaries beyond its saved tensors (the absorbed form's gradients)


def _sparse_attention(m: ModelConfig, tokens: int, keys: int, step: StepShape, a: int) -> tuple[int, int, int, int]:
    """(saved, kept by attention targets, kept by absorb targets, backward work) of a DSA layer's absorbed sparse
    attention. Unchunked: the absorbed query [T, H, c + r] and latent output [T, H, c] (+ lse) are saved, the
    latent output kept under selective AC, and the backward makes their gradients, as large. Query-chunked
    (model.dsa.attention_chunk, attention.sparse_mla_absorbed): saved are q_nope (a view of wq's output) and the
    roped q_pe, kept its output [T, H * v] (wo's input, counted by the caller); the backward holds one chunk's
    absorbed query, latent output and their gradients, a float32 latent-row gradient and the query gradients, and
    what each chunk's sparse backward allocates over all latent rows (sparse_mla_triton.backward): its dkv
    accumulator, float32 then cast to a kv-dtype partial, or with model.dsa.deterministic_dkv int64 fixed point
    scaled in float64 (the int64, the float64 copy and the scaled float64 live at once) before the cast."""
    x, h = m.mla, m.n_heads
    c, r = x.kv_lora_rank, x.qk_rope_head_dim
    chunk = m.dsa.attention_chunk
    if chunk:
        rows = min(chunk, tokens // step.micro_batch_size) * step.micro_batch_size  # a chunk of each sequence
        saved = tokens * h * (x.qk_nope_head_dim + 2 * r) * a
        kept = tokens * h * x.v_head_dim * a if keeps_output("spartron::sparse_mla_absorbed", step.ac_targets) else 0
        per_call = keys * (c + r) * (3 * 8 if m.dsa.deterministic_dkv else 4 + a)  # one chunk's dkv accumulator
        work = (rows * h * 2 * (2 * c + r) * a + keys * (c + r) * 4 + tokens * h * (x.qk_nope_head_dim + r) * a
                + per_call)
        return saved, kept, 0, work
    q_abs, out = tokens * h * (c + r) * a, tokens * h * c * a
    saved = q_abs + out + tokens * h * x.v_head_dim * a + tokens * h * 4
    kept = out + tokens * h * 4 if keeps_output("spartron::sparse_mla", step.ac_targets) else 0
    return saved, kept, q_abs + tokens * h * x.v_head_dim * a, out + q_abs


def _attention_block(m: ModelConfig, tokens: int, step: StepShape, role, cp: int, a: int) -> _Attention:
    """One MLA layer's attention. A DSA layer keeps its sparse attention's output [T, H, kv_lora] and lse; a
    source also its indexer's projections, the top-k ids [T, K] (int32) and, with kl_sparse, the KL target and
    selected scores ([T, K] float32 each). Frozen / kl_sparse ids come from `reuse_during_recompute`: its frame
    holds them from the forward to the replay in every AC mode, full included; kl_dense's ids and per-row KL are
    the outputs of its chunked op, MANDATORY in the AC policy, so kept in every mode too. kl_dense / a dense
    warm-up's KL runs in query chunks, nothing [T, S] kept (attention.indexer_kl_dense; its chunk's
    temporaries: `_kl_dense_work`)."""
    x, h = m.mla, m.n_heads
    qk, kv = x.qk_nope_head_dim + x.qk_rope_head_dim, x.kv_lora_rank + x.qk_rope_head_dim
    keys = tokens * cp  # CP gathers the compressed keys of the whole sequence
    mode = _dsa_mode(m, step)
    saved = _norm(tokens, m.dim, a)
    mm = absorb = replay = 0
    if x.q_lora_rank:
        saved += _norm(tokens, x.q_lora_rank, a)  # wq_a's output is q_norm's input
        mm += tokens * x.q_lora_rank * a
    mm += tokens * h * qk * a + tokens * kv * a  # wq (wq_b), wkv_a outputs
    saved += tokens * kv * a + tokens * x.kv_lora_rank * a + keys * kv * a  # wkv_a out, kv_norm, compressed (+rope)
    if role is None or mode == "dense_warmup":  # dense SDPA: q, k (cat with the rope part), v (a view on CUDA)
        wkv_b = keys * h * (x.qk_nope_head_dim + x.v_head_dim) * a
        v = wkv_b if step.device == "cuda" else keys * h * x.v_head_dim * a
        scores = tokens * h * 4 if step.device == "cuda" else tokens * h * keys // step.micro_batch_size * a
        out = tokens * h * x.v_head_dim * a
        saved += tokens * h * qk * a + keys * h * qk * a + v + scores + out
        mm += wkv_b
        attn = out + tokens * h * 4
    work = 0
    if role is not None and mode != "dense_warmup":  # absorbed sparse attention over the selected keys
        # ac.targets naming other ops than sparse_mla / the KL ops (a list without them): recomputed in the replay
        sparse_saved, attn, absorb, work = _sparse_attention(m, tokens, keys, step, a)
        saved += sparse_saved
    if role == "source":  # the indexer: its projections, the top-k ids, the KL's (dense warm-up: kl_dense's)
        d, k = m.dsa, min(m.dsa.index_topk, keys)
        index = tokens * (d.n_index_heads * d.index_head_dim + d.index_head_dim + d.n_index_heads) * a
        ids, kl = tokens * k * 4, (2 * tokens * k * 4 if mode == "kl_sparse" else 0)
        saved += index + ids + kl + (tokens * k * 4 if mode == "kl_sparse" else 0)  # + log_softmax
        mm += index
        attn += kl if _keeps_any(("spartron::kl_sparse_target", "spartron::kl_selected_scores"), step.ac_targets) else 0
        replay += ids + (tokens * 4 if mode in _KL_DENSE else 0)  # kl_dense: its MANDATORY op's outputs
        if mode == "dense_warmup":  # kl_dense's saved target query: absorbed [T, H, c + r], or (chunked) roped q_pe
            saved += tokens * h * ((0 if m.dsa.attention_chunk else x.kv_lora_rank) + x.qk_rope_head_dim) * a
    saved += tokens * h * x.v_head_dim * a  # wo's input
    mm += tokens * m.dim * a  # wo's output
    return _Attention(saved=saved, kept_matmul=mm, kept_attention=attn, kept_absorb=absorb, kept_replay=replay,
                      work=work)


_KL_DENSE = ("kl_dense", "dense_warmup")  # the DSA modes whose KL runs spartron::kl_dense in query chunks
_BLOCK_PREFIXES = ("layers.", "mtp.blocks.")  # each block its own FSDP2 unit; the rest is the root's


def _dsa_mode(m: ModelConfig, step: StepShape) -> str | None:
    """The DSA mode the step's layers run in: the stage's, else model.dsa.indexer_mode (None: no DSA)."""
    return None if m.dsa is None else step.dsa_mode or m.dsa.indexer_mode


def _kl_dense_work(m: ModelConfig, step: StepShape, cp: int) -> int:
    """Bytes of one kl_dense chunk's temporaries (attention.indexer_kl_dense), live in its forward and in its
    backward's recompute: B x rows x S_kv x chunk_elements float32, and the chunk's rows of the absorbed query
    [B, rows, H, c + r] in float32 (a copy unless the compute dtype is that wide) and, when the attention runs in
    query chunks (no [T, H, c + r] query exists then), absorbed from q_nope in the compute dtype first."""
    keys, d, a = step.seq_len, m.dsa, PARAM_BYTES[m.dtype]
    rows = chunk_rows(d.kl_dense_chunk or None, step.micro_batch_size, keys, m.n_heads, d.n_index_heads)
    rows = step.micro_batch_size * min(rows, step.seq_len // cp)
    query = rows * m.n_heads * (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim)
    return 4 * rows * keys * chunk_elements(m.n_heads, d.n_index_heads) + query * (
        (0 if a >= 4 else 4) + (a if d.attention_chunk else 0))


def _ffn_block(m: ModelConfig, tokens: int, moe: bool, a: int) -> tuple[int, int, int]:
    """(saved, kept by matmul targets, widest intermediate) of one FFN (dense SwiGLU or MoE)."""
    saved = _norm(tokens, m.dim, a)
    if not moe:
        i = m.dense_inter_dim
        return saved + 4 * tokens * i * a, tokens * (2 * i + m.dim) * a, tokens * i
    e = m.moe
    routed = tokens * e.top_k
    router = tokens * e.n_routed_experts * (4 if e.router_fp32 else a) * 2 + tokens * e.top_k * (8 + 4) * 2
    saved += router + routed * m.dim * a * 2 + 4 * routed * e.moe_inter_dim * a  # permuted in / out, SwiGLU
    mm = tokens * e.n_routed_experts * (4 if e.router_fp32 else a) + routed * (2 * e.moe_inter_dim + m.dim) * a
    si = e.n_shared_experts * e.moe_inter_dim
    if si:
        saved += 4 * tokens * si * a
        mm += tokens * (2 * si + m.dim) * a
    return saved, mm, max(routed * e.moe_inter_dim, tokens * si)


def _trains(step: StepShape, fqn: str) -> bool:
    return step.trainable is None or fqn in step.trainable


def trained_state_bytes(m: ModelConfig, dims: ParallelDims, step: StepShape, rank: int = 0) -> dict[str, int]:
    """state_bytes_per_rank with the gradients and optimizer state of the parameters the step trains only (a
    stage's frozen parameters have neither); the parameters themselves all stay."""
    state = state_bytes_per_rank(m, dims, step.optimizer, rank, step.moments_dtype)
    if step.trainable is None:
        return state
    shards = {f: s for f, s in param_shards(m, dims, rank).items() if f in step.trainable and receives_gradient(m, f)}
    width = PARAM_BYTES[m.stored_dtype]
    out = {"parameters": state["parameters"], "gradients": sum(math.prod(s) for s in shards.values()) * width,
           "optimizer_state": optimizer_state_bytes(m, shards, step.optimizer, step.moments_dtype)}
    return out | {"total": sum(out.values())}


def _blocks(m: ModelConfig, dims: ParallelDims, step: StepShape, a: int) -> list[_Block]:
    tokens = step.micro_batch_size * step.seq_len // dims.cp
    roles, shapes = dsa_schedule(m), param_shapes(m)
    blocks = []
    n_mtp = m.mtp.depth
    for i in range(m.n_layers + n_mtp):
        moe = i >= m.first_k_dense
        attn = _attention_block(m, tokens, step, roles[i], dims.cp, a)
        s_ffn, mm_ffn, widest = _ffn_block(m, tokens, moe, a)
        saved, mm = attn.saved + s_ffn, attn.kept_matmul + mm_ffn
        if i >= m.n_layers:  # MTP depth: its two norms, the embedding and the projection's input and output
            saved += 2 * _norm(tokens, m.dim, a) + tokens * m.dim * a * 4
            mm += tokens * m.dim * a
        prefix = f"layers.{i}." if i < m.n_layers else f"mtp.blocks.{0 if m.mtp.share_weights else i - m.n_layers}."
        local = {f: math.prod(s) // (dims.ep if is_routed_expert(f) else 1) for f, s in shapes.items()
                 if f.startswith(prefix)}
        params = sum(local.values())
        trained = sum(n for f, n in local.items() if _trains(step, f) and receives_gradient(m, f))
        # a DSA layer's attention backward runs after its FFN's, whose saved tensors are gone by then
        work = max(tokens * m.dim * a * 4 + 2 * widest * a, attn.work + tokens * m.dim * a * 2 - s_ffn)
        blocks.append(_Block(saved=saved, kept_matmul=mm, kept_attention=attn.kept_attention, work=work,
                             kept_absorb=attn.kept_absorb, kept_replay=attn.kept_replay, params=params,
                             trained=trained))
    return blocks


def _loss(m: ModelConfig, tokens: int, a: int) -> tuple[int, int, int]:
    """(saved for backward, extra live at the forward's peak, live at its backward's peak, saved included) of one LM
    loss. Chunked: the saved float32 weight gradient scaled (float32) and cast (compute dtype), the hidden one scaled;
    plain: log_softmax's backward holds its saved output, the incoming gradient and its result, [N, V] float32 each
    (the cast to the compute dtype after it holds less)."""
    v, c = m.vocab_size, m.loss_chunk_size
    norm = _norm(tokens, m.dim, a)
    if 0 < c < tokens:  # spartron.layers.loss: the gradients of each chunk at once, [N, V] never kept
        saved = norm + tokens * m.dim * a + v * m.dim * 4
        return saved, c * v * (12 + a) + v * m.dim * (4 + a), saved + tokens * m.dim * a + v * m.dim * (4 + a)
    f32 = tokens * v * 4
    saved = norm + f32  # log_softmax's output
    return saved, f32 + tokens * v * a, norm + 3 * f32


def comm_buffer_bytes(m: ModelConfig, dims: ParallelDims, tokens: int) -> int:
    """The EP group's long-lived buffers (spartron.comm): DeepEP's NVLink buffer, or the copy engine's
    symmetric memory (two receive slots of the rows a rank receives, grown 1.25x to a quantum; rows
    assumed balanced: tokens x top_k). The NCCL all-to-all's buffers are the dispatched tokens, counted
    with the activations."""
    e = m.moe
    if dims.ep == 1 or m.first_k_dense >= m.n_layers and not m.mtp.depth:
        return 0
    if e.dispatcher == "deepep":
        return nvl_buffer_bytes(m.dim, dims.ep, e.deepep_num_sms)
    if e.dispatcher == "all_to_all" and e.all_to_all_transport == "copy_engine":
        slot = -(-tokens * e.top_k * m.dim * PARAM_BYTES[m.dtype] // 256) * 256
        return -(-int(2 * slot * 1.25) // GROWTH_QUANTUM) * GROWTH_QUANTUM
    return 0


def fp8_weight_cache_bytes(m: ModelConfig, dims: ParallelDims) -> int:
    """model.fp8.weight_cache as an eager step resolves it (spartron.layers.fp8.weight_cache): every local
    routed expert weight's FP8 blocks and transposed blocks (1 byte an element each) and their fp32 scales
    (the experts that run FP8: fp8_gemm_weight), from the first forward to the optimizer step (unsharded: on
    with expert_fsdp > 1 it holds whole experts)."""
    if m.fp8 is None or not weight_cache_on(m.fp8, False, dims.expert_fsdp):
        return 0
    elements = sum(math.prod(s) // dims.ep for f, s in param_shapes(m).items() if fp8_gemm_weight(m, f, s) == "experts")
    return 2 * elements + 2 * 4 * elements // (128 * 128)


def fp8_gathered_shard_bytes(m: ModelConfig, dims: ParallelDims) -> int:
    """model.fp8.param_gather (spartron.layers.fp8.param_gather): each FP8-gathered weight's E4M3 shard (1 byte a
    padded shard element) and its full weight's fp32 128x128 block scales, held from one optimizer step to the
    next. The gathered blocks and their transpose (2 bytes an unsharded element) take the place of the bf16
    unsharded weight, so the unsharded parameters count as before. Experts of a 1-rank expert_fsdp group are not
    gathered (they keep the weight cache: fp8_weight_cache_bytes)."""
    if m.fp8 is None or not m.fp8.param_gather:
        return 0
    total = 0
    for fqn, shape in param_shapes(m).items():
        kind = fp8_gemm_weight(m, fqn, shape)
        if kind == "experts" and dims.expert_fsdp > 1:
            local, shards = (shape[0] // dims.ep, *shape[1:]), dims.expert_fsdp
            dim = expert_shard_dim(local, shards)
        elif kind == "dense":
            local, shards, dim = shape, dims.fsdp * dims.cp, 0
        else:
            continue
        elements = math.prod(local)
        total += -(-local[dim] // shards) * (elements // local[dim]) + 4 * elements // (128 * 128)
    return total


def memory_plan(m: ModelConfig, dims: ParallelDims, step: StepShape, rank: int = 0) -> MemoryPlan:
    """Predicted peak allocated bytes of one training step on `rank` (eager, as the trainer runs it).

    Static: the sharded parameters, gradients and optimizer state (state_bytes_per_rank); gradients are
    live through the whole step with gradient accumulation or train.keep_grad_buffers, else they appear
    during backward. Activations per micro-batch, by AC mode: none keeps every block's saved tensors;
    full keeps each region's input and recomputes one block at a time in backward; selective also keeps
    the outputs of its targets (matmuls, attention, communication) and replays the rest. Every `freq`-th
    block is a region. An offload window keeps only `keep_last` regions' inputs (+ `prefetch_depth` in
    flight) on the device. FSDP2 all-gathers a block's parameters (and prefetches the next) in the
    compute dtype and reduce-scatters its gradients in model.reduce_dtype. The LM losses (main and MTP)
    keep what spartron.layers.loss keeps; the chunked loss's [chunk, vocab] temporaries are the forward's
    peak. Five phase peaks are compared: forward end, the losses' backward (before any block's: its [T, vocab]
    temporaries never meet a block's recompute), backward of the last block, the root's gradient reduction
    at the end of backward (FSDP2's root unit, the embedding, head and final norm, reduce-scatters last, its
    weights still gathered: with a large vocabulary and small blocks, its gradients are the largest unit's),
    optimizer step.
    model.master_weights = "optimizer" (one rank, no FSDP2): compute-dtype parameters beside fp32 masters;
    a single micro-batch's gradients stay in the compute dtype, several sum into fp32 main gradients (live
    through the step, plus the largest parameter's compute-dtype gradient and its first fp32 copy in flight);
    the CPU's torch reference update holds three fp32 temporaries of the largest parameter.
    model.fp8.weight_cache: the routed experts' quantised weights, through the whole step; model.fp8.param_gather:
    the FP8-gathered weights' E4M3 shards and scales, through the whole step.
    A training stage (`step.dsa_mode`, `step.trainable`): its DSA layers' attention and KL terms, gradients,
    optimizer state, gradient reduction and accumulation of the parameters that train only.
    """
    a = PARAM_BYTES[m.dtype]
    stored = PARAM_BYTES[m.stored_dtype]
    shapes = param_shapes(m)
    state = trained_state_bytes(m, dims, step, rank)
    static = state["parameters"] + state["optimizer_state"]
    grads = state["gradients"]
    tokens = step.micro_batch_size * step.seq_len // dims.cp
    blocks = _blocks(m, dims, step, a)
    keeps_mm, keeps_attn = _keeps_any(_MATMUL_OPS, step.ac_targets), _keeps_any(_ATTENTION_OPS, step.ac_targets)
    keeps_absorb = _keeps_any(_ABSORB_OPS, step.ac_targets)
    block_input = tokens * m.dim * a
    saved, recompute = [], []
    for i, b in enumerate(blocks):
        region = step.ac_mode != "none" and i % step.ac_freq == 0
        if not region:
            saved.append(b.saved)
            recompute.append(0)
            continue
        kept = block_input + b.kept_replay
        if step.ac_mode == "selective":
            kept += (b.kept_matmul if keeps_mm else 0) + (b.kept_attention if keeps_attn else 0)
            kept += b.kept_absorb if keeps_absorb else 0
        saved.append(kept)
        recompute.append(b.saved - kept + block_input)
    regions = [i for i, r in enumerate(recompute) if r]
    if step.offload and regions:  # block inputs in the window live on the host
        on_device = set(regions[-step.offload_keep_last:] if step.offload_keep_last else [])
        moved = [i for i in regions if i not in on_device]
        in_flight = set(moved[-step.offload_prefetch_depth:] if step.offload_prefetch_depth else [])
        for i in moved:
            if i not in in_flight:
                saved[i] -= block_input
    n_losses = 1 + m.mtp.depth
    loss_saved, loss_fwd, loss_bwd = _loss(m, tokens, a)
    embed = tokens * m.dim * a
    acts = sum(saved) + n_losses * loss_saved + embed
    biggest = max(blocks, key=lambda b: b.params)
    trained = max(b.trained for b in blocks)  # the largest unit's gradients that are made and reduce-scattered
    reduce = PARAM_BYTES[m.reduce_dtype]
    masters = optimizer_masters(m)
    refusal = master_layout_refusal(m.master_weights, dims.world_size) if masters else None
    if refusal:
        raise ValueError(refusal)
    fsdp = dims.world_size > 1 or (m.master_dtype is not None and not masters)  # spartron.layers.parallelize
    head = m.vocab_size * m.dim
    # FSDP2: the block in use and the prefetched one all-gathered in the compute dtype, the root's
    # embedding + head for the whole forward, one block's gradients reduce-scattered in reduce_dtype.
    unsharded = 2 * biggest.params * a if fsdp else 0
    root = head * (1 if m.tie_embeddings else 2) * a if fsdp else 0
    reduction = trained * (a + reduce) if fsdp else 0
    # the root unit's gradients (what no block holds), reduce-scattered at the end of backward
    root_trained = sum(math.prod(s) for f, s in shapes.items() if not f.startswith(_BLOCK_PREFIXES)
                       and _trains(step, f) and receives_gradient(m, f))
    root_reduction = root_trained * (a + reduce) if fsdp else 0
    if fsdp and step.device == "cpu":  # gloo reduce-scatters through a second full-size buffer
        reduction += trained * reduce
        root_reduction += root_trained * reduce
    grads_always = grads if (step.micro_steps > 1 or step.keep_grad_buffers) else 0
    largest = max((math.prod(s) for f, s in shapes.items() if _trains(step, f)), default=0)
    accumulate = update = 0
    if masters:
        if step.micro_steps == 1:  # autograd's compute-dtype gradients, dropped after the step
            grads, grads_always = grads * a // stored, 0
        else:
            accumulate = largest * (a + stored)
        update = 3 * largest * stored if step.device == "cpu" else 0
    if fsdp and step.micro_steps > 1 and not step.keep_grad_buffers and step.grad_sync == "last_micro_batch":
        # the trainer turns FSDP2's gradient sync off for all but the last micro-batch: until then every
        # block's UNSHARDED gradients accumulate (compute dtype); sharded ones appear only when reduced
        unsharded_params = sum(math.prod(s) // (dims.ep if is_routed_expert(f) else 1) for f, s in shapes.items()
                               if _trains(step, f))
        grads_always = unsharded_params * a
    head_trains = _trains(step, "embed.weight" if m.tie_embeddings else "head.weight")
    head_grad = 0 if grads_always or not head_trains else head * (a if masters else stored)  # backward's first
    last = blocks[-1]
    # gradients made before the blocks' backward: the head's. With MTP the backward runs each depth's loss and block,
    # deepest first, then the main loss: the head (and an untied embedding) serve every depth, so the deeper depths'
    # gradients of them wait in autograd (compute dtype) for the main loss's (the main embedding's), and those of a
    # weight-shared MTP block for its shallower depths'
    early_grads = head_grad
    if m.mtp.depth:
        early_grads = head * a * sum(_trains(step, f) for f in ("embed.weight", "head.weight") if f in shapes)
        early_grads += last.trained * a if m.mtp.depth > 1 and m.mtp.share_weights else 0
    # a kl_dense source's chunk temporaries, counted at the backward's peak (an upper bound: they live in its layer)
    kl_work = _kl_dense_work(m, step, dims.cp) if _dsa_mode(m, step) in _KL_DENSE else 0
    comm = comm_buffer_bytes(m, dims, tokens)
    fp8_cache = fp8_weight_cache_bytes(m, dims)
    fp8_shards = fp8_gathered_shard_bytes(m, dims)
    static += comm + fp8_cache + fp8_shards
    phases = {
        "forward end": static + grads_always + acts + loss_fwd + root + unsharded // 2,
        # the losses' backward runs before any block's, so its [T, V] temporaries meet no recompute: the first (the
        # deepest depth's) with the last block prefetched, a shallower MTP depth's after that depth's block, whose
        # gradients reduce-scatter beside the early ones
        "loss backward": static + grads_always + acts - loss_saved + loss_bwd + root + max(
            unsharded // 2, early_grads + unsharded + reduction - saved[-1] - loss_saved if m.mtp.depth else 0),
        "backward": static + grads_always + early_grads + acts - n_losses * loss_saved + recompute[-1]
        + last.work + kl_work + root + unsharded + reduction + accumulate,
        "root reduction": static + grads + root + root_reduction,
        "optimizer": static + grads + reduction + update,
    }
    phase = max(phases, key=phases.get)
    parts = {"parameters": state["parameters"], "optimizer_state": state["optimizer_state"],
             "communication_buffers": comm}
    if fp8_cache:
        parts["fp8_weight_cache"] = fp8_cache
    if fp8_shards:
        parts["fp8_gathered_shards"] = fp8_shards
    if phase == "optimizer":
        parts |= {"gradients": grads, "gradient_reduction": phases[phase] - static - grads}
    elif phase == "root reduction":
        parts |= {"gradients": grads, "unsharded_parameters": root, "gradient_reduction": root_reduction}
    else:
        freed = {"loss backward": loss_saved, "backward": n_losses * loss_saved}  # the losses' saved tensors
        parts |= {"gradients": grads_always, "activations": acts - freed.get(phase, 0),
                  "unsharded_parameters": root + unsharded // (1 if phase == "backward" else 2)}
        parts["working"] = phases[phase] - sum(parts.values())
    return MemoryPlan(parts=parts, phase=phase, phases=phases)
