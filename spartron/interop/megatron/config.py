"""Megatron-core TransformerConfig <-> Spartron ModelConfig, and the settings the adapters cannot honour.

Every field of megatron-core 0.16's MLATransformerConfig is in exactly one table below:
- MAPPED: translated into ModelConfig (some values cannot be translated: that is a problem too);
- REQUIRED: the adapters implement one behaviour, so the field must hold one of the listed values
  (Megatron's own default is not always among them, e.g. attention_dropout 0.1);
- MEGATRON_OWNED: applied by Megatron around the adapters (embedding, residual dropout, pipeline
  plumbing, optimizer hooks, initialisation of Megatron-owned weights) or without numerical effect
  at tp = pp = 1; the adapters never read them, except calculate_per_token_loss, which the MoE adapter
  reads as Megatron's router does (the weight of the aux loss's gradient: aux_loss.attach_and_track).
A field in no table (a newer megatron-core) is a problem unless it still has its dataclass default.
`check_megatron_config` collects EVERY problem and raises one MegatronConfigError listing them all.

Spartron-only settings (vocab_size, max_seq_len, tie_embeddings, loss_chunk_size, dsa.layers,
dsa.topk_freq, dsa.share_indexer_across_mtp, dsa.indexer_fp8, dsa.deterministic_dkv, dsa.kl_dense_chunk,
dsa.attention_chunk, moe.aux_loss_type when there is no aux loss, the dispatcher's "local" vs "all_to_all"
choice, grouped_mm "auto" vs "grouped", moe.deepep_num_sms without DeepEP, model.fp8's backend, modules,
power_of_two_scales, weight_cache, dispatch and param_gather) have no Megatron field: they come from `base` (or
ModelConfig's defaults; the adapters refuse param_gather = true: Megatron's DDP gathers no parameters).

FP8: Megatron's `fp8 = "e4m3"` with `fp8_recipe = "blockwise"` (DeepSeek-V3's recipe, as Megatron runs it through
Transformer Engine) is model.fp8, its `fp8_wgrad` model.fp8.wgrad ("fp8" or "model_dtype"), its
`first_last_layers_bf16` with `num_layers_at_start_in_bf16` / `num_layers_at_end_in_bf16`
model.fp8.layers_at_start_in_bf16 / layers_at_end_in_bf16 (0 without first_last_layers_bf16); every other FP8
recipe, format or Transformer Engine FP8 feature is a problem naming its field.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from spartron.layers.config import ModelConfig

if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig


class MegatronConfigError(ValueError):
    """The Megatron config asks for something the Spartron adapters cannot do (lists every setting)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("the Spartron megatron adapters cannot honour these Megatron settings:\n  - "
                         + "\n  - ".join(problems))


MAPPED = frozenset({
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "layernorm_epsilon",
    "init_method_std", "params_dtype", "bf16", "multi_latent_attention",
    "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
    "rotary_base", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast",
    "beta_slow", "mscale", "mscale_all_dim",
    "num_moe_experts", "moe_layer_freq", "moe_router_topk", "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size", "moe_router_score_function", "moe_router_pre_softmax",
    "moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor",
    "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_aux_loss_coeff",
    "moe_router_load_balancing_type", "moe_router_dtype", "moe_token_dispatcher_type",
    "moe_enable_deepep", "moe_flex_dispatcher_backend", "moe_deepep_num_sms", "moe_grouped_gemm",
    "experimental_attention_variant", "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk",
    "dsa_indexer_loss_coeff", "dsa_indexer_use_sparse_loss", "fp8", "fp8_recipe", "fp8_wgrad",
    "first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
})

# field -> (allowed values, why). Values compare with ==.
REQUIRED: dict[str, tuple[tuple[Any, ...], str]] = {
    "tensor_model_parallel_size": ((1,), "Spartron layers are not tensor-parallel"),
    "pipeline_model_parallel_size": ((1,), "DSA ids and the SideChannel do not cross pipeline stages"),
    "virtual_pipeline_model_parallel_size": ((None,), "no pipeline parallelism"),
    "sequence_parallel": ((False,), "needs tensor parallelism"),
    "expert_tensor_parallel_size": ((None, 1), "experts are not tensor-parallel"),
    "moe_extended_tp": ((False,), "experts are not tensor-parallel"),
    "hierarchical_context_parallel_sizes": ((None,), "CP all-gathers the compressed KV in one group"),
    "hybrid_context_parallel": ((False,), "CP all-gathers the compressed KV in one group"),
    "max_seqlen_per_dp_cp_rank": ((None,), "no dynamic CP"),
    "cp_comm_type": ((None, "allgather"), "Spartron CP all-gathers the compressed KV"),
    "fp16": ((False,), "Spartron layers run in float32 or bfloat16"),
    "fp8_param": ((False,), "Spartron keeps the weights in model.dtype and quantises them for the GEMMs "
                   "(model.fp8.weight_cache keeps the experts' between micro-batches)"),
    "fp8_quantizer_factory": ((None,), "the 'custom' recipe; Spartron runs 'blockwise'"),
    "fp8_margin": ((0,), "delayed scaling's; the blockwise recipe scales each tile by its own amax"),
    "fp8_amax_history_len": ((1,), "delayed scaling's; the blockwise recipe scales each tile by its own amax"),
    "fp8_amax_compute_algo": (("most_recent",), "delayed scaling's; the blockwise recipe scales each tile by its "
                              "own amax"),
    "fp8_dot_product_attention": ((False,), "attention's core stays in model.dtype (the blockwise recipe's)"),
    "fp8_multi_head_attention": ((False,), "attention's core stays in model.dtype (the blockwise recipe's)"),
    "activation_func_fp8_input_store": ((False,), "the FP8 experts keep the SwiGLU input in model.dtype and "
                                        "recompute the product in backward"),
    "fp4": ((None,), "no FP4 in Spartron layers"), "fp4_param": ((False,), "no FP4"),
    "use_kitchen": ((False,), "no kitchen quantisation"), "use_kitchen_attention": ((False,), "no kitchen"),
    "quant_recipe": ((None,), "no quantisation"),
    "attention_dropout": ((0.0,), "Spartron attention has no dropout"),
    "add_bias_linear": ((False,), "Spartron linears have no bias"),
    "add_qkv_bias": ((False,), "Spartron linears have no bias"),
    "gated_linear_unit": ((True,), "Spartron FFNs and experts are SwiGLU"),
    "activation_func": ((F.silu,), "Spartron FFNs and experts are SwiGLU (silu)"),
    "glu_linear_offset": ((0.0,), "plain SwiGLU"), "activation_func_clamp_value": ((None,), "plain SwiGLU"),
    "use_te_activation_func": ((False,), "plain SwiGLU"),
    "normalization": (("RMSNorm",), "Spartron norms are RMSNorm"),
    "layernorm_zero_centered_gamma": ((False,), "plain RMSNorm weight"),
    "memory_efficient_layer_norm": ((False,), "torch RMSNorm"),
    "persist_layer_norm": ((False,), "torch RMSNorm"),
    "qk_layernorm": ((True,), "Spartron MLA always RMS-normalises the q and kv latents"),
    "qk_l2_norm": ((False,), "not in Spartron MLA"), "qk_clip": ((False,), "not in Spartron MLA"),
    "log_max_attention_logit": ((False,), "not in Spartron MLA"),
    "attention_output_gate": ((False,), "not in Spartron MLA"),
    "softmax_scale": ((None,), "Spartron MLA derives the scale (with YaRN mscale)"),
    "softmax_type": (("vanilla",), "plain softmax attention"),
    "window_size": ((None,), "causal attention over the whole sequence"),
    "window_attn_skip_freq": ((None,), "no sliding windows"),
    "no_rope_freq": ((None,), "every MLA layer applies RoPE"),
    "rotary_interleaved": ((False,), "MLA's rope layout is fixed (DeepSeek pairs)"),
    "rotary_percent": ((1.0,), "RoPE on all qk_pos_emb_head_dim dims"),
    "mrope_section": ((None,), "no multimodal RoPE"),
    "cache_mla_latents": ((False,), "no inference caches"), "flash_decode": ((False,), "no inference"),
    "use_inference_optimized_layers": ((False,), "no inference"),
    "inference_fuse_tp_communication": ((False,), "no inference"),
    "mlp_chunks_for_prefill": ((1,), "no inference"),
    "linear_attention_freq": ((None,), "MLA on every layer"),
    "is_hybrid_model": ((False,), "MLA on every layer"),
    "heterogeneous_block_specs": ((False,), "one spec per layer kind"),
    "mtp_num_layers": ((None,), "MTP blocks are not adapted; use spartron.layers.mtp"),
    "recompute_granularity": ((None,), "Megatron recompute re-runs the layers through its own checkpoint, which "
                              "replays the SideChannel writes and has no Spartron policy; use "
                              "spartron.interop.megatron.apply_spartron_checkpointing(model, ac) with ac.mode "
                              "'full' or 'selective'"),
    "moe_layer_recompute": ((False,), "use spartron.interop.megatron.apply_spartron_checkpointing"),
    "cpu_offloading": ((False,), "use the offload windows of apply_spartron_checkpointing(model, ac, offload)"),
    "fine_grained_activation_offloading": ((False,), "use spartron offload windows"),
    "enable_cuda_graph": ((False,), "no CUDA graphs"), "external_cuda_graph": ((False,), "no CUDA graphs"),
    "cuda_graph_impl": (("none",), "no CUDA graphs"),
    "overlap_moe_expert_parallel_comm": ((False,), "Spartron dispatch does not overlap this way"),
    "delay_wgrad_compute": ((False,), "no delayed wgrad"),
    "moe_shared_expert_gate": ((False,), "ungated shared experts"),
    "moe_shared_expert_overlap": ((False,), "shared experts run after combine"),
    "moe_enable_routing_replay": ((False,), "routing replay is the mandatory moe_topk save"),
    "moe_router_topk_limited_devices": ((None,), "no device-limited routing"),
    "moe_router_padding_for_quantization": ((False,), "Spartron's FP8 experts take any row count: no padding"),
    "moe_router_padding_for_fp8": ((False,), "Spartron's FP8 experts take any row count: no padding"),
    "moe_router_force_load_balancing": ((False,), "real routing only"),
    "moe_z_loss_coeff": ((None, 0.0), "no router z-loss"), "moe_input_jitter_eps": ((None,), "no jitter"),
    "moe_token_dropping": ((False,), "dropless MoE"), "moe_expert_capacity_factor": ((None,), "dropless MoE"),
    "moe_pad_expert_input_to_capacity": ((False,), "dropless MoE"),
    "moe_permute_fusion": ((False,), "Spartron's own permutation"),
    "moe_router_fusion": ((False,), "Spartron's own router"),
    "moe_apply_probs_on_input": ((False,), "gate weights scale expert outputs"),
    "moe_latent_size": ((None,), "no latent MoE"),
    "moe_use_legacy_grouped_gemm": ((False,), "Spartron's grouped experts"),
    "moe_per_layer_logging": ((False,), "router telemetry goes through the SideChannel"),
    "batch_invariant_mode": ((False,), "no batch-invariant kernels"),
}

MEGATRON_OWNED = frozenset({
    "pipeline_model_parallel_comm_backend", "context_parallel_size", "expert_model_parallel_size",
    "perform_initialization", "use_cpu_initialization", "timers", "finalize_model_grads_func",
    "grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func", "deterministic_mode",
    "enable_autocast", "autocast_dtype", "num_microbatches_with_partial_activation_checkpoints",
    "gradient_accumulation_fusion", "async_tensor_model_parallel_allreduce", "use_te_rng_tracker",
    "tp_comm_overlap", "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad", "tp_comm_overlap_ag", "tp_comm_overlap_rs",
    "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag", "tp_comm_atomic_ag", "tp_comm_split_rs",
    "tp_comm_atomic_rs", "cross_entropy_loss_fusion", "cross_entropy_fusion_impl",
    "tp_comm_overlap_disable_qkv", "tp_comm_overlap_disable_fc1", "tp_comm_bootstrap_backend",
    "ep_overlap_early_attn_memory_release", "pipeline_dtype", "variable_seq_lengths", "overlap_p2p_comm",
    "batch_p2p_comm", "batch_p2p_sync", "use_ring_exchange_p2p", "deallocate_pipeline_outputs",
    "defer_embedding_wgrad_compute", "wgrad_deferral_limit", "overlap_p2p_comm_warmup_flush",
    "microbatch_group_size_per_vp_stage", "mtp_standalone", "cpu_offloading_num_layers",
    "_cpu_offloading_context", "cpu_offloading_activations", "cpu_offloading_weights",
    "cpu_offloading_double_buffering", "barrier_with_L1_time", "mtp_loss_scaling_factor",
    "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
    "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split", "attention_backend", "num_query_groups", "kv_channels",
    "hidden_dropout", "fp32_residual_connection", "apply_residual_connection_post_layernorm",
    "qk_clip_alpha", "qk_clip_threshold", "test_mode",
    "calculate_per_token_loss", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "init_method", "output_layer_init_method",
    "embedding_init_method", "embedding_init_method_std", "init_model_with_meta_device",
    "apply_query_key_layer_scaling", "attention_softmax_in_fp32", "disable_bf16_reduced_precision_matmul",
    "bias_activation_fusion", "masked_softmax_fusion", "bias_dropout_fusion", "apply_rope_fusion",
    "use_fused_weighted_squared_relu", "fused_single_qkv_rope", "recompute_method", "recompute_num_layers",
    "distribute_saved_activations", "recompute_modules",
    "fp8_interval", "tp_only_amax_red",
    "kitchen_attention_backend", "fp4_recipe", "fp4_quantizer_factory", "moe_token_drop_policy",
    "moe_hybridep_num_sms", "cuda_graph_use_single_mempool", "cuda_graph_retain_backward_graph",
    "cuda_graph_warmup_steps", "cuda_graph_scope", "clone_scatter_output_in_embedding",
    "disable_parameter_transpose_cache", "config_logger_dir", "inference_rng_tracker",
    "inference_sampling_seed",
    "symmetric_ar_type", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads",
    "use_mamba_mem_eff_path", "hetereogenous_dist_checkpoint", "transformer_impl", "offload_modules",
    "min_offloaded_tensor_size",
})

_DISPATCHERS = {"alltoall": ("all_to_all", "local"), "flex": ("deepep",)}
_BALANCE_TYPES = {"aux_loss": "batch", "seq_aux_loss": "seq"}
_BALANCE_NAMES = {v: k for k, v in _BALANCE_TYPES.items()}


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _required_problems(tcfg: TransformerConfig) -> list[str]:
    problems = []
    for f in dataclasses.fields(tcfg):
        name, value = f.name, getattr(tcfg, f.name)
        if name in REQUIRED:
            allowed, why = REQUIRED[name]
            if not any(value is a or value == a for a in allowed):
                shown = [getattr(a, "__name__", a) for a in allowed]
                problems.append(f"{name}={getattr(value, '__name__', value)!r}: must be one of {shown} "
                                f"({why})")
        elif name not in MAPPED and name not in MEGATRON_OWNED and value != _field_default(f):
            problems.append(f"{name}={value!r}: unknown to this adapter (written for megatron-core 0.16); "
                            "leave it at its default")
    return problems


def _moe_first_k_dense(tcfg: TransformerConfig, problems: list[str]) -> int:
    n = tcfg.num_layers
    if tcfg.num_moe_experts is None:
        return n
    freq = tcfg.moe_layer_freq
    pattern = [1 if i % freq == 0 else 0 for i in range(n)] if isinstance(freq, int) else list(freq)
    k = pattern.index(1) if 1 in pattern else n
    if pattern != [0] * k + [1] * (n - k):
        problems.append(f"moe_layer_freq={freq!r}: Spartron models are k dense layers then MoE layers "
                        "([0]*k + [1]*(num_layers-k) or 1)")
    return k


def _moe_section(tcfg: TransformerConfig, base: ModelConfig, problems: list[str]) -> dict[str, Any]:
    """The [model.moe] values Megatron expresses (only meaningful when num_moe_experts is set)."""
    if tcfg.num_moe_experts is None:
        return {}
    bm = base.moe
    top_k, func = tcfg.moe_router_topk, tcfg.moe_router_score_function
    inter = tcfg.moe_ffn_hidden_size
    shared = tcfg.moe_shared_expert_intermediate_size or 0
    if shared % inter:
        problems.append(f"moe_shared_expert_intermediate_size={shared}: must be a multiple of "
                        f"moe_ffn_hidden_size={inter} (Spartron counts shared experts)")
    n_groups = tcfg.moe_router_num_groups or 1
    topk_groups = tcfg.moe_router_group_topk or 1
    if tcfg.moe_router_group_topk:  # Megatron ranks groups by the sum of their top (top_k // group_topk)
        want = 2 if func == "sigmoid" else 1  # Spartron: top-2 sum (sigmoid), max (softmax)
        if top_k // topk_groups != want:
            problems.append(f"moe_router_topk // moe_router_group_topk = {top_k // topk_groups}: Spartron's "
                            f"{func} router ranks groups by their top-{want} scores")
    if func == "softmax":
        norm = not tcfg.moe_router_pre_softmax  # (Megatron itself rejects an expert bias with softmax)
    else:
        norm = top_k > 1  # Megatron normalises sigmoid gate weights whenever top_k > 1
        if tcfg.moe_router_pre_softmax:
            problems.append("moe_router_pre_softmax=True only applies to softmax scores")
    balance = tcfg.moe_router_load_balancing_type
    coeff = tcfg.moe_aux_loss_coeff
    aux_type = bm.aux_loss_type
    if balance in _BALANCE_TYPES:
        aux_type = _BALANCE_TYPES[balance] if coeff > 0 else aux_type
    elif balance != "none":
        problems.append(f"moe_router_load_balancing_type={balance!r}: Spartron has 'aux_loss' (batch), "
                        "'seq_aux_loss' (seq) and 'none'")
    elif coeff > 0:
        problems.append(f"moe_aux_loss_coeff={coeff} with moe_router_load_balancing_type='none'")
    if coeff > 0 and tcfg.context_parallel_size > 1:
        problems.append("moe_aux_loss_coeff > 0 with context_parallel_size > 1: Spartron computes the "
                        "balance loss per CP shard, Megatron over the whole sequence")
    if tcfg.moe_router_dtype not in (None, "fp32"):
        problems.append(f"moe_router_dtype={tcfg.moe_router_dtype!r}: Spartron routes in fp32 or the "
                        "model dtype")
    dispatcher = _dispatcher(tcfg, bm.dispatcher, problems)
    grouped = bm.grouped_mm if (bm.grouped_mm != "loop") == tcfg.moe_grouped_gemm else (
        "auto" if tcfg.moe_grouped_gemm else "loop")
    return {
        "n_routed_experts": tcfg.num_moe_experts, "n_shared_experts": shared // inter, "top_k": top_k,
        "moe_inter_dim": inter, "score_func": func, "n_groups": n_groups, "topk_groups": topk_groups,
        "route_scale": tcfg.moe_router_topk_scaling_factor or 1.0, "norm_topk_prob": norm,
        "router_fp32": tcfg.moe_router_dtype == "fp32",
        "bias_update_rate": tcfg.moe_router_bias_update_rate if tcfg.moe_router_enable_expert_bias else 0.0,
        "aux_loss_coeff": coeff, "aux_loss_type": aux_type, "dispatcher": dispatcher,
        "deepep_num_sms": tcfg.moe_deepep_num_sms if dispatcher == "deepep" else bm.deepep_num_sms,
        "grouped_mm": grouped,
    }


def _dispatcher(tcfg: TransformerConfig, base_choice: str, problems: list[str]) -> str:
    kind = tcfg.moe_token_dispatcher_type
    if kind == "flex" and not (tcfg.moe_enable_deepep or tcfg.moe_flex_dispatcher_backend == "deepep"):
        problems.append(f"moe_flex_dispatcher_backend={tcfg.moe_flex_dispatcher_backend!r}: only DeepEP")
    if kind not in _DISPATCHERS:
        problems.append(f"moe_token_dispatcher_type={kind!r}: Spartron dispatches with 'alltoall' "
                        "(all_to_all / local) or 'flex' (DeepEP)")
        return base_choice
    if tcfg.moe_enable_deepep and kind != "flex":
        problems.append("moe_enable_deepep=True needs moe_token_dispatcher_type='flex'")
    choices = _DISPATCHERS[kind]
    return base_choice if base_choice in choices else choices[0]


def _mla_section(tcfg: TransformerConfig, problems: list[str]) -> dict[str, Any]:
    if not getattr(tcfg, "multi_latent_attention", False):
        problems.append("multi_latent_attention=False: Spartron attention is MLA (use MLATransformerConfig)")
        return {}
    yarn = None
    if tcfg.rope_type == "yarn":
        yarn = {"factor": tcfg.rotary_scaling_factor,
                "original_max_position_embeddings": tcfg.original_max_position_embeddings,
                "beta_fast": tcfg.beta_fast, "beta_slow": tcfg.beta_slow, "mscale": tcfg.mscale,
                "mscale_all_dim": tcfg.mscale_all_dim}
    elif tcfg.rope_type != "rope":
        problems.append(f"rope_type={tcfg.rope_type!r}: Spartron MLA has 'rope' and 'yarn'")
    return {"q_lora_rank": tcfg.q_lora_rank or 0, "kv_lora_rank": tcfg.kv_lora_rank,
            "qk_nope_head_dim": tcfg.qk_head_dim, "qk_rope_head_dim": tcfg.qk_pos_emb_head_dim,
            "v_head_dim": tcfg.v_head_dim, "rope_theta": float(tcfg.rotary_base), "yarn": yarn}


def _dsa_section(tcfg: TransformerConfig, base: ModelConfig, problems: list[str]) -> dict[str, Any] | None:
    variant = tcfg.experimental_attention_variant
    if variant is None:
        return None
    if variant != "dsa":
        problems.append(f"experimental_attention_variant={variant!r}: Spartron adapts MLA and DSA only")
        return None
    coeff = tcfg.dsa_indexer_loss_coeff or 0.0
    mode = "frozen" if coeff == 0 else ("kl_sparse" if tcfg.dsa_indexer_use_sparse_loss else "kl_dense")
    spartron_only = ({"layers": "all", "topk_freq": 1} if base.dsa is None else
                     {k: getattr(base.dsa, k) for k in ("layers", "topk_freq", "share_indexer_across_mtp",
                                                          "indexer_fp8", "deterministic_dkv", "kl_dense_chunk",
                                                          "attention_chunk")})
    return {"n_index_heads": tcfg.dsa_indexer_n_heads, "index_head_dim": tcfg.dsa_indexer_head_dim,
            "index_topk": tcfg.dsa_indexer_topk, "indexer_mode": mode, "indexer_loss_coeff": coeff,
            **spartron_only}


def _fp8_section(tcfg: TransformerConfig, base: ModelConfig, problems: list[str]) -> dict[str, Any] | None:
    """model.fp8 from Megatron's fp8 / fp8_recipe / fp8_wgrad / first_last_layers_bf16 with num_layers_at_start_in_bf16
    and num_layers_at_end_in_bf16 (which Megatron reads only when fp8 is set: wgrad, the bf16 layers); the
    Spartron-only fields (backend, modules, power_of_two_scales, weight_cache, dispatch, param_gather) from `base`."""
    if tcfg.fp8 is None:
        return None
    if tcfg.fp8 != "e4m3":
        problems.append(f"fp8={tcfg.fp8!r}: Spartron's blockwise recipe is E4M3 for activations, weights and "
                        "gradients ('e4m3'; 'hybrid' sends the gradients as E5M2)")
    if tcfg.fp8_recipe != "blockwise":
        problems.append(f"fp8_recipe={tcfg.fp8_recipe!r}: Spartron runs DeepSeek-V3's recipe, 'blockwise' (1x128 "
                        "activation and gradient tiles, 128x128 weight blocks, each scaled by its own amax)")
    megatron = {"recipe": "blockwise", "wgrad": "fp8" if tcfg.fp8_wgrad else "model_dtype",
                "layers_at_start_in_bf16": tcfg.num_layers_at_start_in_bf16 if tcfg.first_last_layers_bf16 else 0,
                "layers_at_end_in_bf16": tcfg.num_layers_at_end_in_bf16 if tcfg.first_last_layers_bf16 else 0}
    spartron_only = {} if base.fp8 is None else base.fp8.model_dump(exclude=set(megatron))
    return {**megatron, **spartron_only}


def _dtype(tcfg: TransformerConfig, problems: list[str]) -> str:
    if tcfg.bf16 or tcfg.params_dtype == torch.bfloat16:
        return "bfloat16"
    if tcfg.params_dtype != torch.float32:
        problems.append(f"params_dtype={tcfg.params_dtype}: Spartron layers are float32 or bfloat16")
    return "float32"


def _disagreements(base: dict, derived: dict, prefix: str = "model") -> list[str]:
    out = []
    for key, value in derived.items():
        ours = base.get(key)
        if isinstance(value, dict) and isinstance(ours, dict):
            out += _disagreements(ours, value, f"{prefix}.{key}")
        elif ours != value:
            out.append(f"{prefix}.{key}: Spartron {ours!r} vs Megatron {value!r}")
    return out


def spartron_config_from_megatron(tcfg: TransformerConfig | MLATransformerConfig,
                                  base: ModelConfig | None = None) -> ModelConfig:
    """Spartron's ModelConfig for a Megatron config; raises MegatronConfigError listing every problem.

    `base` supplies the Spartron-only settings (module docstring). When given, every setting Megatron
    expresses must agree with it, so the adapters and a Spartron model built from `base` are the
    same model; a disagreement is a problem naming both values.
    """
    problems = _required_problems(tcfg)
    ref = base or ModelConfig()
    derived: dict[str, Any] = {
        "dim": tcfg.hidden_size, "n_layers": tcfg.num_layers, "n_heads": tcfg.num_attention_heads,
        "first_k_dense": _moe_first_k_dense(tcfg, problems), "dense_inter_dim": tcfg.ffn_hidden_size,
        "norm_eps": tcfg.layernorm_epsilon, "dtype": _dtype(tcfg, problems), "init_std": tcfg.init_method_std,
        "mla": _mla_section(tcfg, problems), "dsa": _dsa_section(tcfg, ref, problems),
        "mtp": {"depth": 0}, "fp8": _fp8_section(tcfg, ref, problems),
    }
    if derived["fp8"] is not None and derived["dtype"] != "bfloat16":
        problems.append("fp8='e4m3' with bf16=False: Spartron's FP8 layers run in bfloat16 outside the FP8 GEMMs "
                        "(set bf16=True)")
    moe = _moe_section(tcfg, ref, problems)
    if moe:
        derived["moe"] = moe
    if base is not None:
        problems += _disagreements(base.model_dump(), derived)
    if problems:
        raise MegatronConfigError(problems)
    merged = ref.model_dump()
    for key, value in derived.items():
        merged[key] = {**(merged[key] or {}), **value} if isinstance(value, dict) else value
    return ModelConfig.model_validate(merged)


def megatron_config_from_spartron(cfg: ModelConfig, **overrides: Any) -> MLATransformerConfig:
    """The MLATransformerConfig the adapters honour for `cfg`; `overrides` are applied last and checked."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    kw: dict[str, Any] = {name: allowed[0] for name, (allowed, _) in REQUIRED.items()}
    kw.update(expert_tensor_parallel_size=1, moe_z_loss_coeff=None)
    mla, moe = cfg.mla, cfg.moe
    kw.update(num_layers=cfg.n_layers, hidden_size=cfg.dim, num_attention_heads=cfg.n_heads,
              ffn_hidden_size=cfg.dense_inter_dim, layernorm_epsilon=cfg.norm_eps,
              init_method_std=cfg.init_std,
              hidden_dropout=0.0, bf16=cfg.dtype == "bfloat16", params_dtype=getattr(torch, cfg.dtype),
              q_lora_rank=mla.q_lora_rank or None, kv_lora_rank=mla.kv_lora_rank,
              qk_head_dim=mla.qk_nope_head_dim, qk_pos_emb_head_dim=mla.qk_rope_head_dim,
              v_head_dim=mla.v_head_dim, rotary_base=mla.rope_theta,
              rope_type="rope" if mla.yarn is None else "yarn")
    if mla.yarn is not None:
        y = mla.yarn
        kw.update(rotary_scaling_factor=y.factor,
                  original_max_position_embeddings=y.original_max_position_embeddings,
                  beta_fast=y.beta_fast, beta_slow=y.beta_slow, mscale=y.mscale,
                  mscale_all_dim=y.mscale_all_dim)
    if cfg.first_k_dense < cfg.n_layers:
        kw.update(num_moe_experts=moe.n_routed_experts,
                  moe_layer_freq=[0] * cfg.first_k_dense + [1] * (cfg.n_layers - cfg.first_k_dense),
                  moe_router_topk=moe.top_k, moe_ffn_hidden_size=moe.moe_inter_dim,
                  moe_shared_expert_intermediate_size=moe.n_shared_experts * moe.moe_inter_dim or None,
                  moe_router_score_function=moe.score_func,
                  moe_router_pre_softmax=moe.score_func == "softmax" and not moe.norm_topk_prob,
                  moe_router_num_groups=moe.n_groups if moe.n_groups > 1 else None,
                  moe_router_group_topk=moe.topk_groups if moe.n_groups > 1 else None,
                  moe_router_topk_scaling_factor=moe.route_scale if moe.route_scale != 1.0 else None,
                  moe_router_enable_expert_bias=moe.bias_update_rate > 0,
                  moe_router_bias_update_rate=moe.bias_update_rate or 1e-3,
                  moe_aux_loss_coeff=moe.aux_loss_coeff,
                  moe_router_load_balancing_type=("none" if moe.aux_loss_coeff == 0
                                                  else _BALANCE_NAMES[moe.aux_loss_type]),
                  moe_router_dtype="fp32" if moe.router_fp32 else None,
                  moe_token_dispatcher_type="flex" if moe.dispatcher == "deepep" else "alltoall",
                  moe_flex_dispatcher_backend="deepep", moe_deepep_num_sms=moe.deepep_num_sms,
                  moe_grouped_gemm=moe.grouped_mm != "loop")
    if cfg.dsa is not None:
        kw.update(experimental_attention_variant="dsa", dsa_indexer_n_heads=cfg.dsa.n_index_heads,
                  dsa_indexer_head_dim=cfg.dsa.index_head_dim, dsa_indexer_topk=cfg.dsa.index_topk,
                  dsa_indexer_loss_coeff=cfg.dsa.indexer_loss_coeff,
                  dsa_indexer_use_sparse_loss=cfg.dsa.indexer_mode == "kl_sparse")
    if cfg.first_k_dense < cfg.n_layers and moe.score_func == "softmax" and moe.bias_update_rate > 0:
        raise MegatronConfigError(["model.moe.bias_update_rate > 0 with score_func 'softmax': Megatron's "
                                   "expert bias (moe_router_enable_expert_bias) needs sigmoid scores"])
    kw.update(overrides)
    fp8_fields = ("fp8", "fp8_recipe", "fp8_wgrad", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
                  "num_layers_at_end_in_bf16")
    fp8 = {k: kw.pop(k) for k in fp8_fields if k in kw}
    if cfg.fp8 is not None:
        start, end = cfg.fp8.layers_at_start_in_bf16, cfg.fp8.layers_at_end_in_bf16
        fp8 = {"fp8": "e4m3", "fp8_recipe": "blockwise", "fp8_wgrad": cfg.fp8.wgrad == "fp8",
               "first_last_layers_bf16": start + end > 0, "num_layers_at_start_in_bf16": start,
               "num_layers_at_end_in_bf16": end, **fp8}
    tcfg = MLATransformerConfig(**kw)
    # set after construction: megatron-core 0.16's __post_init__ checks Transformer Engine's version for MoE FP8
    # (and fails without TE); the Spartron layers run their own FP8 and never use TE
    for key, value in fp8.items():
        setattr(tcfg, key, value)
    spartron_config_from_megatron(tcfg, base=cfg)  # raises on anything the adapters cannot honour
    return tcfg
