"""FP8 training with DeepSeek-V3's blockwise recipe: quantisation, FP8 GEMM ops, the module switch.

spartron.layers.fp8.quant (the tilings, pure torch), .ops (the GEMM ops), .apply (apply_fp8).
The Triton backend is imported only when chosen. docs/FP8.md: what runs in FP8 and what it costs.
"""

from spartron.layers.fp8.apply import apply_fp8, check_backend
from spartron.layers.fp8.ops import grouped_mm, linear
from spartron.layers.fp8.weight_cache import invalidate_on_step, invalidate_weight_caches

__all__ = ["apply_fp8", "check_backend", "grouped_mm", "invalidate_on_step", "invalidate_weight_caches", "linear"]
