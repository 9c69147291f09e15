"""Routed experts: the E_local SwiGLU experts of this EP rank as stacked weights.

Weights are stored [E_local, out, in] (w1, w3: [E, inter, dim]; w2: [E, dim, inter]), i.e. each
expert's slice is a Linear weight. The grouped GEMM reads them through a transposed view, which
is the column-major right operand the CUDA `_grouped_mm` kernel wants, without a copy.

Two compute paths, chosen by `model.moe.grouped_mm`:
- "grouped": `torch._grouped_mm` over the tokens grouped contiguously by expert, with offsets =
  cumulative token counts. CUDA (bf16) and, since torch 2.9, CPU; needs 16-byte aligned rows.
- "loop": one `F.linear` per expert on its slice of rows: exact, works everywhere.
- "auto": "grouped" for CUDA bfloat16 inputs, "loop" otherwise (deterministic: never decided by
  catching an error).
The `experts` submodule of MoELayer is an instance of this class; parallelize shards every
parameter of a `GroupedExperts` over the expert mesh (`expert_fsdp`), everything else over the
dense mesh. Local expert i is global expert `first_expert + i`, which is what its initial value
depends on (spartron.layers.init), so EP ranks start from the 1-rank model's experts, not copies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spartron.comm.collectives import splits_to_host
from spartron.layers.init import init_parameters_
from spartron.layers.moe.dispatch import GatheredRows
from spartron.layers.swiglu import swiglu


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


class GroupedExperts(nn.Module):
    is_expert_module = True  # marker read by parallelize: shard over the expert mesh

    def __init__(self, n_local_experts: int, dim: int, inter_dim: int, mode: str = "auto",
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 init_std: float = 0.02, first_expert: int = 0):
        super().__init__()
        if mode not in ("auto", "grouped", "loop"):
            raise ValueError(f"model.moe.grouped_mm must be auto, grouped or loop, got {mode!r}")
        if mode == "grouped" and not grouped_mm_available():
            raise ValueError(f"model.moe.grouped_mm = 'grouped' needs torch._grouped_mm (torch >= 2.9), "
                             f"this is torch {torch.__version__}; use 'loop' or 'auto'")
        self.mode = mode
        self.init_std = init_std
        self.n_local_experts = n_local_experts
        self.first_expert = first_expert
        factory = {"dtype": dtype, "device": device}
        self.w1 = nn.Parameter(torch.empty(n_local_experts, inter_dim, dim, **factory))
        self.w3 = nn.Parameter(torch.empty(n_local_experts, inter_dim, dim, **factory))
        self.w2 = nn.Parameter(torch.empty(n_local_experts, dim, inter_dim, **factory))
        self.reset_parameters()

    def reset_parameters(self, seed: int = 0, prefix: str = "") -> None:
        init_parameters_(self, seed, self.init_std, prefix)

    def resolved_mode(self, x: Tensor) -> str:
        if self.mode != "auto":
            return self.mode
        return "grouped" if (grouped_mm_available() and x.is_cuda and x.dtype == torch.bfloat16) else "loop"

    def forward(self, x: Tensor, tokens_per_expert: Tensor | list[int], order: Tensor | None = None,
                inverse: Tensor | None = None, k: int = 1) -> Tensor:
        """x [N, dim] with rows grouped by local expert (counts `tokens_per_expert` [E_local]), or with
        `order` (a GatheredRows plan's: `inverse`, `k`) the rows are x[order // k], written out here (the
        FP8 experts read them in place instead). The plan comes as tensors, not as a GatheredRows: FSDP2
        finds the input that needs a gradient among the forward's tensor arguments (its post-backward hook)."""
        if order is not None:
            x = GatheredRows(x, order, inverse, k).materialize()
        if len(tokens_per_expert) != self.n_local_experts:
            raise ValueError(f"GroupedExperts: tokens_per_expert has {len(tokens_per_expert)} entries for "
                             f"{self.n_local_experts} local experts")
        if self.resolved_mode(x) == "grouped":
            return self._grouped(x, tokens_per_expert)
        return self._loop(x, tokens_per_expert)

    def _loop(self, x: Tensor, tokens_per_expert: Tensor | list[int]) -> Tensor:
        counts = tokens_per_expert
        if isinstance(counts, Tensor):
            counts = splits_to_host(counts)
        if torch.compiler.is_compiling():  # host counts are unbacked SymInts here: a runtime assert
            torch._check(sum(counts) == x.shape[0], lambda: "GroupedExperts: tokens_per_expert sum != rows")
        elif sum(counts) != x.shape[0]:
            raise ValueError(f"GroupedExperts: tokens_per_expert sums to {sum(counts)}, "
                             f"x has {x.shape[0]} rows")
        outs = []
        for e, rows in enumerate(torch.split(x, list(counts))):
            h = F.silu(F.linear(rows, self.w1[e])) * F.linear(rows, self.w3[e])
            outs.append(F.linear(h, self.w2[e]))
        return torch.cat(outs)

    def _grouped(self, x: Tensor, tokens_per_expert: Tensor | list[int]) -> Tensor:
        for name, size in (("dim", self.w1.shape[2]), ("inter_dim", self.w1.shape[1])):
            if (size * x.element_size()) % 16:
                raise ValueError(f"model.moe.grouped_mm = 'grouped' needs 16-byte aligned rows: {name} "
                                 f"{size} x {x.element_size()} bytes is not a multiple of 16; use 'loop'")
        w1, w3, w2 = self.w1, self.w3, self.w2
        if torch.is_autocast_enabled(x.device.type):  # autocast does not cover _grouped_mm: cast like linear
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w1, w3, w2 = (t.to(dtype) for t in (x, w1, w3, w2))
        if x.dtype != w1.dtype:
            raise ValueError(f"GroupedExperts: input dtype {x.dtype} differs from expert weights "
                             f"{w1.dtype}")
        counts = torch.as_tensor(tokens_per_expert, device=x.device)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        try:
            h = swiglu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs),
                       torch._grouped_mm(x, w3.transpose(-2, -1), offs=offs), inplace_backward=True)
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
        except (RuntimeError, NotImplementedError) as err:
            raise RuntimeError(f"torch._grouped_mm failed for {x.dtype} on {x.device} (torch "
                               f"{torch.__version__}); set model.moe.grouped_mm = 'loop' to use the "
                               f"per-expert path: {err}") from err
