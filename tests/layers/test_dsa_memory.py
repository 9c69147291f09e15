"""What a DSA layer holds for backward (issue 39: DSA held 19-37 GiB more than dense MLA at 32k-64k): under the
default selective-AC policy a kl_sparse source keeps its projections, the sparse attention's output and lse and the
[S, K] KL target and scores, nothing [S, H, 576]-wide (the absorbed query is recomputed) and nothing O(S^2); without
AC its saved tensors grow linearly in S too. Gradients are the ones the previous policy (absorbed projections kept)
and no AC give, bitwise."""

from __future__ import annotations

import pytest
import torch

from spartron.checkpointing import CheckpointOptions, CheckpointRegion, build_policy
from spartron.checkpointing.policy import DEFAULT_TARGETS
from spartron.layers.attention.mla import MLA
from spartron.layers.config import ModelConfig

DIM, H, NOPE, ROPE, V, LORA, HI, DI, K = 32, 4, 8, 8, 8, 16, 2, 16, 8


def make_layer(mode: str = "kl_sparse") -> MLA:
    cfg = ModelConfig.model_validate(dict(
        dim=DIM, n_heads=H, n_layers=2, first_k_dense=1,
        mla=dict(q_lora_rank=0, kv_lora_rank=LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V),
        dsa=dict(n_index_heads=HI, index_head_dim=DI, index_topk=K, indexer_mode=mode,
                 indexer_loss_coeff=0.0 if mode == "frozen" else 1.0)))
    torch.manual_seed(0)
    return MLA(cfg, 1).double()


def region_call(layer: MLA, s: int, targets=None) -> tuple[dict, CheckpointRegion, torch.Tensor]:
    region = CheckpointRegion(CheckpointOptions(policy=build_policy("selective", targets), name="dsa"))
    x = torch.randn(1, s, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(s), requires_grad=True)
    return region(lambda t: layer(t, torch.arange(s)), x), region, x


def test_selective_ac_keeps_o_s_k_per_source_and_no_absorbed_query():
    layer = make_layer()
    kept = {}
    for s in (32, 64):
        _, region, _ = region_call(layer, s)
        kept[s] = region.last_stats
    stats = kept[64]
    assert dict(stats.saved_by_op) == {"aten::mm": 6, "spartron::sparse_mla": 1, "spartron::kl_sparse_target": 1,
                                       "spartron::kl_selected_scores": 1}
    per_token = 8 * (H * (NOPE + ROPE) + LORA + ROPE + DIM  # wq, wkv_a, wo outputs
                     + HI * DI + DI + HI  # the indexer's wq_b, wk, weights_proj outputs
                     + H * LORA + H  # sparse attention: output [S, H, kv_lora] and lse
                     + 2 * K)  # the KL target and selected scores, [S, K] each
    assert stats.bytes_saved == 64 * per_token
    assert kept[32].bytes_saved * 2 == stats.bytes_saved  # linear in S: nothing [S, S]


def _saved_bytes_no_ac(layer: MLA, s: int) -> int:
    storages = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(1, s, DIM, dtype=torch.float64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, torch.arange(s))
    return sum(storages.values())


def test_without_ac_the_saved_bytes_grow_linearly_in_s():
    layer = make_layer()
    b1, b2, b4 = (_saved_bytes_no_ac(layer, s) for s in (32, 64, 128))
    assert b4 - b2 == 2 * (b2 - b1)  # no S^2 term (the parameters saved are the constant)


@pytest.mark.parametrize("mode", ["kl_sparse", "frozen"])
def test_gradients_equal_the_previous_policy_and_no_ac_bitwise(mode):
    layer = make_layer(mode)
    previous = [*DEFAULT_TARGETS, "spartron::absorb_query", "spartron::absorb_output"]

    def grads(run) -> list[torch.Tensor]:
        layer.zero_grad(set_to_none=True)
        out, x = run()
        loss = out["hidden_states"].square().sum() + (out["indexer_loss"] if out["indexer_loss"] is not None else 0)
        loss.backward()
        return [x.grad, *(p.grad for p in layer.parameters() if p.grad is not None)]

    def ac(targets):
        def run():
            out, _, x = region_call(layer, 48, targets)
            return out, x
        return run

    def plain():
        x = torch.randn(1, 48, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(48),
                        requires_grad=True)
        return layer(x, torch.arange(48)), x

    now, before, none = grads(ac(None)), grads(ac(previous)), grads(plain)
    assert len(now) == len(before) == len(none) == (6 if mode == "frozen" else 11)
    for a, b, c in zip(now, before, none, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_the_memory_plan_drops_the_sparse_attention_output_when_ac_targets_leave_it_out():
    import json
    from pathlib import Path

    from spartron.runtime.config import load_config
    from spartron.runtime.memory import plan_memory

    config = Path(__file__).parents[2] / "configs" / "dsa-4l.toml"
    base = ["model.mtp.depth=0", "train.seq_len=65536", "model.max_seq_len=65536", "model.n_heads=128",
            "model.dsa.indexer_mode=kl_sparse", "model.dsa.indexer_loss_coeff=0.01"]
    without = json.dumps([t for t in DEFAULT_TARGETS if t != "spartron::sparse_mla"])
    kept = plan_memory(load_config(config, base), 1, 0).parts["activations"]
    recomputed = plan_memory(load_config(config, [*base, f"ac.targets={without}"]), 1, 0).parts["activations"]
    assert kept - recomputed == 3 * 65536 * 128 * (512 * 2 + 4)  # 3 DSA layers: output [T, H, 512] bf16 + lse


@pytest.mark.parametrize("mode, held", [("frozen", True), ("kl_sparse", True), ("kl_dense", True)])
def test_the_memory_plan_counts_the_replayed_top_k_ids_under_full_ac(mode, held):
    """A frozen / kl_sparse source's ids sit in a replay frame (reuse_during_recompute) from the forward to the
    replay, full AC included; kl_dense's are an output of its chunked KL op, MANDATORY in the AC policy: kept
    under full AC too."""
    from pathlib import Path

    from spartron.layers.attention.dsa import dsa_schedule
    from spartron.runtime.config import load_config
    from spartron.runtime.memory import plan_memory

    tiny = Path(__file__).parents[2] / "configs" / "tiny.toml"
    coeff = 0.0 if mode == "frozen" else 0.5
    base = ["ac.mode=full", f"model.dsa.indexer_mode={mode}", f"model.dsa.indexer_loss_coeff={coeff}"]
    plans = [load_config(tiny, [*base, f"model.dsa.index_topk={k}"]) for k in (16, 32)]
    sources = sum(role == "source" for role in dsa_schedule(plans[0].model))
    assert sources == 3  # layers 1 and 3, MTP depth 1 (depth 2 shares its block)
    small, large = (plan_memory(cfg, 1, 0).parts["activations"] for cfg in plans)
    assert large - small == (sources * 64 * (32 - 16) * 4 if held else 0)  # [T=64, K] int32 per source
