"""benchmarks/dsa_id_overlap.py: the reuse factor and adjacent overlap of DSA selections, on ids worked by hand."""

from __future__ import annotations

import pytest
import torch


def test_overlap_stats_on_hand_made_ids():
    from benchmarks.dsa_id_overlap import overlap_stats

    # K = 2; query 0 has one visible key; queries 1..4 hold full top-k sets
    ids = torch.tensor([[[0, -1], [0, 1], [0, 1], [1, 2], [2, 3]]], dtype=torch.int32)
    stats = overlap_stats(ids)
    assert stats["queries_with_full_topk"] == 4
    # groups of 2: {01, 01} -> 4 ids / 2 distinct, {12, 23} -> 4 / 3; groups of 4: 8 / 4; no group of 8 fits
    assert stats["reuse_factor_g2"] == pytest.approx((2 + 4 / 3) / 2)
    assert stats["reuse_factor_g4"] == pytest.approx(2.0)
    assert "reuse_factor_g8" not in stats
    # adjacent pairs: 01|01 -> 2/2, 12|01 -> 1/3, 23|12 -> 1/3
    assert stats["adjacent_jaccard"] == pytest.approx((1 + 2 / 3) / 3)


def test_identical_and_disjoint_selections_bound_the_factor():
    from benchmarks.dsa_id_overlap import overlap_stats

    same = torch.tensor([[[5, 7]] * 9], dtype=torch.int32)
    disjoint = torch.arange(18, dtype=torch.int32).view(1, 9, 2)
    assert overlap_stats(same)["reuse_factor_g8"] == pytest.approx(8.0)
    assert overlap_stats(same)["adjacent_jaccard"] == pytest.approx(1.0)
    assert overlap_stats(disjoint)["reuse_factor_g4"] == pytest.approx(1.0)
    assert overlap_stats(disjoint)["adjacent_jaccard"] == 0.0


def test_random_baseline_matches_random_selections():
    from benchmarks.dsa_id_overlap import overlap_stats, random_baseline

    s, k = 512, 64
    gen = torch.Generator().manual_seed(0)
    ids = torch.full((1, s, k), -1, dtype=torch.int32)
    for t in range(k - 1, s):
        ids[0, t] = torch.randperm(t + 1, generator=gen)[:k].sort().values.int()
    measured, expected = overlap_stats(ids), random_baseline(s, k)
    assert set(expected) == {"reuse_factor_g2", "reuse_factor_g4", "reuse_factor_g8", "adjacent_jaccard"}
    for key, value in expected.items():
        assert measured[key] == pytest.approx(value, rel=0.03), key
    # by hand, K = 2 over 3 keys: query 1 takes {0, 1}, query 2 two of {0, 1, 2}: E[distinct] = 2 + 2/3,
    # E[shared] = 2 * 2/3 (each of keys 0, 1 with probability 2/3), E[union] = 4 - 4/3
    small = random_baseline(3, 2)
    assert small["reuse_factor_g2"] == pytest.approx(4 / (8 / 3))
    assert small["adjacent_jaccard"] == pytest.approx((4 / 3) / (8 / 3))
