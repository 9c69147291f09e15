"""Token data: a synthetic deterministic stream (default) and memory-mapped token files.

Both are indexed by a GLOBAL sample index, and data-parallel rank r of n reads samples r, r+n,
r+2n, ...: a sample depends only on (source, seed, global index), so a run is reproducible for a
given dp size and resumable from a single integer position (no iterator state to pickle).

Context-parallel ranks of one dp rank receive the SAME full sequences; the model splits the
sequence dimension across CP ranks (load-balanced for causal attention) itself.

Each sample is seq_len + 1 consecutive tokens packed without padding; tokens = sample[:-1],
labels = sample[1:].
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from spartron.runtime.config import DataConfig


class SyntheticTokens:
    """Learnable synthetic sequences: a random walk on a fixed random permutation of the vocabulary
    (token t+1 = perm[token t], perm drawn once from the seed), with 1 token in 8 replaced by noise.
    A model that learns the bigram drops the loss from log(vocab) towards the noise entropy.

    Sample g comes from its own generator seeded by (seed, g): position-addressable, no state.
    """

    noise_rate = 0.125

    def __init__(self, vocab_size: int, seq_len: int, seed: int) -> None:
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.perm = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
        self._next = self.perm.tolist()

    def sample(self, index: int) -> Tensor:
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + index + 1) % (2**63))
        noise = torch.randint(self.vocab_size, (self.seq_len + 1,), generator=gen)
        noisy = (torch.rand(self.seq_len + 1, generator=gen) < self.noise_rate).tolist()
        noise_list = noise.tolist()
        out = [noise_list[0]]
        for t in range(1, self.seq_len + 1):
            out.append(noise_list[t] if noisy[t] else self._next[out[-1]])
        return torch.tensor(out, dtype=torch.long)


class MmapTokens:
    """A flat binary file of token ids (uint16/uint32, e.g. written by numpy.tofile), memory-mapped.

    Sample g is tokens[k*seq_len : k*seq_len + seq_len + 1] with k = g mod (number of samples), so
    the stream wraps around the file (epochs) deterministically.
    """

    def __init__(self, path: str | Path, token_dtype: str, seq_len: int, vocab_size: int) -> None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"train.data.path {str(path)!r} does not exist")
        self.tokens = np.memmap(path, dtype=np.dtype(token_dtype), mode="r")
        self.seq_len = seq_len
        self.n_samples = (len(self.tokens) - 1) // seq_len
        if self.n_samples < 1:
            raise ValueError(f"train.data.path {str(path)!r} holds {len(self.tokens)} tokens, fewer than "
                             f"train.seq_len + 1 = {seq_len + 1}")
        head_max = int(self.tokens[: min(len(self.tokens), 1 << 20)].max())
        if head_max >= vocab_size:
            raise ValueError(f"train.data.path {str(path)!r} contains token id {head_max} >= "
                             f"model.vocab_size {vocab_size} (wrong train.data.token_dtype or vocabulary?)")

    def sample(self, index: int) -> Tensor:
        k = index % self.n_samples
        chunk = np.asarray(self.tokens[k * self.seq_len: k * self.seq_len + self.seq_len + 1], dtype=np.int64)
        return torch.from_numpy(chunk)


class TokenLoader:
    """Batches of (tokens, labels) [B, seq_len] for one data-parallel rank, resumable by position."""

    def __init__(self, source: SyntheticTokens | MmapTokens, dp_rank: int, dp_size: int) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} must be in [0, {dp_size})")
        self.source, self.dp_rank, self.dp_size = source, dp_rank, dp_size
        self.position = 0  # samples already consumed by this rank

    def next_batch(self, batch_size: int) -> tuple[Tensor, Tensor]:
        indices = [(self.position + i) * self.dp_size + self.dp_rank for i in range(batch_size)]
        self.position += batch_size
        samples = torch.stack([self.source.sample(g) for g in indices])
        return samples[:, :-1].contiguous(), samples[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"position": self.position, "dp_rank": self.dp_rank, "dp_size": self.dp_size}

    def load_state_dict(self, state: dict) -> None:
        if (state["dp_rank"], state["dp_size"]) != (self.dp_rank, self.dp_size):
            raise ValueError(f"data state was saved by dp rank {state['dp_rank']} of {state['dp_size']}, "
                             f"cannot resume it on dp rank {self.dp_rank} of {self.dp_size}")
        self.position = int(state["position"])


def build_loader(cfg: DataConfig, vocab_size: int, seq_len: int, seed: int, dp_rank: int,
                 dp_size: int) -> TokenLoader:
    if cfg.kind == "synthetic":
        source: SyntheticTokens | MmapTokens = SyntheticTokens(vocab_size, seq_len, seed)
    else:
        source = MmapTokens(cfg.path, cfg.token_dtype, seq_len, vocab_size)
    return TokenLoader(source, dp_rank, dp_size)
