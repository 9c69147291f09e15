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

from spartron.runtime.config import ConfigError, DataConfig


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


# How much of a token file the vocabulary check reads: the head, and windows spread over the whole
# file (a file read with the wrong dtype, or a corrupt tail, shows ids >= vocab_size somewhere).
_HEAD_TOKENS = 1 << 20
_WINDOWS, _WINDOW_TOKENS = 64, 1 << 16


def check_token_file(path: str | Path, token_dtype: str, seq_len: int, vocab_size: int) -> np.memmap:
    """Open a token file after checking what can be checked without reading it all; a ConfigError
    naming train.data.path otherwise. Returns the memory map."""
    path = Path(path)
    where = f"train.data.path {str(path)!r}"
    width = np.dtype(token_dtype).itemsize
    try:
        if not path.exists():
            raise ConfigError(f"{where} does not exist")
        if not path.is_file():
            raise ConfigError(f"{where} is not a regular file")
        size = path.stat().st_size
        if size == 0:
            raise ConfigError(f"{where} is empty")
        if size % width:
            raise ConfigError(f"{where} has {size} bytes, not a multiple of {width} (train.data.token_dtype "
                              f"= {token_dtype!r}): wrong dtype or a truncated file")
        if size // width < seq_len + 1:
            raise ConfigError(f"{where} holds {size // width} tokens, fewer than train.seq_len + 1 = "
                              f"{seq_len + 1}")
        tokens = np.memmap(path, dtype=np.dtype(token_dtype), mode="r")
    except OSError as err:
        raise ConfigError(f"{where} cannot be read: {err.strerror or err}") from None
    n = len(tokens)
    head = tokens[: min(n, _HEAD_TOKENS)]
    if token_dtype == "uint16" and len(head) >= 64 and head[0::2].any() and not head[1::2].any():
        raise ConfigError(f"{where}: every second token id is 0, as when a uint32 file is read as uint16 "
                          "(train.data.token_dtype = 'uint16')")
    starts = {0: len(head)}
    for i in range(_WINDOWS):
        start = (n - _WINDOW_TOKENS) * i // max(_WINDOWS - 1, 1) if n > _WINDOW_TOKENS else 0
        starts.setdefault(start, min(n - start, _WINDOW_TOKENS))
    for start, length in sorted(starts.items()):
        window = tokens[start:start + length]
        top = int(window.max())
        if top >= vocab_size:
            offset = start + int(np.argmax(window >= vocab_size))
            raise ConfigError(f"{where} contains token id {top} >= model.vocab_size {vocab_size} (first at "
                              f"token {offset}; wrong train.data.token_dtype or vocabulary?)")
    return tokens


class MmapTokens:
    """A flat binary file of token ids (uint16/uint32, e.g. written by numpy.tofile), memory-mapped.

    Sample g is tokens[k*seq_len : k*seq_len + seq_len + 1] with k = g mod (number of samples), so
    the stream wraps around the file (epochs) deterministically. The file is checked when opened
    (check_token_file) and every sample's ids are checked against the vocabulary when read.
    """

    def __init__(self, path: str | Path, token_dtype: str, seq_len: int, vocab_size: int) -> None:
        self.path = Path(path)
        self.tokens = check_token_file(path, token_dtype, seq_len, vocab_size)
        self.seq_len, self.vocab_size = seq_len, vocab_size
        self.n_samples = (len(self.tokens) - 1) // seq_len

    def sample(self, index: int) -> Tensor:
        k = index % self.n_samples
        chunk = np.asarray(self.tokens[k * self.seq_len: k * self.seq_len + self.seq_len + 1], dtype=np.int64)
        if int(chunk.max()) >= self.vocab_size:
            raise ConfigError(f"train.data.path {str(self.path)!r}: sample {k} (tokens from {k * self.seq_len}) "
                              f"holds token id {int(chunk.max())} >= model.vocab_size {self.vocab_size}")
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
