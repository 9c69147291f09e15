"""Model configuration: the `[model]` section of the run config and its sub-sections.

Field names follow DeepSeek-V3 / V3.2 naming so presets read like the published configs.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from spartron.configbase import ConfigSection


class YarnConfig(ConfigSection):
    """YaRN rope scaling (DeepSeek-V3 style)."""

    factor: float = Field(40.0, ge=1)  # how much longer than original_max_position_embeddings
    original_max_position_embeddings: int = Field(4096, ge=1)
    beta_fast: float = Field(32.0, gt=0)
    beta_slow: float = Field(1.0, gt=0)
    mscale: float = Field(1.0, gt=0)
    mscale_all_dim: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> YarnConfig:
        if self.beta_fast <= self.beta_slow:  # the ramp between them would run backwards
            raise ValueError(f"model.mla.yarn.beta_fast {self.beta_fast} must be above model.mla.yarn.beta_slow "
                             f"{self.beta_slow}")
        return self


class MLAConfig(ConfigSection):
    """Multi-head latent attention shapes. q_lora_rank 0 means the query is not compressed."""

    q_lora_rank: int = Field(0, ge=0)
    kv_lora_rank: int = Field(512, ge=1)
    qk_nope_head_dim: int = Field(128, ge=1)
    qk_rope_head_dim: int = Field(64, ge=2)
    v_head_dim: int = Field(128, ge=1)
    rope_theta: float = Field(10000.0, gt=1)  # a base <= 1 gives no rotation or a growing one
    yarn: YarnConfig | None = None

    @model_validator(mode="after")
    def _rope_even(self) -> MLAConfig:
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"model.mla.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        return self


class DSAConfig(ConfigSection):
    """DeepSeek sparse attention: lightning indexer + top-k sparse MLA.

    `layers`: which decoder layers use DSA ("moe" = every MoE layer, "all", or explicit indices).
    `topk_freq`: ids are computed by one source layer and reused by the next topk_freq-1 DSA layers.
    `indexer_mode`: frozen (no grad, computed once per step, reused on replay), or trained with the
    KL loss against the main attention distribution, dense or over the top-k only.
    `indexer_fp8`: the `indexer_topk` selection (frozen, kl_sparse) scores float8 e4m3 operands (per-row
    scales; Hopper's fp8 MMA); kl_dense selects from its differentiable scores instead.
    `deterministic_dkv`: the sparse-attention backward (and kl_sparse's indexer key gradient) adds key
    gradients in 64-bit fixed point, so they are bitwise reproducible
    (spartron/layers/attention/sparse_mla_triton.py: its range and cost).
    `kl_dense_chunk`: query rows per chunk of kl_dense's / a dense warm-up's KL over all keys (peak temporaries
    about B x chunk x S_kv x (3 x heads + 4 x index heads) float32); 0 derives it from a 1 GiB budget
    (spartron/layers/attention/indexer_kl_dense.py).
    `attention_chunk`: query rows per chunk of the sparse layers' absorbed attention (0: unchunked). Chunked,
    nothing [S, heads, 576]-wide outlives a chunk and selective AC keeps [S, heads x v_head_dim] per layer as for
    dense attention; the backward recomputes the sparse forward (spartron/layers/attention/sparse_mla_absorbed.py).
    """

    n_index_heads: int = Field(32, ge=1)
    index_head_dim: int = Field(128, ge=2)
    index_topk: int = Field(2048, ge=1)
    topk_freq: int = Field(1, ge=1)
    layers: Literal["moe", "all"] | list[int] = "moe"
    indexer_mode: Literal["frozen", "kl_dense", "kl_sparse"] = "frozen"
    indexer_loss_coeff: float = Field(0.0, ge=0.0)
    share_indexer_across_mtp: bool = True
    indexer_fp8: bool = False
    deterministic_dkv: bool = False
    kl_dense_chunk: int = Field(0, ge=0)
    attention_chunk: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _loss_needs_training(self) -> DSAConfig:
        if self.indexer_fp8 and self.indexer_mode == "kl_dense":
            raise ValueError("model.dsa.indexer_fp8 applies to the indexer_topk selection (frozen, kl_sparse); "
                             "indexer_mode 'kl_dense' selects from its differentiable scores")
        if self.indexer_mode == "frozen" and self.indexer_loss_coeff > 0:
            raise ValueError("model.dsa.indexer_loss_coeff > 0 needs indexer_mode kl_dense or kl_sparse, "
                             "a frozen indexer has no loss")
        if self.indexer_mode != "frozen" and self.indexer_loss_coeff == 0:
            raise ValueError(f"model.dsa.indexer_mode {self.indexer_mode!r} trains the indexer: set "
                             "model.dsa.indexer_loss_coeff > 0")
        return self


class MoEConfig(ConfigSection):
    n_routed_experts: int = Field(64, ge=1)
    n_shared_experts: int = Field(2, ge=0)
    top_k: int = Field(6, ge=1)
    moe_inter_dim: int = Field(1408, ge=1)
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    n_groups: int = Field(1, ge=1)
    topk_groups: int = Field(1, ge=1)
    route_scale: float = Field(1.0, gt=0)
    norm_topk_prob: bool = True
    router_fp32: bool = True
    bias_update_rate: float = Field(1e-3, ge=0.0)
    aux_loss_coeff: float = Field(0.0, ge=0.0)
    aux_loss_type: Literal["seq", "batch"] = "seq"
    dispatcher: Literal["local", "all_to_all", "deepep"] = "all_to_all"
    # how "all_to_all" moves tokens: NCCL kernels, or the copy engines over symmetric memory (one host;
    # leaves the SMs to the compute it overlaps with: spartron/comm/copy_engine.py)
    all_to_all_transport: Literal["nccl", "copy_engine"] = "nccl"
    # how the copy-engine exchange orders the ranks: "barrier" (a spinning kernel, measured) or
    # "stream_wait" (epoch signals and a stream-side wait, no kernel: spartron/comm/copy_engine.py)
    copy_engine_sync: Literal["barrier", "stream_wait"] = "barrier"
    deepep_num_sms: int = Field(24, ge=2)
    grouped_mm: Literal["auto", "grouped", "loop"] = "auto"

    @model_validator(mode="after")
    def _check(self) -> MoEConfig:
        if self.all_to_all_transport != "nccl" and self.dispatcher != "all_to_all":
            raise ValueError(f"model.moe.all_to_all_transport = {self.all_to_all_transport!r} applies to "
                             f"model.moe.dispatcher = 'all_to_all', not {self.dispatcher!r}")
        if self.copy_engine_sync != "barrier" and self.all_to_all_transport != "copy_engine":
            raise ValueError(f"model.moe.copy_engine_sync = {self.copy_engine_sync!r} applies to "
                             f"model.moe.all_to_all_transport = 'copy_engine', not {self.all_to_all_transport!r}")
        if self.top_k > self.n_routed_experts:
            raise ValueError(f"model.moe.top_k {self.top_k} must be <= model.moe.n_routed_experts "
                             f"{self.n_routed_experts}")
        if self.n_routed_experts % self.n_groups:
            raise ValueError(f"model.moe.n_groups {self.n_groups} must divide n_routed_experts "
                             f"{self.n_routed_experts}")
        if self.topk_groups > self.n_groups:
            raise ValueError(f"model.moe.topk_groups {self.topk_groups} must be <= n_groups {self.n_groups}")
        if self.n_groups > 1 and self.top_k > self.topk_groups * (self.n_routed_experts // self.n_groups):
            raise ValueError("model.moe.top_k exceeds the experts in the selected groups "
                             f"(topk_groups {self.topk_groups} x {self.n_routed_experts // self.n_groups})")
        return self


class MTPConfig(ConfigSection):
    depth: int = Field(0, ge=0)
    share_weights: bool = False
    loss_scale: float = Field(0.3, ge=0.0)


class FP8Config(ConfigSection):
    """FP8 training, DeepSeek-V3's blockwise recipe (Megatron's `--fp8-recipe blockwise`): E4M3 with
    1x128 activation / gradient tiles and 128x128 weight blocks, fp32 scales, for the forward, dgrad and
    wgrad GEMMs of the chosen modules; everything else (attention, router, head, norms) stays in
    model.dtype. `modules`: "experts" (the routed experts' grouped GEMMs), "dense" (every other
    nn.Linear of the blocks with both dims multiples of 128: MLA projections, dense FFNs, shared
    experts). `backend`: "triton" (Spartron's kernels, Hopper), "torch_scaled_mm" (cuBLAS's blockwise
    scaled_mm, sm90, for the dense linears and the experts' wgrad, one GEMM per local expert; the experts'
    fprop and dgrad on the Triton kernels), "deep_gemm" (fprop and dgrad of the experts and of the dense
    linears on DeepGEMM's grouped FP8 GEMM, an optional extra, sm90; the FP8 wgrad on the Triton kernel),
    "reference" (dequantise + fp32 matmul: the exact numerics on any device, slow). `wgrad`: the weight-gradient
    GEMMs in "fp8" (the recipe: grad^T and x^T on 128x1 tiles) or in "model_dtype" (Megatron's fp8_wgrad = False:
    the unquantised layers' wgrad GEMM on the bf16 tensors the ops keep anyway; no column quantisation, nothing
    more kept for backward). `power_of_two_scales`:
    scales rounded up to a power of two (exact rescaling; TransformerEngine's default for this recipe).
    `weight_cache`: the routed experts' weights quantised once per optimizer step instead of at every GEMM call
    (spartron.layers.fp8.weight_cache; 2 bytes a local expert weight element more); "auto": on where
    every rank holds its experts whole (expert_fsdp = 1) and the blocks are not compiled. `dispatch`: the
    MoE all-to-all sends the routed rows as E4M3 with their 1x128 scales (spartron.layers.fp8.wire: 0.52x
    the bf16 bytes at dim 7168), as DeepSeek-V3 dispatches; the gradients go back in model.dtype. Needs
    "experts", power-of-two scales (the experts' own quantisation of the received rows then gives the sent
    FP8 values back exactly) and more than one EP rank; every dispatcher that moves rows sends them so (the
    all-to-all over NCCL or the copy engines, DeepEP through its own FP8 dispatch).
    `layers_at_start_in_bf16` / `layers_at_end_in_bf16`: that many of the first / last decoder layers keep every
    GEMM in model.dtype (Megatron's first_last_layers_bf16 with num_layers_at_start/end_in_bf16, for stability
    where the activations are least regular); the MTP modules run FP8 as Megatron's do. `param_gather` (Megatron's
    --fp8-param-gather): under FSDP2 each FP8-run weight is quantised once per optimizer step on its shard (the
    full weight's 128x128 block scales from one all-gather of the shards' local amax) and all-gathered as E4M3, 1
    byte an element instead of bf16's 2, its blocks and transposed blocks then read from the gathered values
    (spartron.layers.fp8.param_gather); numerics bitwise those without it. Needs FSDP2 sharding over more than one
    rank and eager blocks; the experts of a 1-rank expert_fsdp group keep the weight cache instead. See docs/FP8.md."""

    recipe: Literal["blockwise"] = "blockwise"
    backend: Literal["triton", "torch_scaled_mm", "deep_gemm", "reference"] = "triton"
    modules: list[Literal["experts", "dense"]] = Field(default_factory=lambda: ["experts", "dense"])
    wgrad: Literal["fp8", "model_dtype"] = "fp8"
    power_of_two_scales: bool = True
    weight_cache: Literal["auto", "on", "off"] = "auto"
    dispatch: bool = False
    param_gather: bool = False
    layers_at_start_in_bf16: int = Field(0, ge=0)
    layers_at_end_in_bf16: int = Field(0, ge=0)

    def runs_fp8(self, layer: int, n_layers: int) -> bool:
        """Whether decoder layer `layer` (0-based, of `n_layers`; MTP modules are not decoder layers here) runs
        its chosen modules in FP8: every layer but the first / last kept in bf16."""
        return self.layers_at_start_in_bf16 <= layer < n_layers - self.layers_at_end_in_bf16

    @model_validator(mode="after")
    def _check(self) -> FP8Config:
        if not self.modules:
            raise ValueError("model.fp8.modules is empty: list 'experts' and/or 'dense', or remove [model.fp8]")
        if len(set(self.modules)) != len(self.modules):
            raise ValueError(f"model.fp8.modules has duplicates: {self.modules}")
        if self.dispatch and "experts" not in self.modules:
            raise ValueError("model.fp8.dispatch = true sends the routed experts' FP8 input: it needs 'experts' in "
                             f"model.fp8.modules, got {self.modules}")
        if self.param_gather and self.weight_cache == "on":
            raise ValueError("model.fp8.param_gather = true with model.fp8.weight_cache = 'on': the gathered FP8 "
                             "weights replace the cache; use weight_cache 'auto' (on only for experts whole on each "
                             "rank)")
        if self.dispatch and not self.power_of_two_scales:
            raise ValueError("model.fp8.dispatch = true needs model.fp8.power_of_two_scales = true (only then do the "
                             "received rows, dequantised to model.dtype, quantise back to the same FP8 values)")
        return self


class ModelConfig(ConfigSection):
    vocab_size: int = Field(1024, ge=2)
    dim: int = Field(64, ge=1)
    n_layers: int = Field(4, ge=1)
    n_heads: int = Field(4, ge=1)
    first_k_dense: int = Field(1, ge=0)
    dense_inter_dim: int = Field(128, ge=1)
    norm_eps: float = Field(1e-6, gt=0, lt=1)  # an eps near the variance itself flattens every norm
    max_seq_len: int = Field(4096, ge=1)
    tie_embeddings: bool = False
    # Precision (spartron.layers.parallelize applies it): `dtype` is the COMPUTE dtype, what forward and
    # backward run in and what FSDP all-gathers; `master_dtype` is the dtype of the sharded parameters the
    # optimizer updates, of their gradients and of the optimizer state (None: `dtype`, the bf16-only mode);
    # `reduce_dtype` is the dtype gradients are reduce-scattered in.
    dtype: Literal["float32", "bfloat16"] = "float32"
    master_dtype: Literal["float32", "bfloat16"] | None = None
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    # Who holds the fp32 masters (model.master_dtype = "float32"): "fsdp", FSDP2's sharded parameters cast to
    # `dtype` per step (any layout); "optimizer", bf16 parameters with fp32 masters, main gradients and AdamW
    # state in the optimizer, which writes the bf16 weight as it updates the master (one rank; see
    # spartron.runtime.master_weights). "fsdp" is the default because it runs at every world size; on one
    # rank "optimizer" is the fast one (dsv3-12l compiled on an H200: 1.53-1.81x torchtitan, "fsdp" 1.07x).
    master_weights: Literal["fsdp", "optimizer"] = "fsdp"
    init_std: float = Field(0.02, gt=0, le=1)  # 0 starts every expert and head identical; > 1 diverges
    loss_chunk_size: int = Field(0, ge=0)  # 0: plain cross-entropy; N: chunks of N tokens
    mla: MLAConfig = Field(default_factory=MLAConfig)
    moe: MoEConfig = Field(default_factory=MoEConfig)
    dsa: DSAConfig | None = None
    mtp: MTPConfig = Field(default_factory=MTPConfig)
    fp8: FP8Config | None = None  # FP8 GEMMs (blockwise recipe) for the chosen modules; None: model.dtype

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.first_k_dense > self.n_layers:
            raise ValueError(f"model.first_k_dense {self.first_k_dense} must be <= model.n_layers {self.n_layers}")
        if self.dsa is not None and isinstance(self.dsa.layers, list):
            bad = [i for i in self.dsa.layers if not 0 <= i < self.n_layers]
            if bad:
                raise ValueError(f"model.dsa.layers has indices outside 0..{self.n_layers - 1}: {bad}")
        check_dsa(self)
        self._check_precision()
        self._check_fp8()
        return self

    def _check_fp8(self) -> None:
        if self.fp8 is None:
            return
        bf16_layers = self.fp8.layers_at_start_in_bf16 + self.fp8.layers_at_end_in_bf16
        if bf16_layers >= self.n_layers:
            raise ValueError(f"model.fp8.layers_at_start_in_bf16 + layers_at_end_in_bf16 = {bf16_layers} keeps every "
                             f"decoder layer (model.n_layers {self.n_layers}) in bf16: lower them, or remove "
                             "[model.fp8]")
        first, end = self.fp8.layers_at_start_in_bf16, self.n_layers - self.fp8.layers_at_end_in_bf16
        if "dense" not in self.fp8.modules and self.mtp.depth == 0 and end <= self.first_k_dense:
            raise ValueError(f"model.fp8.modules = ['experts'] converts nothing: the decoder layers that run FP8 "
                             f"({first}..{end - 1}, model.fp8.layers_at_start_in_bf16 / layers_at_end_in_bf16) are all "
                             f"dense (model.first_k_dense {self.first_k_dense})")
        if self.dtype != "bfloat16":
            raise ValueError(f"model.fp8 needs model.dtype = 'bfloat16' (the compute dtype outside the FP8 GEMMs), "
                             f"got {self.dtype!r}")
        if "experts" in self.fp8.modules:
            for key, size in (("model.dim", self.dim), ("model.moe.moe_inter_dim", self.moe.moe_inter_dim)):
                if size % 128:
                    raise ValueError(f"model.fp8.modules 'experts' quantises 128-wide tiles: {key} {size} is not "
                                     "a multiple of 128")

    def runs_fp8(self, layer: int | None) -> bool:
        """Whether model.fp8 converts the chosen modules of decoder layer `layer` (None: an MTP module, FP8 as in
        Megatron)."""
        return self.fp8 is not None and (layer is None or self.fp8.runs_fp8(layer, self.n_layers))

    @property
    def stored_dtype(self) -> str:
        """The dtype parameters are stored and updated in: master_dtype, else dtype."""
        return self.master_dtype or self.dtype

    def _check_precision(self) -> None:
        if self.master_dtype == self.dtype:
            raise ValueError(f"model.master_dtype = {self.master_dtype!r} equals model.dtype: leave it unset "
                             "(parameters are then stored in model.dtype)")
        if self.master_dtype == "bfloat16":
            raise ValueError("model.master_dtype = 'bfloat16' with model.dtype = 'float32' keeps masters less "
                             "precise than the compute: set model.dtype = 'bfloat16' and leave model.master_dtype "
                             "unset (bf16-only), or model.master_dtype = 'float32' with model.dtype = 'bfloat16'")
        if self.master_weights == "optimizer" and self.master_dtype != "float32":
            raise ValueError("model.master_weights = 'optimizer' keeps fp32 masters in the optimizer: it needs "
                             "model.master_dtype = 'float32' (with model.dtype = 'bfloat16')")
        if self.reduce_dtype == "bfloat16" and self.stored_dtype == "float32":
            raise ValueError("model.reduce_dtype = 'bfloat16' with float32 gradients (model.master_dtype or "
                             "model.dtype 'float32') rounds every gradient to bf16 before an fp32 update: "
                             "use model.reduce_dtype = 'float32'")


def master_layout_refusal(master_weights: str, world: int) -> str | None:
    """Why model.master_weights = "optimizer" cannot run on `world` ranks (None: it can). One rank only: its
    parameters are not sharded, and under FSDP2 the gradients would come back in the parameters' bf16 dtype
    after an fp32 reduce-scatter. The launch (spartron.runtime.master_weights) and the memory plan ask here."""
    if master_weights == "optimizer" and world > 1:
        return (f"model.master_weights = 'optimizer' runs on one rank (its parameters are not sharded); this "
                f"layout has {world} ranks: set model.master_weights = 'fsdp'")
    return None


def master_optimizer_refusal(master_weights: str, optimizer: str) -> str | None:
    """Why model.master_weights = "optimizer" cannot run with train.optimizer `optimizer` (None: it can): the fp32
    masters are AdamW's state. The run config and the optimizer's builder ask here."""
    if master_weights == "optimizer" and optimizer != "adamw":
        return (f"model.master_weights = 'optimizer' is AdamW over fp32 masters; train.optimizer = {optimizer!r} "
                "keeps its own state: set model.master_weights = 'fsdp'")
    return None


def dsa_layers(cfg: ModelConfig) -> list[int]:
    """The decoder layers that run DSA (MTP depths aside), in order."""
    layers = cfg.dsa.layers
    if layers == "all":
        return list(range(cfg.n_layers))
    if layers == "moe":
        return list(range(cfg.first_k_dense, cfg.n_layers))
    return sorted(layers)


def check_dsa(cfg: ModelConfig) -> None:
    """THE rule for DSA settings that cannot work together (ModelConfig validation and the DSA layers
    both use it); raises ValueError naming the dotted keys."""
    dsa = cfg.dsa
    if dsa is None:
        return
    if dsa.index_head_dim < cfg.mla.qk_rope_head_dim:
        raise ValueError(f"model.dsa.index_head_dim {dsa.index_head_dim} must be >= "
                         f"model.mla.qk_rope_head_dim {cfg.mla.qk_rope_head_dim}: "
                         "the indexer rotates its first qk_rope_head_dim dims")
    if isinstance(dsa.layers, list) and len(set(dsa.layers)) != len(dsa.layers):
        raise ValueError(f"model.dsa.layers has duplicate indices: {dsa.layers}")
    if not dsa_layers(cfg):
        raise ValueError(f"model.dsa.layers = {dsa.layers!r} selects no layer (model.first_k_dense "
                         f"{cfg.first_k_dense}, model.n_layers {cfg.n_layers}); "
                         "remove [model.dsa] for dense attention")
