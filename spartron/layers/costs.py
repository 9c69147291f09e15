"""THE cost model of the reference model (spartron.layers.model): parameters, training FLOPs, state memory.

One place, read from the ModelConfig shapes the layers build, so `spartron plan` (parameters and
memory), the trainer's MFU and the benchmarks agree. Tested against the built model's numel and
against torch's FlopCounterMode over a forward + backward (tests/layers/test_costs.py).
The peak memory of a whole training step builds on it: spartron.layers.step_memory.

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


def decoder_layer(fqn: str) -> int | None:
    """The main decoder stack's layer index of a parameter name (param_shapes' keys), None outside it (MTP, the
    embedding and the head)."""
    head, _, rest = fqn.partition(".")
    index = rest.partition(".")[0]
    return int(index) if head == "layers" and index.isdigit() else None


def is_routed_expert(fqn: str) -> bool:
    """The routed experts' stacked weights (sharded over ep, then expert_fsdp)."""
    return ".experts.w" in fqn and ".shared_experts." not in fqn


def fp8_gemm_weight(m: ModelConfig, fqn: str, shape: tuple[int, ...]) -> str | None:
    """"experts" or "dense" where model.fp8 runs parameter `fqn` (param_shapes' name and shape) as an FP8 GEMM's
    weight, the rule spartron.layers.fp8.apply converts by: in a decoder layer that runs FP8 or an MTP module's
    layer, a routed expert weight with "experts" in model.fp8.modules, or with "dense" a 2-D weight outside the
    router whose dims are multiples of 128 (the bias-free linears); None where the run keeps it in bf16."""
    f8 = m.fp8
    layer = decoder_layer(fqn)
    in_block = layer is not None or (fqn.startswith("mtp.") and ".layer." in fqn)
    if f8 is None or not in_block or not m.runs_fp8(layer):
        return None
    if is_routed_expert(fqn):
        return "experts" if "experts" in f8.modules else None
    if ("dense" in f8.modules and len(shape) == 2 and shape[0] % 128 == 0 and shape[1] % 128 == 0
            and ".router." not in fqn):
        return "dense"
    return None


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


def muon_takes(shape: tuple[int, ...], vocab_size: int) -> bool:
    """Muon's rule (spartron.runtime.muon), here for the optimizer and the memory model alike: 2-D weights and
    3-D routed-expert stacks [experts, out, in] whose matrix dims are not the vocabulary size (embedding, head)."""
    return len(shape) in (2, 3) and vocab_size not in tuple(shape)[-2:]


def optimizer_state_elements(m: ModelConfig, shards: dict[str, tuple[int, ...]], optimizer: str) -> int:
    """AdamW: exp_avg + exp_avg_sq per element. Muon: one momentum for what `muon_takes`, AdamW's two for the rest."""
    total, shapes = 0, param_shapes(m)
    for fqn, shard in shards.items():  # every parameter's, or (a training stage's) those that train
        muon = optimizer == "muon" and muon_takes(shapes[fqn], m.vocab_size)
        total += _numel(shard) * (1 if muon else 2)
    return total


def optimizer_state_bytes(m: ModelConfig, shards: dict[str, tuple[int, ...]], optimizer: str,
                          moments_dtype: str | None = None) -> int:
    """The optimizer state of `shards` in bytes: its elements in `moments_dtype` (train.adamw_moments_dtype), else
    in the stored dtype (torch's AdamW keeps its state in the parameter's dtype)."""
    return optimizer_state_elements(m, shards, optimizer) * PARAM_BYTES[moments_dtype or m.stored_dtype]


def receives_gradient(m: ModelConfig, fqn: str) -> bool:
    """Whether parameter `fqn` gets a gradient, hence an optimizer state: not the DSA indexer's under
    model.dsa.indexer_mode = "frozen", which selects under no_grad (LightningIndexer.select_frozen), so its
    parameters keep grad None and AdamW / Muon create no state for them."""
    return not (m.dsa is not None and m.dsa.indexer_mode == "frozen" and ".indexer." in fqn)


def optimizer_masters(m: ModelConfig) -> bool:
    """fp32 masters held by the optimizer beside compute-dtype parameters (spartron.runtime.master_weights)."""
    return m.master_dtype is not None and m.master_weights == "optimizer"


def model_parameter_bytes(m: ModelConfig, dims: ParallelDims, rank: int = 0) -> int:
    """Bytes of the model's own parameter shards on `rank`: in model.dtype under model.master_weights =
    "optimizer" (the fp32 masters sit in the optimizer, not in the model), else in the stored dtype. What a
    built rank's `model.parameters()` hold, which the rehearsal compares (state_bytes_per_rank's "parameters"
    adds the optimizer-held masters)."""
    width = PARAM_BYTES[m.dtype] if optimizer_masters(m) else PARAM_BYTES[m.stored_dtype]
    return width * sum(_numel(s) for s in param_shards(m, dims, rank).values())


def state_bytes_per_rank(m: ModelConfig, dims: ParallelDims, optimizer: str, rank: int = 0,
                         moments_dtype: str | None = None) -> dict[str, int]:
    """Bytes on `rank` of the sharded parameters, their gradients and the optimizer state, all in the
    stored dtype (`model.master_dtype`, else `model.dtype`: torch's AdamW keeps its state in the
    parameter's dtype), AdamW's moments in `moments_dtype` where set (train.adamw_moments_dtype). Rank 0 holds
    the largest chunks. Under model.master_weights = "optimizer" the
    parameters are the compute-dtype weights plus their fp32 masters, and the gradients the fp32 main
    gradients (one micro-batch keeps autograd's compute-dtype ones instead: step_memory.memory_plan). Gradients
    and optimizer state are those of the parameters that get a gradient (receives_gradient)."""
    shards = param_shards(m, dims, rank)
    width = PARAM_BYTES[m.stored_dtype]
    local = sum(_numel(s) for s in shards.values())
    masters = local * width if optimizer_masters(m) else 0
    trained = {f: s for f, s in shards.items() if receives_gradient(m, f)}
    out = {"parameters": model_parameter_bytes(m, dims, rank) + masters,
           "gradients": sum(_numel(s) for s in trained.values()) * width,
           "optimizer_state": optimizer_state_bytes(m, trained, optimizer, moments_dtype)}
    out["total"] = sum(out.values())
    return out
