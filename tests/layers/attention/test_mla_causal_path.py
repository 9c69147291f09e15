"""Dense MLA takes SDPA's is_causal path whenever its keys are the local tokens in order, including
with a 1-rank CP group (what the Trainer passes on one GPU): an explicit [S, S] mask there is the
same function but runs cuDNN's masked kernel, 3-4x slower on the H200 (benchmarks/results/attention/)."""

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from spartron.layers.attention.mla import MLA
from spartron.layers.config import ModelConfig
from spartron.testing import run_distributed


class _SDPACalls(TorchFunctionMode):
    """Records (is_causal, has attn_mask) of every F.scaled_dot_product_attention call."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[bool, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls.append((bool(kwargs.get("is_causal", False)), kwargs.get("attn_mask") is not None))
        return func(*args, **kwargs)


def _cfg() -> ModelConfig:
    return ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, first_k_dense=2, dense_inter_dim=64,
                       max_seq_len=16, mla={"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
                                            "v_head_dim": 8})


def _run(cp_group) -> tuple[torch.Tensor, list]:
    torch.manual_seed(0)
    layer = MLA(_cfg(), 0, cp_group)
    x = torch.randn(2, 16, 32)
    with _SDPACalls() as mode:
        out = layer(x, torch.arange(16))["hidden_states"]
    return out, mode.calls


def _one_rank_group(rank, world):
    import torch.distributed as dist

    group = dist.new_group([0])
    out, calls = _run(group)
    ref, ref_calls = _run(None)
    return out.detach(), calls, ref.detach(), ref_calls


def test_one_rank_cp_group_runs_the_causal_kernel_with_no_mask():
    out, calls, ref, ref_calls = run_distributed(_one_rank_group, 1)[0]
    assert ref_calls == [(True, False)]
    assert calls == [(True, False)]
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
