"""Token data: deterministic synthetic stream, mmap files, dp sharding, resume by position."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spartron.runtime.config import ConfigError, DataConfig
from spartron.runtime.data import MmapTokens, SyntheticTokens, TokenLoader, build_loader


def test_synthetic_samples_are_deterministic_and_seeded():
    a, b = SyntheticTokens(100, 16, seed=1), SyntheticTokens(100, 16, seed=1)
    assert torch.equal(a.sample(7), b.sample(7))
    assert not torch.equal(a.sample(7), a.sample(8))
    assert not torch.equal(a.sample(7), SyntheticTokens(100, 16, seed=2).sample(7))
    s = a.sample(3)
    assert s.shape == (17,) and s.dtype == torch.long and 0 <= s.min() and s.max() < 100


def test_synthetic_stream_follows_its_permutation_except_noise():
    src = SyntheticTokens(50, 400, seed=0)
    s = src.sample(0).tolist()
    follows = sum(src.perm[s[t]] == s[t + 1] for t in range(400)) / 400
    assert 0.8 < follows < 0.95  # 1 in 8 tokens is noise


def test_labels_are_tokens_shifted_by_one():
    loader = TokenLoader(SyntheticTokens(100, 8, 0), dp_rank=0, dp_size=1)
    tokens, labels = loader.next_batch(2)
    assert tokens.shape == labels.shape == (2, 8)
    assert torch.equal(tokens[:, 1:], labels[:, :-1])


def test_dp_ranks_read_disjoint_interleaved_samples():
    src = SyntheticTokens(100, 8, 0)
    single = TokenLoader(src, 0, 1).next_batch(4)[0]
    r0, r1 = TokenLoader(src, 0, 2).next_batch(2)[0], TokenLoader(src, 1, 2).next_batch(2)[0]
    assert torch.equal(torch.stack([r0[0], r1[0], r0[1], r1[1]]), single)


def test_resume_from_state_dict_continues_the_stream():
    src = SyntheticTokens(100, 8, 0)
    a = TokenLoader(src, 1, 2)
    a.next_batch(3)
    state = a.state_dict()
    expected = a.next_batch(2)
    b = TokenLoader(src, 1, 2)
    b.load_state_dict(state)
    assert state == {"position": 3, "dp_rank": 1, "dp_size": 2, "source": "synthetic"}
    assert all(torch.equal(x, y) for x, y in zip(b.next_batch(2), expected, strict=True))
    with pytest.raises(ValueError, match="saved by dp rank 1 of 2, cannot resume it on dp rank 0 of 2"):
        TokenLoader(src, 0, 2).load_state_dict(state)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_mmap_tokens_pack_fixed_length_samples_and_wrap(tmp_path, dtype):
    path = tmp_path / "tokens.bin"
    np.arange(25, dtype=dtype).tofile(path)
    src = MmapTokens(path, dtype, seq_len=8, vocab_size=100)
    assert src.n_samples == 3
    assert src.sample(0).tolist() == list(range(0, 9))
    assert src.sample(2).tolist() == list(range(16, 25))
    assert src.sample(3).tolist() == list(range(0, 9))  # next epoch
    loader = build_loader(DataConfig(kind="mmap", path=str(path), token_dtype=dtype), 100, 8, 0, 1, 2)
    tokens, labels = loader.next_batch(1)
    assert tokens.tolist() == [list(range(8, 16))] and labels.tolist() == [list(range(9, 17))]


def test_mmap_errors_name_the_config_keys(tmp_path):
    with pytest.raises(ConfigError, match="train.data.path .* does not exist"):  # one line, exit 2 in the CLI
        MmapTokens(tmp_path / "missing.bin", "uint16", 8, 100)
    small = tmp_path / "small.bin"
    np.arange(5, dtype=np.uint16).tofile(small)
    with pytest.raises(ValueError, match="holds 5 tokens, fewer than train.seq_len"):
        MmapTokens(small, "uint16", 8, 100)
    big = tmp_path / "big.bin"
    np.arange(40, dtype=np.uint16).tofile(big)
    with pytest.raises(ValueError, match="token id 39 >= model.vocab_size 30"):
        MmapTokens(big, "uint16", 8, 30)
