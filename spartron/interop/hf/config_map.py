"""Hugging Face `config.json` (DeepSeek-V3 / V3.2) <-> Spartron's `[model]` section (ModelConfig).

Pure JSON in, pure JSON out: nothing here imports `transformers` or runs code from the checkpoint.
Every HF setting Spartron cannot honour exactly is collected and reported in ONE `HFConfigError`
that names each key, so a user fixes a config in one pass. What "honour" means was checked against
transformers' `DeepseekV3ForCausalLM` / `DeepseekV32ForCausalLM` (tests/interop/test_hf.py, equal
logits); the differences that matter:

- routing: HF always scores with sigmoid, ranks groups by the sum of their two best biased scores
  (Spartron's `score_func = "sigmoid"` rule), normalises when `norm_topk_prob`, then multiplies by
  `routed_scaling_factor` (`route_scale`);
- MLA's latent norms (`q_a_layernorm`, `kv_a_layernorm`) use eps 1e-6 whatever `rms_norm_eps`
  says, Spartron one `norm_eps` for every RMSNorm: only `rms_norm_eps = 1e-6` maps exactly;
- YaRN: HF multiplies cos/sin by mscale(f, mscale) / mscale(f, mscale_all_dim) and the softmax
  scale by mscale(f, mscale_all_dim)^2 only when both are set (DeepSeek-V3 sets both); with one of
  them missing HF uses other factors, which Spartron's `[model.mla.yarn]` cannot express;
- RoPE: Spartron rotates interleaved pairs (`rope_interleave = true`, the DeepSeek default);
- MTP: `num_nextn_predict_layers` is honoured only when the checkpoint holds those layers
  (`model.layers.{num_hidden_layers + k}.*`); transformers' own `save_pretrained` writes none.
- a float16 checkpoint is imported as float32 (exact); DeepSeek's blockwise FP8 (`quantization_config`
  quant_method "fp8", fmt "e4m3") is imported dequantised (spartron.interop.hf.fp8_storage), any other
  quantization refused.
"""

from __future__ import annotations

import math
import re
import tomllib
from typing import Any

from pydantic import ValidationError

from spartron.interop.hf.config_fields import cross_field_problems, field_problems
from spartron.interop.hf.fp8_storage import storage_block
from spartron.layers.config import ModelConfig

V3, V32 = "deepseek_v3", "deepseek_v32"
ARCHITECTURES = {V3: "DeepseekV3ForCausalLM", V32: "DeepseekV32ForCausalLM"}

# Keys that do not change the weights or the forward pass (PreTrainedConfig's generic fields,
# tokenizer ids, inference-only switches, DeepSeek's deployment hints).
IGNORED_KEYS = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "auto_map", "chunk_size_feed_forward",
    "id2label", "label2id", "is_encoder_decoder", "output_attentions", "output_hidden_states", "problem_type",
    "return_dict", "tokenizer_class", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache",
    "pretraining_tp", "output_router_logits", "ep_size", "initializer_range", "layer_types", "mlp_layer_types",
})


class HFConfigError(ValueError):
    """A Hugging Face config Spartron cannot honour (or a Spartron config HF cannot express); names every key."""


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


class _Problems:
    """Collects one line per key; `raise_if_any` raises them as one error."""

    def __init__(self, what: str) -> None:
        self.what, self.lines = what, []

    def add(self, key: str, why: str) -> None:
        self.lines.append(f"{key}: {why}")

    def raise_if_any(self) -> None:
        if self.lines:
            raise HFConfigError(f"{self.what}: {len(self.lines)} setting(s) cannot be honoured: "
                                + "; ".join(self.lines))


def _rope(hf: dict, problems: _Problems) -> tuple[float, dict | None]:
    """(rope_theta, Spartron yarn dict or None) from `rope_parameters` (transformers 5) or `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    key = "rope_parameters"
    if hf.get("rope_scaling"):
        if params and {k: v for k, v in params.items() if k != "rope_theta"} != hf["rope_scaling"]:
            problems.add("rope_scaling", "set beside rope_parameters, which says otherwise (transformers 5 takes "
                         "rope_scaling's and drops rope_parameters'): keep one, with YaRN's fields in it")
        params, key = {**params, **hf["rope_scaling"]}, "rope_scaling"
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if kind == "default":
        return float(theta), None
    if kind != "yarn":
        problems.add(f"{key}.rope_type", f"{kind!r}: Spartron implements default RoPE and YaRN only")
        return float(theta), None
    orig = params.pop("original_max_position_embeddings", None)
    if orig is None:
        problems.add(f"{key}.original_max_position_embeddings", "YaRN needs it")
        orig = 4096
    factor = params.pop("factor", None)
    if factor is None:  # transformers' rule for DeepSeek: the context extension ratio
        factor = hf.get("max_position_embeddings", orig) / orig
    mscale, mscale_all = params.pop("mscale", None), params.pop("mscale_all_dim", None)
    if factor > 1 and not (mscale and mscale_all):
        problems.add(f"{key}.mscale/mscale_all_dim", f"({mscale}, {mscale_all}): transformers applies "
                     "DeepSeek's YaRN attention scaling only when both are set; Spartron always does")
    mscale, mscale_all = float(mscale or 1.0), float(mscale_all or 1.0)
    attention = params.pop("attention_factor", None)
    if attention is not None and not math.isclose(attention, _mscale(factor, mscale) / _mscale(factor, mscale_all),
                                                  rel_tol=1e-9):
        problems.add(f"{key}.attention_factor", f"{attention}: Spartron derives it from mscale / mscale_all_dim")
    if params.pop("truncate", True) is not True:
        problems.add(f"{key}.truncate", "false: Spartron truncates the YaRN correction range (DeepSeek)")
    if params.pop("partial_rotary_factor", 1.0) != 1.0:
        problems.add(f"{key}.partial_rotary_factor", "Spartron rotates all qk_rope_head_dim dims")
    yarn = {"factor": float(factor), "original_max_position_embeddings": int(orig),
            "beta_fast": float(params.pop("beta_fast", None) or 32.0),
            "beta_slow": float(params.pop("beta_slow", None) or 1.0),
            "mscale": mscale, "mscale_all_dim": mscale_all}
    for extra in sorted(params):
        problems.add(f"{key}.{extra}", "not understood by Spartron's YaRN")
    return float(theta), yarn


def _dtype(hf: dict, problems: _Problems) -> str:
    value = hf.get("dtype", hf.get("torch_dtype")) or "float32"
    if value in ("float32", "float16"):  # float16 is imported exactly as float32
        return "float32"
    if value == "bfloat16":
        return "bfloat16"
    problems.add("dtype", f"{value!r}: Spartron trains float32 or bfloat16 parameters")
    return "float32"


def model_config_from_hf(hf: dict[str, Any], mtp_layers: int | None = None) -> ModelConfig:
    """The ModelConfig of a DeepSeek-V3 / V3.2 `config.json` (a parsed dict).

    `mtp_layers`: how many MTP layers the checkpoint holds (None: trust `num_nextn_predict_layers`).
    Raises HFConfigError listing every setting that cannot be honoured.
    """
    problems = _Problems("Hugging Face config.json")
    for key, why in field_problems(hf):  # types and bounds first: nothing below sees a wrong type
        problems.add(key, why)
    problems.raise_if_any()
    for key, why in cross_field_problems(hf):  # required fields and consistency, in config.json's own terms
        problems.add(key, why)
    problems.raise_if_any()
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        problems.add("model_type", f"{kind!r}: Spartron imports {' and '.join(ARCHITECTURES)}")
        kind = V3
    arch = hf.get("architectures") or [ARCHITECTURES[kind]]
    if arch != [ARCHITECTURES[kind]]:
        problems.add("architectures", f"{arch}: expected [{ARCHITECTURES[kind]!r}]")
    used = set(IGNORED_KEYS)

    def get(key: str, default: Any = None) -> Any:
        used.add(key)
        return hf.get(key, default)

    def require(key: str, ok, why: str, default: Any = None) -> None:
        used.add(key)
        if key in hf and not ok(hf[key]):
            problems.add(key, f"{hf[key]!r}: {why}")
        elif key not in hf and default is not None and not ok(default):
            problems.add(key, f"missing (transformers' default {default!r}): {why}")

    require("hidden_act", lambda v: v == "silu", "Spartron's FFNs are SwiGLU (silu)")
    require("attention_bias", lambda v: v is False, "Spartron's projections have no bias")
    require("attention_dropout", lambda v: v == 0, "Spartron has no attention dropout")
    require("mlp_bias", lambda v: v is False, "Spartron's FFNs have no bias")
    require("rope_interleave", lambda v: v is True, "Spartron rotates interleaved RoPE pairs (DeepSeek's layout)")
    require("rms_norm_eps", lambda v: v == 1e-6, "transformers' MLA latent norms use eps 1e-6 whatever this "
            "says, Spartron one eps for every RMSNorm")
    require("scoring_func", lambda v: v == "sigmoid", "DeepSeek-V3 routing is sigmoid")
    require("topk_method", lambda v: v == "noaux_tc", "Spartron routes with DeepSeek-V3's noaux_tc rule")
    require("moe_layer_freq", lambda v: v == 1, "every layer after first_k_dense_replace is MoE in Spartron")
    used.add("quantization_config")
    if hf.get("quantization_config") is not None and isinstance(why := storage_block(hf["quantization_config"]), str):
        problems.add("quantization_config", f"{hf['quantization_config']!r}: {why}")
    heads = get("num_attention_heads", 128)
    require("num_key_value_heads", lambda v: v in (None, heads),
            f"must equal num_attention_heads ({heads}): MLA has one KV head per attention head")
    rope_dim = get("qk_rope_head_dim", 64)
    require("head_dim", lambda v: v == rope_dim, "transformers sets it to qk_rope_head_dim")
    require("qk_head_dim", lambda v: v == get("qk_nope_head_dim", 128) + rope_dim,
            "must be qk_nope_head_dim + qk_rope_head_dim")
    theta, yarn = _rope(hf, problems)
    used |= {"rope_parameters", "rope_scaling", "rope_theta"}
    n_layers = get("num_hidden_layers", 61)
    first_dense = min(get("first_k_dense_replace", 3), n_layers)
    if kind == V32:
        dense_pattern = ["dense"] * first_dense + ["sparse"] * (n_layers - first_dense)
        if hf.get("mlp_layer_types") not in (None, dense_pattern):
            problems.add("mlp_layer_types", "Spartron's MoE layers follow first_k_dense_replace")
        if hf.get("layer_types") not in (None, ["indexed_attention"] * n_layers):
            problems.add("layer_types", "DeepSeek-V3.2 runs the indexer in every layer")
        if hf.get("q_lora_rank") is None:
            problems.add("q_lora_rank", "DeepSeek-V3.2's indexer reads the query latent: set it")
    declared_mtp = get("num_nextn_predict_layers", 0) or 0
    mtp_depth = declared_mtp if mtp_layers is None else mtp_layers
    if mtp_layers is not None and 0 < mtp_layers != declared_mtp:
        problems.add("num_nextn_predict_layers", f"{declared_mtp}, but the checkpoint holds {mtp_layers} MTP layers")
    aux = get("aux_loss_alpha", 0.0) or 0.0
    data = {
        "vocab_size": get("vocab_size", 129280), "dim": get("hidden_size", 7168), "n_layers": n_layers,
        "n_heads": heads, "first_k_dense": first_dense, "dense_inter_dim": get("intermediate_size", 18432),
        "norm_eps": float(get("rms_norm_eps", 1e-6)), "max_seq_len": get("max_position_embeddings", 4096),
        "tie_embeddings": bool(get("tie_word_embeddings", False)), "dtype": _dtype(hf, problems),
        "init_std": float(get("initializer_range", 0.02)),
        "mla": {"q_lora_rank": get("q_lora_rank", 1536) or 0, "kv_lora_rank": get("kv_lora_rank", 512),
                "qk_nope_head_dim": get("qk_nope_head_dim", 128), "qk_rope_head_dim": rope_dim,
                "v_head_dim": get("v_head_dim", 128), "rope_theta": theta, "yarn": yarn},
        "moe": {"n_routed_experts": get("n_routed_experts", 256), "n_shared_experts": get("n_shared_experts", 1),
                "top_k": get("num_experts_per_tok", 8), "moe_inter_dim": get("moe_intermediate_size", 2048),
                "score_func": "sigmoid", "n_groups": get("n_group", 8) or 1, "topk_groups": get("topk_group", 4) or 1,
                "route_scale": float(get("routed_scaling_factor", 2.5)),
                "norm_topk_prob": bool(get("norm_topk_prob", True)),
                "aux_loss_coeff": float(aux), "aux_loss_type": "seq" if get("seq_aux", True) else "batch"},
        "mtp": {"depth": mtp_depth},
    }
    used |= {"dtype", "torch_dtype"}
    if kind == V32:
        data["dsa"] = {"n_index_heads": get("index_n_heads", 64), "index_head_dim": get("index_head_dim", 128),
                       "index_topk": get("index_topk", 2048), "layers": "all", "topk_freq": 1,
                       "share_indexer_across_mtp": False}  # every DeepSeek-V3.2 MTP layer has its own
    for key in sorted(set(hf) - used - {"scoring_func", "topk_method", "moe_layer_freq", "quantization_config"}):
        problems.add(key, "not a DeepSeek-V3 setting Spartron knows (remove it if it does not change the model)")
    problems.raise_if_any()
    try:
        return ModelConfig.model_validate(data)
    except ValidationError as err:
        details = "; ".join((f"model.{'.'.join(str(p) for p in e['loc'])}: " if e["loc"] else "")
                            + e["msg"].removeprefix("Value error, ") for e in err.errors())
        named = {key.rstrip(".").rsplit(".", 1)[-1] for key in re.findall(r"model\.[\w.]+", details)}
        fields = sorted({HF_FIELD_OF[key] for key in named if key in HF_FIELD_OF})
        raise HFConfigError(f"Hugging Face config.json maps to an invalid Spartron config (from config.json's "
                            f"{', '.join(fields) or 'fields'}): {details}") from None


# Spartron's `model.*` key -> the config.json field it comes from: a mapped config that Spartron's own checks
# refuse names the field the user edits.
HF_FIELD_OF = {
    "vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
    "first_k_dense": "first_k_dense_replace", "dense_inter_dim": "intermediate_size", "norm_eps": "rms_norm_eps",
    "max_seq_len": "max_position_embeddings", "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
    "rope_theta": "rope_theta", "yarn": "rope_scaling", "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts", "top_k": "num_experts_per_tok", "moe_inter_dim": "moe_intermediate_size",
    "topk_groups": "topk_group", "n_groups": "n_group", "route_scale": "routed_scaling_factor",
    "n_index_heads": "index_n_heads", "index_head_dim": "index_head_dim", "index_topk": "index_topk",
    "mtp": "num_nextn_predict_layers",
}


# ModelConfig keys a checkpoint does not determine: how Spartron runs and trains the same function.
SPARTRON_ONLY_KEYS = frozenset({
    "dtype", "master_dtype", "master_weights", "reduce_dtype", "init_std", "loss_chunk_size", "moe.router_fp32",
    "moe.bias_update_rate",
    "moe.aux_loss_coeff",
    "moe.aux_loss_type", "moe.dispatcher", "moe.all_to_all_transport", "moe.copy_engine_sync", "moe.deepep_num_sms",
    "moe.grouped_mm", "mtp.share_weights", "mtp.loss_scale", "dsa.indexer_mode", "dsa.indexer_loss_coeff",
    "fp8", "dsa.indexer_fp8", "dsa.deterministic_dkv", "dsa.kl_dense_chunk", "dsa.attention_chunk",
})


def _differences(ours: Any, theirs: Any, key: str) -> list[str]:
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return [line for k in sorted(set(ours) | set(theirs))
                for line in _differences(ours.get(k), theirs.get(k), f"{key}.{k}")]
    if ours == theirs or key[len("model."):] in SPARTRON_ONLY_KEYS:
        return []
    return [f"{key}: the run has {ours!r}, the checkpoint {theirs!r}"]


def check_config_matches(run: ModelConfig, checkpoint: ModelConfig) -> None:
    """Raise HFConfigError naming every `model.*` key where a run's config computes another function
    than the checkpoint's (`SPARTRON_ONLY_KEYS` may differ): for starting a run from HF weights."""
    lines = _differences(run.model_dump(mode="json"), checkpoint.model_dump(mode="json"), "model")
    if lines:
        raise HFConfigError(f"the run's [model] differs from the Hugging Face checkpoint in {len(lines)} "
                            "setting(s): " + "; ".join(lines))


def hf_config_from_model_config(cfg: ModelConfig) -> dict[str, Any]:
    """The `config.json` dict of a Spartron model for transformers' DeepseekV3ForCausalLM (or V3.2 with DSA).

    Raises HFConfigError listing every Spartron setting the HF architecture cannot express.
    """
    problems = _Problems("Spartron [model] for Hugging Face")
    moe, mla = cfg.moe, cfg.mla
    if moe.score_func != "sigmoid":
        problems.add("model.moe.score_func", f"{moe.score_func!r}: DeepseekV3ForCausalLM routes with sigmoid")
    if cfg.norm_eps != 1e-6:
        problems.add("model.norm_eps", f"{cfg.norm_eps}: transformers' MLA latent norms use 1e-6")
    kind = V3
    if cfg.dsa is not None:
        kind = V32
        if cfg.dsa.layers != "all" or cfg.dsa.topk_freq != 1:
            problems.add("model.dsa.layers/topk_freq", "DeepSeek-V3.2 runs its own indexer in every layer: "
                         "layers = 'all', topk_freq = 1")
        if mla.q_lora_rank == 0:
            problems.add("model.mla.q_lora_rank", "DeepSeek-V3.2 needs a query latent (q_lora_rank > 0)")
        if cfg.dsa.share_indexer_across_mtp and cfg.mtp.depth > 1:
            problems.add("model.dsa.share_indexer_across_mtp", "every DeepSeek-V3.2 MTP layer has its own indexer")
    problems.raise_if_any()
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.dense_inter_dim,
        "moe_intermediate_size": moe.moe_inter_dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads,
        "n_shared_experts": moe.n_shared_experts, "n_routed_experts": moe.n_routed_experts,
        "routed_scaling_factor": moe.route_scale, "kv_lora_rank": mla.kv_lora_rank,
        "q_lora_rank": mla.q_lora_rank or None, "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim, "qk_nope_head_dim": mla.qk_nope_head_dim, "n_group": moe.n_groups,
        "topk_group": moe.topk_groups, "num_experts_per_tok": moe.top_k, "first_k_dense_replace": cfg.first_k_dense,
        "norm_topk_prob": moe.norm_topk_prob, "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std, "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": mla.rope_theta, "attention_bias": False, "attention_dropout": 0.0,
        "num_nextn_predict_layers": cfg.mtp.depth, "torch_dtype": cfg.stored_dtype,  # the tensors' (fp32 masters)
        "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "aux_loss_alpha": moe.aux_loss_coeff, "seq_aux": moe.aux_loss_type == "seq",
    }
    if kind == V3:
        hf["rope_interleave"] = True
    if mla.yarn is not None:
        hf["rope_scaling"] = {"type": "yarn", "rope_type": "yarn", **mla.yarn.model_dump()}
    if cfg.dsa is not None:
        hf.update(index_n_heads=cfg.dsa.n_index_heads, index_head_dim=cfg.dsa.index_head_dim,
                  index_topk=cfg.dsa.index_topk)
    return hf


def model_config_from_toml(text: str) -> ModelConfig:
    """ModelConfig from TOML text holding a `[model]` section (a run config or `model_toml`'s output)."""
    data = tomllib.loads(text)
    if "model" not in data:
        raise HFConfigError("the TOML has no [model] section")
    return ModelConfig.model_validate(data["model"])
