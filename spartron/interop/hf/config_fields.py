"""Types and sane bounds of every `config.json` field Spartron reads, checked before the field is used.

Why: a config.json is input from outside. Without these checks a string where an int belongs reaches
Python's TypeError, a bool passes as 1, a float as an int, and `hidden_size = 2**40` or 100000 layers
reach the model builder before anything compares them with the machine. The bounds are far above any
published DeepSeek model (V3: hidden 7168, 61 layers, 256 experts, 163840 positions) and far below sizes
that cannot be built. JSON's NaN / Infinity are refused where a float belongs.
"""

from __future__ import annotations

import math
from typing import Any

# field -> (lowest, highest, null allowed)
INT_FIELDS: dict[str, tuple[int, int, bool]] = {
    "vocab_size": (1, 2**22, False), "hidden_size": (1, 2**16, False), "intermediate_size": (1, 2**20, False),
    "moe_intermediate_size": (1, 2**20, False), "num_hidden_layers": (1, 1024, False),
    "num_attention_heads": (1, 1024, False), "num_key_value_heads": (1, 1024, True),
    "n_shared_experts": (0, 1024, False), "n_routed_experts": (1, 2**16, False), "kv_lora_rank": (1, 2**16, False),
    "q_lora_rank": (0, 2**16, True), "qk_rope_head_dim": (1, 4096, False), "qk_nope_head_dim": (0, 4096, False),
    "v_head_dim": (1, 4096, False), "head_dim": (1, 4096, True), "qk_head_dim": (1, 8192, True),
    "n_group": (1, 2**16, True), "topk_group": (1, 2**16, True), "num_experts_per_tok": (1, 2**16, False),
    "first_k_dense_replace": (0, 1024, False), "max_position_embeddings": (1, 2**24, False),
    "num_nextn_predict_layers": (0, 64, True), "moe_layer_freq": (1, 1024, False),
    "index_n_heads": (1, 1024, False), "index_head_dim": (1, 4096, False), "index_topk": (1, 2**24, False),
}
# field -> (lowest, highest); both inclusive
FLOAT_FIELDS: dict[str, tuple[float, float]] = {
    "rms_norm_eps": (0.0, 1.0), "rope_theta": (1.0, 1e12), "routed_scaling_factor": (0.0, 1e6),
    "initializer_range": (0.0, 10.0), "aux_loss_alpha": (0.0, 1e6), "attention_dropout": (0.0, 1.0),
}
BOOL_FIELDS = ("tie_word_embeddings", "norm_topk_prob", "seq_aux", "attention_bias", "mlp_bias", "rope_interleave")
STR_FIELDS = ("model_type", "hidden_act", "scoring_func", "topk_method", "dtype", "torch_dtype")
ROPE_INT = ("original_max_position_embeddings",)
ROPE_FLOAT = {"factor": (1e-6, 1e6), "beta_fast": (0.0, 1e6), "beta_slow": (0.0, 1e6), "mscale": (0.0, 1e6),
              "mscale_all_dim": (0.0, 1e6), "attention_factor": (0.0, 1e6), "rope_theta": (1.0, 1e12)}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _float_problem(v: Any, lo: float, hi: float) -> str | None:
    if not _is_number(v):
        return f"{v!r}: must be a number"
    if not math.isfinite(v) or not lo <= v <= hi:
        return f"{v!r}: must be a finite number in [{lo:g}, {hi:g}]"
    return None


def field_problems(hf: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, why) for every field of `hf` whose JSON type or value is out of bounds."""
    out = []
    for key, (lo, hi, nullable) in INT_FIELDS.items():
        if key in hf and not (hf[key] is None and nullable):
            v = hf[key]
            if not _is_int(v) or not lo <= v <= hi:
                out.append((key, f"{v!r}: must be an integer in {lo}..{hi}" + (" or null" if nullable else "")))
    for key, (lo, hi) in FLOAT_FIELDS.items():
        if key in hf:
            problem = _float_problem(hf[key], lo, hi)
            if problem:
                out.append((key, problem))
    out += [(key, f"{hf[key]!r}: must be true or false") for key in BOOL_FIELDS
            if key in hf and not isinstance(hf[key], bool)]
    out += [(key, f"{hf[key]!r}: must be a string") for key in STR_FIELDS
            if key in hf and hf[key] is not None and not isinstance(hf[key], str)]
    if hf.get("architectures") is not None and not (isinstance(hf["architectures"], list)
                                      and all(isinstance(a, str) for a in hf["architectures"])):
        out.append(("architectures", f"{hf['architectures']!r}: must be a list of strings or null"))
    for key in ("rope_scaling", "rope_parameters"):
        rope = hf.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            out.append((key, f"{rope!r}: must be a JSON object or null"))
            continue
        for sub in ROPE_INT:
            if rope.get(sub) is not None and (not _is_int(rope[sub]) or not 1 <= rope[sub] <= 2**24):
                out.append((f"{key}.{sub}", f"{rope[sub]!r}: must be an integer in 1..{2**24}"))
        for sub, (lo, hi) in ROPE_FLOAT.items():
            if rope.get(sub) is not None:
                problem = _float_problem(rope[sub], lo, hi)
                if problem:
                    out.append((f"{key}.{sub}", problem))
        for sub in ("type", "rope_type"):
            if rope.get(sub) is not None and not isinstance(rope[sub], str):
                out.append((f"{key}.{sub}", f"{rope[sub]!r}: must be a string"))
        if "truncate" in rope and not isinstance(rope["truncate"], bool):
            out.append((f"{key}.truncate", f"{rope['truncate']!r}: must be true or false"))
    return out


# Fields that decide the tensors' shapes: transformers would fill a missing one with DeepSeek-V3's full size
# (hidden_size 7168, ...), and the error would then blame a tensor. Every config.json transformers writes has them.
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "n_shared_experts", "n_routed_experts", "num_experts_per_tok",
            "first_k_dense_replace", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
            "v_head_dim")


def cross_field_problems(hf: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, why) for every field missing from REQUIRED or inconsistent with another, in config.json's own
    terms; for a dict whose fields passed `field_problems` (types and bounds)."""
    out = [(key, "missing (a required field: it decides the tensors' shapes)") for key in REQUIRED if key not in hf]
    experts, top_k = hf.get("n_routed_experts"), hf.get("num_experts_per_tok")
    groups, topk_groups = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if experts is not None and top_k is not None and top_k > experts:
        out.append(("num_experts_per_tok", f"{top_k}: must be <= n_routed_experts ({experts})"))
    if experts is not None and experts % groups:
        out.append(("n_group", f"{groups}: must divide n_routed_experts ({experts})"))
    if topk_groups > groups:
        out.append(("topk_group", f"{topk_groups}: must be <= n_group ({groups})"))
    elif experts is not None and top_k is not None and not experts % groups and groups > 1 \
            and experts >= top_k > topk_groups * (experts // groups):
        out.append(("num_experts_per_tok", f"{top_k}: exceeds the experts of topk_group ({topk_groups}) groups of "
                                           f"{experts // groups}"))
    layers, dense = hf.get("num_hidden_layers"), hf.get("first_k_dense_replace")
    if layers is not None and dense is not None and dense > layers:
        out.append(("first_k_dense_replace", f"{dense}: must be <= num_hidden_layers ({layers})"))
    rope = hf.get("qk_rope_head_dim")
    if rope is not None and rope % 2:
        out.append(("qk_rope_head_dim", f"{rope}: must be even (RoPE rotates pairs)"))
    return out
