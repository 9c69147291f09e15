"""FLOP model, expert-load statistic, memory, and the JSONL log."""

from __future__ import annotations

import json

import pytest
import torch

from spartron.layers.config import ModelConfig
from spartron.runtime.metrics import (
    MetricsLog,
    _mean_visible_keys,
    expert_load_max_violation,
    measure_peak_flops,
    peak_memory,
    read_metrics,
    training_flops_per_token,
)

TINY_DENSE = {"vocab_size": 10, "dim": 4, "n_layers": 1, "n_heads": 1, "first_k_dense": 1,
              "dense_inter_dim": 8,
              "mla": {"q_lora_rank": 0, "kv_lora_rank": 2, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2,
                      "v_head_dim": 2}}


def test_flops_of_a_dense_layer_by_hand():
    # attention matmul params: q 4*4 + kv_a 4*(2+2) + kv_b 2*(2+2) + o 2*4 = 48; ffn 3*4*8 = 96
    # 6 * (48 + 96) = 864; causal attention 3 * 2*(2+2+2) * (4+1)/2 = 90; head 6*4*10 = 240
    assert training_flops_per_token(ModelConfig(**TINY_DENSE), seq_len=4) == 864 + 90 + 240


def test_flops_of_moe_mtp_and_frozen_dsa_by_hand():
    cfg = ModelConfig(**{**TINY_DENSE, "first_k_dense": 0,
                         "moe": {"n_routed_experts": 4, "n_shared_experts": 1, "top_k": 2,
                                 "moe_inter_dim": 3},
                         "dsa": {"n_index_heads": 2, "index_head_dim": 2, "index_topk": 2},
                         "mtp": {"depth": 1}})
    moe = 3 * 3 * 4 * 3 + 4 * 4  # (top_k + shared) experts of 3*dim*inter, router dim x experts
    attn_params = 48
    indexer_params = 4 * 2 * 2 + 4 * 2 + 4 * 2  # q (q_lora 0: from x), k, head weights
    layer = 6 * (attn_params + moe) + 3 * 12 * 1.75 + 2 * indexer_params + 2 * 2 * 2 * 2.5
    head = 6 * 4 * 10
    expected = layer + head + (layer + 6 * 2 * 4 * 4 + head)
    assert training_flops_per_token(cfg, seq_len=4) == pytest.approx(expected)


def test_mean_visible_keys_matches_brute_force():
    for seq, cap in [(4, 2), (7, 3), (5, None), (5, 9)]:
        brute = sum(min(cap or 10**9, t + 1) for t in range(seq)) / seq
        assert _mean_visible_keys(seq, cap) == pytest.approx(brute)


def test_expert_load_violation():
    assert expert_load_max_violation(torch.tensor([[2, 2, 2, 2]])) == 0.0
    assert expert_load_max_violation(torch.tensor([[4, 2, 1, 1], [2, 2, 2, 2]])) == 1.0
    assert expert_load_max_violation(None) is None


def test_peak_memory_and_measured_peak_leave_rng_alone():
    alloc, reserved = peak_memory(torch.device("cpu"))
    assert alloc == reserved > 10 * 2**20  # the RSS of a process that imported torch
    state = torch.get_rng_state()
    assert measure_peak_flops(torch.device("cpu"), torch.float32) > 1e6
    assert torch.equal(state, torch.get_rng_state())


def test_log_appends_jsonl_and_reader_keeps_last_record_per_step(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    rec = {"type": "step", "loss": 1.0, "grad_norm": 0.5, "tokens_per_s": 10.0}
    log = MetricsLog(path, 3, enabled=True, progress=False)
    log.write({"type": "header", "n": 1})
    log.write({**rec, "step": 1})
    log.write({**rec, "step": 2})
    log.close(summary=False)
    with path.open("a") as f:
        f.write('{"type": "step", "step": 3, "lo')  # a process killed mid-write
    log = MetricsLog(path, 3, enabled=True, progress=False)  # resumed after step 1
    log.write({"type": "header", "n": 2})
    log.write({**rec, "step": 2, "loss": 2.0})
    log.close(summary=False)
    lines = path.read_text().splitlines()
    assert [json.loads(x)["type"] for x in lines] == ["header", "step", "step", "header", "step"]
    headers, steps = read_metrics(path)
    assert [h["n"] for h in headers] == [1, 2]
    assert [(s["step"], s["loss"]) for s in steps] == [(1, 1.0), (2, 2.0)]


def test_disabled_log_writes_nothing(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl", 1, enabled=False)
    log.write({"type": "step", "step": 1})
    log.close()
    assert not (tmp_path / "m.jsonl").exists()


def test_git_commit_prefers_the_snapshot_marker_over_an_enclosing_checkout(tmp_path):
    import subprocess

    from spartron.runtime.metrics import git_commit

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x")
    head = git("rev-parse", "HEAD").strip()
    snap = tmp_path / "snap"
    snap.mkdir()
    assert git_commit(snap) == head  # no marker: the enclosing checkout's HEAD
    (snap / "BUILD_COMMIT").write_text("abc123\n")
    assert git_commit(snap) == "abc123"
    (snap / "BUILD_COMMIT").write_text("  \n")
    assert git_commit(snap) == head  # an empty marker is no marker
