"""Packing documents into training sequences, addressable by sample index (no iterator state).

The documents of a split lie back to back (each EOS-terminated). Sample k is the window of
seq_len + 1 tokens starting at k * seq_len, as for a flat token file, so no token is padding and a
document longer than a sequence continues in the next one. Per token it also gives:
- positions: restart at 0 at each document start and at the window start (a continued document
  starts afresh), count up by one inside a document: the model's RoPE positions and document mask;
- labels: the next token, or IGNORE (-100) where the next token starts another document (nothing
  predicts a new document across the boundary) or is not a training target (chat prompt tokens,
  loss_mask 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from spartron.configbase import ConfigError
from spartron.data.tokenfile import TokenFolder
from spartron.layers.loss import IGNORE_INDEX as IGNORE


@dataclass(frozen=True)
class Split:
    """Documents [first, last) of a token folder."""

    first: int
    last: int


def split_documents(n_documents: int, val_fraction: float) -> tuple[Split, Split | None]:
    """Train and held-out documents: the last floor(val_fraction x n) documents are held out."""
    n_val = int(n_documents * val_fraction)
    if val_fraction > 0 and n_val == 0:
        raise ConfigError(f"train.data.val_fraction = {val_fraction} of {n_documents} documents holds no document")
    if n_val >= n_documents:
        raise ConfigError(f"train.data.val_fraction = {val_fraction} leaves no training document of {n_documents}")
    train = Split(0, n_documents - n_val)
    return train, (Split(n_documents - n_val, n_documents) if n_val else None)


class PackedDocuments:
    """The samples of one split of a token folder (see the module docstring)."""

    def __init__(self, folder: TokenFolder, split: Split, seq_len: int, vocab_size: int, name: str = "train") -> None:
        self.folder, self.seq_len, self.vocab_size = folder, seq_len, vocab_size
        self.start, self.end = int(folder.offsets[split.first]), int(folder.offsets[split.last])
        self.doc_starts = folder.offsets[split.first:split.last]  # global token index of each document start
        self.n_samples = (self.end - self.start - 1) // seq_len
        if self.n_samples < 1:
            raise ConfigError(f"train.data.path {str(folder.path)!r}: the {name} split holds {self.end - self.start} "
                              f"tokens, fewer than train.seq_len + 1 = {seq_len + 1}")

    def example(self, index: int) -> tuple[Tensor, Tensor, Tensor]:
        """(tokens, labels, positions), each int64 [seq_len], of sample `index` (wrapping around the split)."""
        s = self.seq_len
        first = self.start + (index % self.n_samples) * s
        idx = np.arange(first, first + s + 1)
        window = np.asarray(self.folder.tokens[first:first + s + 1], dtype=np.int64)
        if int(window.max()) >= self.vocab_size:
            raise ConfigError(f"train.data.path {str(self.folder.path)!r}: tokens from {first} hold id "
                              f"{int(window.max())} >= model.vocab_size {self.vocab_size}")
        doc = np.searchsorted(self.doc_starts, idx, side="right") - 1
        seg_start = np.maximum(self.doc_starts[doc], first)
        positions = idx - seg_start
        labels = window[1:].copy()
        labels[positions[1:] == 0] = IGNORE  # the next token starts another document
        if self.folder.loss_mask is not None:
            mask = np.asarray(self.folder.loss_mask[first + 1:first + s + 1])
            labels[mask == 0] = IGNORE
        return (torch.from_numpy(window[:-1].copy()), torch.from_numpy(labels), torch.from_numpy(positions[:-1]))
