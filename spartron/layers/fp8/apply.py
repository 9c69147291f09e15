"""apply_fp8: switch the chosen modules of a model's blocks to FP8 compute (model.fp8).

Runs before AC, compile and FSDP2 (parallelize calls it first). Converts in place by class swap:
parameter names, dtypes and saved state do not change, so a bf16 run resumes in FP8 and back.
What stays in model.dtype, by design (DeepSeek-V3 and Megatron's recipe alike): attention's core
(softmax(QK^T)V, DSA's indexer scores), the router, embeddings, the LM head (outside the blocks),
norms, and any linear with a dim that is not a multiple of 128 (MLA's kv down-projection, 576 wide).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from spartron.configbase import ConfigError
from spartron.layers.config import FP8Config
from spartron.layers.ffn import FeedForward
from spartron.layers.fp8.modules import FP8FeedForward, FP8GroupedExperts, FP8Linear
from spartron.layers.fp8.weight_cache import WeightCache, clear_after_load
from spartron.layers.fp8.wire import FP8Wire
from spartron.layers.moe.dispatch import AllToAllDispatcher, DeepEPDispatcher
from spartron.layers.moe.experts import GroupedExperts
from spartron.layers.moe.router import Router


def check_backend(backend: str) -> None:
    """Raise ConfigError naming model.fp8.backend when this machine cannot run it (no fallback)."""
    if backend == "reference":
        return
    if not torch.cuda.is_available():
        raise ConfigError(f"model.fp8.backend = {backend!r} runs on a CUDA GPU (Hopper) and torch.cuda is not "
                         "available: use backend 'reference' on CPU")
    major, minor = torch.cuda.get_device_capability()
    try:
        import triton  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"model.fp8.backend = {backend!r} needs triton (pip install triton): {err}") from None
    if backend == "triton" and major < 9:
        raise ConfigError(f"model.fp8.backend = 'triton' needs FP8 tensor cores (compute capability >= 9.0), "
                         f"this GPU is {major}.{minor}")
    if backend == "deep_gemm" and (major, minor) != (9, 0):
        raise ConfigError(f"model.fp8.backend = 'deep_gemm' runs DeepGEMM's sm90 kernels (fp32 block scales), this "
                          f"GPU is {major}.{minor}: use backend 'triton'")
    if backend == "torch_scaled_mm":
        import torch.nn.functional as F
        if not hasattr(F, "scaled_mm") or not hasattr(F.ScalingType, "BlockWise128x128"):
            raise ConfigError(f"model.fp8.backend = {backend!r} needs torch.nn.functional.scaled_mm with "
                             f"ScalingType.BlockWise128x128 (torch >= 2.9), this is torch {torch.__version__}: "
                             "install a newer torch or use backend 'triton'")
        if (major, minor) != (9, 0):
            raise ConfigError(f"model.fp8.backend = {backend!r}: cuBLASLt's blockwise scaling runs on sm90 "
                             f"(Hopper) only, this GPU is {major}.{minor}: use backend 'triton'")
    if backend == "deep_gemm":
        check_deep_gemm()


def check_deep_gemm() -> None:
    """DeepGEMM (github.com/deepseek-ai/DeepGEMM, an optional extra) importable with the grouped GEMM used."""
    try:
        import deep_gemm
    except ImportError as err:
        raise ConfigError("model.fp8.backend = 'deep_gemm' needs DeepGEMM (build it from github.com/deepseek-ai/"
                          f"DeepGEMM: benchmarks/build_deep_gemm.sh) or another backend: {err}") from None
    if not hasattr(deep_gemm, "m_grouped_fp8_gemm_nt_contiguous"):
        raise ConfigError("model.fp8.backend = 'deep_gemm': this DeepGEMM has no m_grouped_fp8_gemm_nt_contiguous "
                          f"(version {getattr(deep_gemm, '__version__', '?')}; 2.x has it)")
    extension = getattr(getattr(deep_gemm, "_C", None), "__file__", None)
    if extension and b"libstdc++.so" not in Path(extension).read_bytes():
        raise ConfigError(f"model.fp8.backend = 'deep_gemm': {extension} carries its own libstdc++ (built by a g++ "
                          "that links it statically); beside torch's shared one its first GEMM segfaults: rebuild it "
                          "with the system g++ (benchmarks/build_deep_gemm.sh)")


def dense_eligible(module: nn.Module) -> bool:
    return (type(module) is nn.Linear and module.bias is None and module.in_features % 128 == 0
            and module.out_features % 128 == 0)


def ffn_eligible(module: nn.Module, backend: str) -> bool:
    """A SwiGLU FeedForward whose three linears are FP8-eligible, on a backend that runs one group of the experts'
    fused ops without reading its count on the host ("torch_scaled_mm" would: its FFNs stay three FP8Linear on its
    one-GEMM dense path)."""
    return (type(module) is FeedForward and backend != "torch_scaled_mm"
            and all(dense_eligible(lin) for lin in (module.w1, module.w3, module.w2)))


def weight_cache_on(cfg: FP8Config, compiled: bool, expert_shards: int) -> bool:
    """model.fp8.weight_cache resolved. "auto" caches where it costs a bf16 copy's bytes at most and
    saves re-quantising: experts whole on the rank (expert_shards = expert_fsdp = 1; sharded, the
    cache would hold every unsharded expert of every layer between steps, which FSDP2 frees after
    use) and eager blocks (the cache is Python state a compiled graph would specialise on)."""
    if cfg.weight_cache == "on" and compiled:
        raise ConfigError("model.fp8.weight_cache = 'on' with train.compile = true: the cache is not traced "
                          "into compiled blocks; use 'auto' or 'off'")
    return cfg.weight_cache == "on" or (cfg.weight_cache == "auto" and not compiled and expert_shards == 1)


def param_gather_refusal(compiled: bool, fsdp_shards: int | None = None) -> str | None:
    """Why model.fp8.param_gather cannot run, or None: compiled blocks (FSDP2's all-gather extension and the
    gathered weight are not traced), no FSDP2 sharding of the dense blocks (nothing is all-gathered; `fsdp_shards`
    None: not known yet, as when the run config loads)."""
    if compiled:
        return ("model.fp8.param_gather = true with train.compile = true: the FP8 all-gather's weights are not "
                "traced into compiled blocks; set train.compile = false or model.fp8.param_gather = false")
    if fsdp_shards is not None and fsdp_shards < 2:
        return (f"model.fp8.param_gather = true needs FSDP2 sharding over more than one rank (the fsdp group has "
                f"{fsdp_shards}): nothing is all-gathered; set model.fp8.param_gather = false")
    return None


def check_param_gather(compiled: bool, fsdp_shards: int) -> None:
    """param_gather_refusal as an error."""
    refusal = param_gather_refusal(compiled, fsdp_shards)
    if refusal:
        raise ConfigError(refusal)


def apply_fp8(blocks: list[nn.Module], cfg: FP8Config, compiled: bool = False, expert_shards: int = 1) -> list[str]:
    """Convert the chosen modules inside `blocks` (nn.Modules); returns their qualified names
    (block index, then the module path), in order. Converting nothing is an error naming
    model.fp8.modules (a pipeline stage of dense layers with modules = ["experts"] included).
    `compiled` (train.compile) and `expert_shards` (the expert_fsdp size) resolve model.fp8.weight_cache;
    a cached module's owner must call weight_cache.invalidate_weight_caches after each optimizer step."""
    check_backend(cfg.backend)
    cache = weight_cache_on(cfg, compiled, expert_shards)
    converted = []
    for index, block in enumerate(blocks):
        routers = [m for m in block.modules() if isinstance(m, Router)]
        skip = {id(p) for r in routers for p in r.modules()}
        for name, module in block.named_modules():
            if id(module) in skip:
                continue
            if "experts" in cfg.modules and type(module) is GroupedExperts:
                module.__class__ = FP8GroupedExperts
                if cache:
                    module.fp8_cache = WeightCache()
                    module.register_load_state_dict_post_hook(clear_after_load)
            elif "dense" in cfg.modules and ffn_eligible(module, cfg.backend):
                module.__class__ = FP8FeedForward  # its linears run inside its fused ops: not converted again
                skip |= {id(m) for m in module.modules()}
            elif "dense" in cfg.modules and dense_eligible(module):
                module.__class__ = FP8Linear
            else:
                continue
            module.fp8_backend, module.fp8_pow2 = cfg.backend, cfg.power_of_two_scales
            module.fp8_wgrad = cfg.wgrad == "fp8"
            converted.append(f"{index}.{name}")
    if cfg.dispatch:
        install_wire(blocks, cfg.backend)
    if not converted:  # FP8 asked for and nothing in FP8: a run that is bf16 while it claims FP8
        raise ConfigError(f"model.fp8.modules = {cfg.modules} converts nothing in these blocks: no routed experts "
                         "and no bias-free nn.Linear with both dims multiples of 128 (model.dim, "
                         "model.dense_inter_dim, the MLA ranks and head dims)")
    return converted


def install_wire(blocks: list[nn.Module], backend: str) -> None:
    """model.fp8.dispatch: every MoE layer's dispatcher sends its rows as FP8 (spartron.layers.fp8.wire). A
    dispatcher that moves no rows (one EP rank: the local dispatcher) is an error naming the key, on any path
    that builds the layers (the run config refuses the same layouts when it loads)."""
    for block in blocks:
        for module in block.modules():
            dispatcher = getattr(module, "dispatcher", None)
            if dispatcher is None:
                continue
            if not isinstance(dispatcher, (AllToAllDispatcher, DeepEPDispatcher)):
                raise ConfigError(f"model.fp8.dispatch = true needs a dispatcher that moves rows between more than "
                                  f"one EP rank; this MoE layer has {type(dispatcher).__name__}")
            dispatcher.wire = FP8Wire(backend)
