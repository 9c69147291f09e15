"""THE cost model of the reference model (spartron.layers.model): parameters, training FLOPs, state memory.

One place, read from the ModelConfig shapes the layers build, so `spartron plan` (parameters and
memory), the trainer's MFU and the benchmarks agree. Tested against the built model's numel and
against torch's FlopCounterMode over a forward + backward (tests/layers/test_costs.py).

FLOPs count what the layers compute, per trained token, forward + backward = 3 x forward:
- every projection (attention, FFN, the `top_k` routed and the shared experts, router, MTP
  projection, head): 6 x its parameters; embedding lookups, norms and elementwise work are not
  counted;
- dense attention: 2 x heads x (qk + v dims) per causally visible key (SDPA's QK^T and PV);
- DSA layers attend in the absorbed latent form (spartron.layers.attention.mla): 2 x heads x
  (kv_lora + rope + kv_lora) per selected key (at most `index_topk` visible keys);
- the lightning indexer runs only in DSA SOURCE layers (`dsa_schedule`; consumers reuse the ids):
  projections, and 2 x index heads x (index dim + 1) per visible key for the weighted scores. A
  frozen indexer runs forward only (no grad); a KL-trained one has detached inputs (its
  projections get weight gradients only: 2 x forward) and computes the main-attention target without
  grad; kl_dense trains its scores over the visible keys (3 x) with the target over them, kl_sparse
  selects over the visible keys without grad (1 x, `indexer_topk`) and trains its scores (3 x) with the
  target over the top-k only (attention.indexer_kl; its backward's recompute of the logits not counted).
"""

from __future__ import annotations

from dataclasses import dataclass

from spartron.comm.copy_engine import GROWTH_QUANTUM
from spartron.comm.deepep_buffer import nvl_buffer_bytes
from spartron.layers.attention.dsa import dsa_schedule
from spartron.layers.config import ModelConfig
from spartron.layers.parallelize import expert_shard_dim
from spartron.parallel.dims import ParallelDims

PARAM_BYTES = {"float32": 4, "bfloat16": 2}


# ---- parameters ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamCount:
    """Parameters split the way they are sharded: dense (over fsdp x cp) and routed experts (over ep)."""

    dense: int
    experts: int

    @property
    def total(self) -> int:
        return self.dense + self.experts


def mla_matmul_params(m: ModelConfig) -> int:
    """wq (or wq_a + wq_b), wkv_a, wkv_b, wo."""
    a, h = m.mla, m.n_heads
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    q = m.dim * a.q_lora_rank + a.q_lora_rank * h * qk if a.q_lora_rank else m.dim * h * qk
    kv = m.dim * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * h * (a.qk_nope_head_dim + a.v_head_dim)
    return q + kv + h * a.v_head_dim * m.dim


def indexer_matmul_params(m: ModelConfig) -> int:
    """The lightning indexer's wq_b (from the q latent, or x when q_lora_rank = 0), wk, weights_proj."""
    d = m.dsa
    q_in = m.mla.q_lora_rank or m.dim
    return q_in * d.n_index_heads * d.index_head_dim + m.dim * d.index_head_dim + m.dim * d.n_index_heads


def _moe_params(m: ModelConfig) -> ParamCount:
    e = m.moe
    shared = 3 * m.dim * e.moe_inter_dim * e.n_shared_experts
    router = m.dim * e.n_routed_experts  # the expert bias is a buffer, not a parameter
    return ParamCount(dense=shared + router, experts=3 * m.dim * e.moe_inter_dim * e.n_routed_experts)


def count_parameters(m: ModelConfig) -> ParamCount:
    """Parameter count of the reference model, norms included.

    Only DSA source layers own an indexer; consumers reuse the source's top-k ids.
    """
    roles = dsa_schedule(m)
    mla = mla_matmul_params(m) + m.mla.q_lora_rank + m.mla.kv_lora_rank  # + q_norm, kv_norm
    indexer = indexer_matmul_params(m) + 2 * m.dsa.index_head_dim if m.dsa is not None else 0  # + k_norm
    dense, experts = m.vocab_size * m.dim * (1 if m.tie_embeddings else 2) + m.dim, 0
    for layer in range(m.n_layers):
        dense += 2 * m.dim + mla + (indexer if roles[layer] == "source" else 0)
        if layer < m.first_k_dense:
            dense += 3 * m.dim * m.dense_inter_dim
        else:
            moe = _moe_params(m)
            dense, experts = dense + moe.dense, experts + moe.experts
    mtp_blocks = (1 if m.mtp.share_weights else m.mtp.depth) if m.mtp.depth else 0
    for depth in range(mtp_blocks):
        moe = _moe_params(m)
        dense += 2 * m.dim * m.dim + 5 * m.dim + mla + (indexer if roles[m.n_layers + depth] == "source" else 0)
        dense, experts = dense + moe.dense, experts + moe.experts
    return ParamCount(dense=dense, experts=experts)


# ---- FLOPs -------------------------------------------------------------------------------------
def mean_visible_keys(seq_len: int, cap: int | None) -> float:
    """Average number of keys a causal query attends to over positions 0..seq_len-1 (capped at top-k)."""
    if cap is None or cap >= seq_len:
        return (seq_len + 1) / 2
    return (cap * (cap + 1) / 2 + cap * (seq_len - cap)) / seq_len


@dataclass(frozen=True)
class FlopParts:
    """Training FLOPs per token by kind (see the module docstring); `total` is what MFU divides by."""

    projections: float  # 6 x active matmul parameters, head and MTP projections included
    attention: float  # dense SDPA and sparse (absorbed) attention cores, forward + backward
    indexer_projections: float
    indexer_scores: float  # the weighted index scores, and the KL target of a trained indexer

    @property
    def total(self) -> float:
        return self.projections + self.attention + self.indexer_projections + self.indexer_scores


def _ffn_active_params(m: ModelConfig, moe: bool) -> int:
    if not moe:
        return 3 * m.dim * m.dense_inter_dim
    e = m.moe
    return (e.top_k + e.n_shared_experts) * 3 * m.dim * e.moe_inter_dim + m.dim * e.n_routed_experts


def training_flop_parts(m: ModelConfig, seq_len: int) -> FlopParts:
    """FLOPs of one trained token of a `seq_len` sequence, decoder layers and MTP depths included."""
    a, h = m.mla, m.n_heads
    dense_per_key = 2 * h * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim)
    sparse_per_key = 2 * h * (2 * a.kv_lora_rank + a.qk_rope_head_dim)
    all_keys = mean_visible_keys(seq_len, None)
    roles = dsa_schedule(m)
    proj = attn = idx_proj = idx_scores = 0.0
    for layer, role in enumerate(roles):
        moe = layer >= m.first_k_dense  # MTP depths (layer >= n_layers) are MoE blocks
        proj += 6 * (mla_matmul_params(m) + _ffn_active_params(m, moe))
        if role is None:
            attn += 3 * dense_per_key * all_keys
            continue
        d = m.dsa
        topk_keys = mean_visible_keys(seq_len, d.index_topk)
        attn += 3 * sparse_per_key * topk_keys
        if role != "source":
            continue
        scores = 2 * d.n_index_heads * (d.index_head_dim + 1) * all_keys
        target = 2 * h * (a.kv_lora_rank + a.qk_rope_head_dim)
        if d.indexer_mode == "frozen":
            idx_proj += 2 * indexer_matmul_params(m)
            idx_scores += scores
        elif d.indexer_mode == "kl_sparse":  # no-grad selection over all keys, trained scores at the top-k only
            idx_proj += 4 * indexer_matmul_params(m)
            idx_scores += scores + (3 * 2 * d.n_index_heads * (d.index_head_dim + 1) + target) * topk_keys
        else:
            idx_proj += 4 * indexer_matmul_params(m)
            idx_scores += 3 * scores + target * all_keys
    head = 6 * m.dim * m.vocab_size
    proj += head + m.mtp.depth * (6 * 2 * m.dim * m.dim + head)
    return FlopParts(projections=proj, attention=attn, indexer_projections=idx_proj, indexer_scores=idx_scores)


def training_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one trained token (the MFU numerator over tokens/s): `training_flop_parts(...).total`."""
    return training_flop_parts(m, seq_len).total


# ---- parameter shapes and shards ------------------------------------------------------------------
def _attention_shapes(m: ModelConfig, prefix: str, source: bool) -> dict[str, tuple[int, ...]]:
    a, h, d = m.mla, m.n_heads, m.dim
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    out: dict[str, tuple[int, ...]] = {}
    if a.q_lora_rank:
        out |= {f"{prefix}wq_a.weight": (a.q_lora_rank, d), f"{prefix}q_norm.weight": (a.q_lora_rank,),
                f"{prefix}wq_b.weight": (h * qk, a.q_lora_rank)}
    else:
        out[f"{prefix}wq.weight"] = (h * qk, d)
    out |= {f"{prefix}wkv_a.weight": (a.kv_lora_rank + a.qk_rope_head_dim, d),
            f"{prefix}kv_norm.weight": (a.kv_lora_rank,),
            f"{prefix}wkv_b.weight": (h * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
            f"{prefix}wo.weight": (d, h * a.v_head_dim)}
    if source:
        x = m.dsa
        out |= {f"{prefix}indexer.wq_b.weight": (x.n_index_heads * x.index_head_dim, a.q_lora_rank or d),
                f"{prefix}indexer.wk.weight": (x.index_head_dim, d),
                f"{prefix}indexer.k_norm.weight": (x.index_head_dim,),
                f"{prefix}indexer.k_norm.bias": (x.index_head_dim,),
                f"{prefix}indexer.weights_proj.weight": (x.n_index_heads, d)}
    return out


def _layer_shapes(m: ModelConfig, prefix: str, moe: bool, source: bool) -> dict[str, tuple[int, ...]]:
    d = m.dim
    out = {f"{prefix}attn_norm.weight": (d,), **_attention_shapes(m, f"{prefix}attn.", source),
           f"{prefix}ffn_norm.weight": (d,)}
    f = f"{prefix}ffn."
    if not moe:
        return out | {f"{f}w1.weight": (m.dense_inter_dim, d), f"{f}w3.weight": (m.dense_inter_dim, d),
                      f"{f}w2.weight": (d, m.dense_inter_dim)}
    e = m.moe
    out |= {f"{f}router.weight": (e.n_routed_experts, d), f"{f}experts.w1": (e.n_routed_experts, e.moe_inter_dim, d),
            f"{f}experts.w3": (e.n_routed_experts, e.moe_inter_dim, d),
            f"{f}experts.w2": (e.n_routed_experts, d, e.moe_inter_dim)}
    if e.n_shared_experts:
        si = e.n_shared_experts * e.moe_inter_dim
        out |= {f"{f}shared_experts.w1.weight": (si, d), f"{f}shared_experts.w3.weight": (si, d),
                f"{f}shared_experts.w2.weight": (d, si)}
    return out


def param_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Global shape of every parameter of the reference model, keyed as its named_parameters() on one
    rank (routed experts [n_routed_experts, out, in]); tested equal to the built model's."""
    roles = dsa_schedule(m)
    out: dict[str, tuple[int, ...]] = {"embed.weight": (m.vocab_size, m.dim)}
    for i in range(m.n_layers):
        out |= _layer_shapes(m, f"layers.{i}.", i >= m.first_k_dense, roles[i] == "source")
    out["norm.weight"] = (m.dim,)
    if not m.tie_embeddings:
        out["head.weight"] = (m.vocab_size, m.dim)
    for j in range((1 if m.mtp.share_weights else m.mtp.depth) if m.mtp.depth else 0):
        b = f"mtp.blocks.{j}."
        out |= {f"{b}hidden_norm.weight": (m.dim,), f"{b}embed_norm.weight": (m.dim,),
                f"{b}proj.weight": (m.dim, 2 * m.dim),
                **_layer_shapes(m, f"{b}layer.", True, roles[m.n_layers + j] == "source"),
                f"{b}final_norm.weight": (m.dim,)}
    return out


def is_routed_expert(fqn: str) -> bool:
    """The routed experts' stacked weights (sharded over ep, then expert_fsdp)."""
    return ".experts.w" in fqn and ".shared_experts." not in fqn


def _chunk(n: int, parts: int, index: int) -> int:
    """Size of torch.chunk(range(n), parts)[index] (0 past the last chunk): FSDP2's Shard(0) split."""
    size = -(-n // parts)
    return max(0, min(size, n - index * size))


def _index_in(dims: ParallelDims, name: str, rank: int) -> int:
    for group in dims.rank_groups(name):
        if rank in group:
            return sorted(group).index(rank)
    raise ValueError(f"rank {rank} is in no {name} group of {dims.describe()}")


def param_shards(m: ModelConfig, dims: ParallelDims, rank: int) -> dict[str, tuple[int, ...]]:
    """This rank's local shape of every parameter after parallelize (DTensor.to_local().shape): dense
    parameters Shard(0) over the fsdp x cp group, routed experts n_routed/ep per EP rank, then split over
    expert_fsdp on the dim parallelize.expert_shard_dim picks (torch.chunk sizes, unpadded: 0 past the
    last chunk)."""
    if not 0 <= rank < dims.world_size:
        raise ValueError(f"rank {rank} is not a rank of {dims.describe()}")
    dense_i, shard = _index_in(dims, "fsdp_cp", rank), dims.fsdp * dims.cp
    expert_i = _index_in(dims, "expert_fsdp", rank)
    out = {}
    for fqn, shape in param_shapes(m).items():
        if is_routed_expert(fqn):
            local = (shape[0] // dims.ep, *shape[1:])
            d = expert_shard_dim(local, dims.expert_fsdp)
            out[fqn] = tuple(_chunk(n, dims.expert_fsdp, expert_i) if i == d else n for i, n in enumerate(local))
        else:
            out[fqn] = (_chunk(shape[0], shard, dense_i), *shape[1:])
    return out


# ---- memory --------------------------------------------------------------------------------------
def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _optimizer_state_elements(m: ModelConfig, shards: dict[str, tuple[int, ...]], optimizer: str) -> int:
    """AdamW: exp_avg + exp_avg_sq per element. Muon (spartron.runtime.optim): one momentum for the 2-D
    weights that are not vocabulary-sized (embedding, head), AdamW's two for the rest (experts are 3-D)."""
    total = 0
    for fqn, shape in param_shapes(m).items():
        muon = optimizer == "muon" and len(shape) == 2 and m.vocab_size not in shape
        total += _numel(shards[fqn]) * (1 if muon else 2)
    return total


def state_bytes_per_rank(m: ModelConfig, dims: ParallelDims, optimizer: str, rank: int = 0) -> dict[str, int]:
    """Bytes on `rank` of the sharded parameters, their gradients and the optimizer state, all in the
    stored dtype (`model.master_dtype`, else `model.dtype`: torch's AdamW keeps its state in the
    parameter's dtype). Rank 0 holds the largest chunks."""
    shards = param_shards(m, dims, rank)
    width = PARAM_BYTES[m.stored_dtype]
    local = sum(_numel(s) for s in shards.values())
    out = {"parameters": local * width, "gradients": local * width,
           "optimizer_state": _optimizer_state_elements(m, shards, optimizer) * width}
    out["total"] = sum(out.values())
    return out


# ---- peak memory of a training step ----------------------------------------------------------------
@dataclass(frozen=True)
class StepShape:
    """What besides the model shapes a step's memory: the run config's train / ac / offload keys
    (spartron.launch.plan.plan_memory builds it from a RunConfig)."""

    seq_len: int
    micro_batch_size: int
    micro_steps: int = 1  # gradient-accumulation micro-batches per optimizer step
    optimizer: str = "adamw"
    ac_mode: str = "none"  # none | full | selective
    ac_freq: int = 1
    ac_targets: tuple[str, ...] | None = None  # None: the default targets
    offload: bool = False
    offload_keep_last: int = 1
    offload_prefetch_depth: int = 1
    keep_grad_buffers: bool = False
    device: str = "cuda"  # cpu: SDPA's math path keeps the [B, H, S, S] probabilities
    grad_sync: str = "last_micro_batch"  # train.grad_sync; "every_micro_batch": no unsharded grads accumulate


@dataclass(frozen=True)
class MemoryPlan:
    """Predicted bytes on one rank. `parts`: what is live at the predicted peak, by kind; `peak` their
    sum; `phase`: when it happens (forward end = inside the loss of the last micro-batch, backward =
    the last block's backward, optimizer = after backward with every gradient)."""

    parts: dict[str, int]
    phase: str
    phases: dict[str, int]  # the peak of each phase

    @property
    def peak(self) -> int:
        return sum(self.parts.values())

    def fits(self, device_bytes: int) -> bool:
        return self.peak <= device_bytes


_MATMUL_TARGETS = {"aten", "aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm", "aten::_addmm_activation",
                   "aten::baddbmm", "spartron::absorb_query", "spartron::absorb_output"}
_ATTENTION_TARGETS = {"aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
                      "aten::_scaled_dot_product_cudnn_attention", "aten::_flash_attention_forward",
                      "aten::_efficient_attention_forward", "aten::_scaled_dot_product_flash_attention_for_cpu",
                      "aten", "spartron", "spartron::sparse_mla"}


@dataclass(frozen=True)
class _Block:
    """Bytes per micro-batch of one decoder block: `saved` without AC, `kept` the outputs selective AC
    keeps (matmuls, attention), `work` the backward's temporaries beyond what is saved."""

    saved: int
    kept_matmul: int
    kept_attention: int
    work: int
    params: int  # elements (its FSDP unit: all-gathered in the compute dtype)


def _norm(tokens: int, width: int, a: int) -> int:
    """RMSNorm saves its input, the normalised input and the output (the next matmul's input), + rstd."""
    return tokens * (3 * width * a + 4)


def _attention_block(m: ModelConfig, tokens: int, step: StepShape, role, cp: int, a: int) -> tuple[int, int, int]:
    """(saved, kept by matmul targets, kept by attention targets) of one MLA layer's attention."""
    x, h = m.mla, m.n_heads
    qk, kv = x.qk_nope_head_dim + x.qk_rope_head_dim, x.kv_lora_rank + x.qk_rope_head_dim
    keys = tokens * cp  # CP gathers the compressed keys of the whole sequence
    saved = _norm(tokens, m.dim, a)
    mm = 0
    if x.q_lora_rank:
        saved += _norm(tokens, x.q_lora_rank, a)  # wq_a's output is q_norm's input
        mm += tokens * x.q_lora_rank * a
    mm += tokens * h * qk * a + tokens * kv * a  # wq (wq_b), wkv_a outputs
    saved += tokens * kv * a + tokens * x.kv_lora_rank * a + keys * kv * a  # wkv_a out, kv_norm, compressed (+rope)
    if role is None:  # dense SDPA: q, k (cat with the rope part), v (a view of wkv_b's output on CUDA)
        wkv_b = keys * h * (x.qk_nope_head_dim + x.v_head_dim) * a
        v = wkv_b if step.device == "cuda" else keys * h * x.v_head_dim * a
        scores = tokens * h * 4 if step.device == "cuda" else tokens * h * keys // step.micro_batch_size * a
        out = tokens * h * x.v_head_dim * a
        saved += tokens * h * qk * a + keys * h * qk * a + v + scores + out
        mm += wkv_b
        attn = out + tokens * h * 4
    else:  # absorbed sparse attention over the selected keys
        k = min(m.dsa.index_topk, keys)
        q_abs = tokens * h * kv * a
        out = tokens * h * x.kv_lora_rank * a
        ids = tokens * k * 4
        saved += q_abs + out + tokens * h * x.v_head_dim * a + ids + tokens * h * 4
        mm += q_abs + tokens * h * x.v_head_dim * a
        attn = out + tokens * h * 4
    saved += tokens * h * x.v_head_dim * a  # wo's input
    mm += tokens * m.dim * a  # wo's output
    return saved, mm, attn


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


def _blocks(m: ModelConfig, dims: ParallelDims, step: StepShape, a: int) -> list[_Block]:
    tokens = step.micro_batch_size * step.seq_len // dims.cp
    roles, shapes = dsa_schedule(m), param_shapes(m)
    blocks = []
    n_mtp = m.mtp.depth
    for i in range(m.n_layers + n_mtp):
        moe = i >= m.first_k_dense
        s_attn, mm_attn, attn = _attention_block(m, tokens, step, roles[i], dims.cp, a)
        s_ffn, mm_ffn, widest = _ffn_block(m, tokens, moe, a)
        saved, mm = s_attn + s_ffn, mm_attn + mm_ffn
        if i >= m.n_layers:  # MTP depth: its two norms, the embedding and the projection's input and output
            saved += 2 * _norm(tokens, m.dim, a) + tokens * m.dim * a * 4
            mm += tokens * m.dim * a
        prefix = f"layers.{i}." if i < m.n_layers else f"mtp.blocks.{0 if m.mtp.share_weights else i - m.n_layers}."
        local = {f: s for f, s in shapes.items() if f.startswith(prefix)}
        params = sum(_numel(s) // (dims.ep if is_routed_expert(f) else 1) for f, s in local.items())
        work = tokens * m.dim * a * 4 + 2 * widest * a
        blocks.append(_Block(saved, mm, attn, work, params))
    return blocks


def _loss(m: ModelConfig, tokens: int, a: int) -> tuple[int, int, int]:
    """(saved for backward, extra live at the forward's peak, extra live in its backward) of one LM loss."""
    v, c = m.vocab_size, m.loss_chunk_size
    norm = _norm(tokens, m.dim, a)
    if 0 < c < tokens:  # spartron.layers.loss: the gradients of each chunk at once, [N, V] never kept
        saved = norm + tokens * m.dim * a + v * m.dim * 4
        return saved, c * v * (12 + a) + v * m.dim * (4 + a), tokens * m.dim * a
    f32 = tokens * v * 4
    saved = norm + f32  # log_softmax's output
    return saved, f32 + tokens * v * a, 2 * f32 + tokens * v * a


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
    peak. Three phase peaks are compared: forward end, backward of the last block, optimizer step.
    """
    a = PARAM_BYTES[m.dtype]
    stored = PARAM_BYTES[m.stored_dtype]
    shapes = param_shapes(m)
    state = state_bytes_per_rank(m, dims, step.optimizer, rank)
    static = state["parameters"] + state["optimizer_state"]
    grads = state["gradients"]
    tokens = step.micro_batch_size * step.seq_len // dims.cp
    blocks = _blocks(m, dims, step, a)
    targets = set(step.ac_targets) if step.ac_targets is not None else _MATMUL_TARGETS | _ATTENTION_TARGETS
    keeps_mm, keeps_attn = bool(targets & _MATMUL_TARGETS), bool(targets & _ATTENTION_TARGETS)
    block_input = tokens * m.dim * a
    saved, recompute = [], []
    for i, b in enumerate(blocks):
        region = step.ac_mode != "none" and i % step.ac_freq == 0
        if not region:
            saved.append(b.saved)
            recompute.append(0)
            continue
        kept = block_input
        if step.ac_mode == "selective":
            kept += (b.kept_matmul if keeps_mm else 0) + (b.kept_attention if keeps_attn else 0)
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
    reduce = PARAM_BYTES[m.reduce_dtype]
    fsdp = dims.world_size > 1 or m.master_dtype is not None  # spartron.layers.parallelize
    head = m.vocab_size * m.dim
    # FSDP2: the block in use and the prefetched one all-gathered in the compute dtype, the root's
    # embedding + head for the whole forward, one block's gradients reduce-scattered in reduce_dtype.
    unsharded = 2 * biggest.params * a if fsdp else 0
    root = head * (1 if m.tie_embeddings else 2) * a if fsdp else 0
    reduction = biggest.params * (a + reduce) if fsdp else 0
    if fsdp and step.device == "cpu":  # gloo reduce-scatters through a second full-size buffer
        reduction += biggest.params * reduce
    grads_always = grads if (step.micro_steps > 1 or step.keep_grad_buffers) else 0
    if fsdp and step.micro_steps > 1 and not step.keep_grad_buffers and step.grad_sync == "last_micro_batch":
        # the trainer turns FSDP2's gradient sync off for all but the last micro-batch: until then every
        # block's UNSHARDED gradients accumulate (compute dtype); sharded ones appear only when reduced
        unsharded_params = sum(_numel(s) // (dims.ep if is_routed_expert(f) else 1) for f, s in shapes.items())
        grads_always = unsharded_params * a
    head_grad = 0 if grads_always else head * stored  # the first gradient backward makes
    last = blocks[-1]
    comm = comm_buffer_bytes(m, dims, tokens)
    static += comm
    phases = {
        "forward end": static + grads_always + acts + loss_fwd + root + unsharded // 2,
        "backward": static + grads_always + head_grad + acts - n_losses * loss_saved + loss_bwd + recompute[-1]
        + last.work + root + unsharded + reduction,
        "optimizer": static + grads + reduction,
    }
    phase = max(phases, key=phases.get)
    parts = {"parameters": state["parameters"], "optimizer_state": state["optimizer_state"],
             "communication_buffers": comm}
    if phase == "optimizer":
        parts |= {"gradients": grads, "gradient_reduction": phases[phase] - static - grads}
    else:
        parts |= {"gradients": grads_always, "activations": acts,
                  "unsharded_parameters": root + unsharded // (2 if phase == "forward end" else 1)}
        parts["working"] = phases[phase] - sum(parts.values())
    return MemoryPlan(parts=parts, phase=phase, phases=phases)
