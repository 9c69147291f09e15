"""Token data for the trainer: a synthetic deterministic stream (default), memory-mapped token files and
packed documents of a token folder (spartron.data), each with a held-out validation split.

Every source is indexed by a GLOBAL sample index, and data-parallel rank r of n reads samples r, r+n,
r+2n, ...: a sample depends only on (source, seed, global index), so a run is reproducible for a
given dp size and resumable from a single integer position (no iterator state to pickle).

Context-parallel ranks of one dp rank receive the SAME full sequences; the model splits the
sequence dimension across CP ranks (load-balanced for causal attention) itself.

Each sample is seq_len + 1 consecutive tokens packed without padding; tokens = sample[:-1],
labels = sample[1:]. Packed documents also give per-document positions and mask labels across
document boundaries and on chat prompts (spartron.data.packing).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from spartron.data.blend import BlendSchedule, blend_schedule
from spartron.data.packing import PackedDocuments, split_documents
from spartron.data.shuffle import shuffled_index
from spartron.data.tokenfile import META, open_token_folder
from spartron.layers.loss import IGNORE_INDEX
from spartron.runtime.config import ConfigError, DataConfig, RunConfig

Example = tuple[Tensor, Tensor, Tensor | None]  # tokens [S], labels [S], positions [S] (packed documents) or None


class SyntheticTokens:
    """Learnable synthetic sequences: a random walk on a fixed random permutation of the vocabulary
    (token t+1 = perm[token t], perm drawn once from the seed), with 1 token in 8 replaced by noise.
    A model that learns the bigram drops the loss from log(vocab) towards the noise entropy.

    Sample g comes from its own generator seeded by (seed, g): position-addressable, no state.
    """

    noise_rate = 0.125
    fingerprint = "synthetic"

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

    def example(self, index: int) -> Example:
        sample = self.sample(index)
        return sample[:-1], sample[1:], None


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
        _check_sidecar(path, token_dtype, vocab_size, where)  # first: a wrong dtype explains a size error
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
    return check_token_ids(tokens, token_dtype, vocab_size, where)


def _check_sidecar(path: Path, token_dtype: str, vocab_size: int, where: str) -> None:
    """A tokens.bin of a `spartron data` folder: its tokens.json must agree with the config's dtype and vocabulary."""
    meta_file = path.parent / META
    if path.name != "tokens.bin" or not meta_file.is_file():
        return
    try:
        meta = json.loads(meta_file.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return  # not ours to judge here: the flat file is what kind = 'mmap' reads
    if not isinstance(meta, dict):
        return
    if meta.get("dtype") in ("uint16", "uint32") and meta["dtype"] != token_dtype:
        raise ConfigError(f"{where}: {meta_file} says the tokens are {meta['dtype']}, but train.data.token_dtype "
                          f"= {token_dtype!r}")
    vocab = meta.get("vocab_size")
    if isinstance(vocab, int) and vocab > vocab_size:
        raise ConfigError(f"{where}: {meta_file} says its tokenizer has {vocab} tokens, more than model.vocab_size "
                          f"{vocab_size}")
    if meta.get("loss_mask"):  # a chat folder: the flat file would train on every prompt token
        raise ConfigError(f"{where}: {meta_file} records a loss mask (chats: only the answers are targets), which "
                          f"train.data.kind = 'mmap' would ignore: read the folder with train.data.kind = 'packed', "
                          f"train.data.path = {str(path.parent)!r}")


def check_token_ids(tokens: np.ndarray, token_dtype: str, vocab_size: int, where: str) -> np.ndarray:
    """Scan the head and windows spread over the whole file for ids >= vocab_size; returns `tokens`."""
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

    Sample g is tokens[k*seq_len : k*seq_len + seq_len + 1] with k = first + g mod count: samples
    [first, first + count) of the file (the training samples, or the held-out ones at its end), so
    the stream wraps around them (epochs) deterministically. The file is checked when opened
    (check_token_file) and every sample's ids are checked against the vocabulary when read.

    Consecutive samples share one token (a sample's last label is the next one's first input), so the
    last training sample's last label is the first held-out token: with a held-out split that label is
    ignored (-100), as training never uses a held-out token, as input or as target.
    """

    def __init__(self, path: str | Path, token_dtype: str, seq_len: int, vocab_size: int,
                 val_fraction: float = 0.0, split: str = "train") -> None:
        self.path = Path(path)
        self.tokens = check_token_file(path, token_dtype, seq_len, vocab_size)
        self.seq_len, self.vocab_size = seq_len, vocab_size
        total = (len(self.tokens) - 1) // seq_len
        n_val = int(total * val_fraction)
        if val_fraction > 0 and (n_val == 0 or n_val == total):
            raise ConfigError(f"train.data.val_fraction = {val_fraction} of the {total} samples of train.data.path "
                              f"{str(self.path)!r} leaves {'no held-out' if n_val == 0 else 'no training'} sample")
        self.first, self.n_samples = (0, total - n_val) if split == "train" else (total - n_val, n_val)
        self.held_out_follows = split == "train" and n_val > 0  # its last sample's last label is held out
        if self.n_samples == 0:
            raise ConfigError("train.data.val_fraction = 0: train.data.kind = 'mmap' has no held-out split "
                              "(set train.data.val_fraction, e.g. 0.01)")
        self.fingerprint = f"mmap:{len(self.tokens)}:{token_dtype}"

    def sample(self, index: int) -> Tensor:
        k = self.first + index % self.n_samples
        chunk = np.asarray(self.tokens[k * self.seq_len: k * self.seq_len + self.seq_len + 1], dtype=np.int64)
        if int(chunk.max()) >= self.vocab_size:
            raise ConfigError(f"train.data.path {str(self.path)!r}: sample {k} (tokens from {k * self.seq_len}) "
                              f"holds token id {int(chunk.max())} >= model.vocab_size {self.vocab_size}")
        return torch.from_numpy(chunk)

    def example(self, index: int) -> Example:
        sample = self.sample(index)
        labels = sample[1:]
        if self.held_out_follows and index % self.n_samples == self.n_samples - 1:
            labels = labels.clone()
            labels[-1] = IGNORE_INDEX  # the first held-out token
        return sample[:-1], labels, None


class HeldOutSynthetic:
    """The synthetic stream's validation split: the same task, samples from 3 x 2**30 on. torch's CPU
    generator keeps 32 bits of a seed, so this is as far from the training samples as seeds go: a run
    would have to train on 3.2e9 sequences to reach them."""

    offset = 3 * 2**30

    def __init__(self, source: SyntheticTokens) -> None:
        self.source, self.fingerprint = source, "synthetic:held-out"

    def example(self, index: int) -> Example:
        sample = self.source.sample(self.offset + index)
        return sample[:-1], sample[1:], None


class PackedSource:
    """Packed documents (spartron.data.packing) as a loader source; `documents` False drops the positions
    (plain causal attention over the packed row; labels still stop at document boundaries)."""

    def __init__(self, packed: PackedDocuments, documents: bool, fingerprint: str) -> None:
        self.packed, self.documents, self.fingerprint = packed, documents, fingerprint
        self.n_samples = packed.n_samples

    def example(self, index: int) -> Example:
        tokens, labels, positions = self.packed.example(index)
        return tokens, labels, positions if self.documents else None


class Shuffled:
    """A finite source read in a new seeded order each epoch (spartron.data.shuffle): still addressable by
    sample index, so the saved position resumes it. `blend_index` is the source's index in a blend (0 alone):
    each blended source gets its own order, keyed by (seed, blend_index)."""

    def __init__(self, source: MmapTokens | PackedSource, n_samples: int, seed: int, blend_index: int = 0) -> None:
        self.source, self.n_samples, self.seed, self.blend_index = source, n_samples, seed, blend_index
        self.shared_order_fingerprint = f"{source.fingerprint}:shuffled:{seed}"  # any source's, before each had its own
        self.fingerprint = self.shared_order_fingerprint + (f":source{blend_index}" if blend_index else "")

    def example(self, index: int) -> Example:
        return self.source.example(shuffled_index(index, self.n_samples, self.seed, self.blend_index))


Source = SyntheticTokens | MmapTokens | HeldOutSynthetic | PackedSource | Shuffled  # | Blended of these


@dataclass
class Batch:
    """One micro-batch: tokens and labels [B, S] and, for packed documents, positions [B, S]."""

    tokens: Tensor
    labels: Tensor
    positions: Tensor | None = None

    def model_kwargs(self, device: torch.device) -> dict[str, Tensor]:
        """The model's keyword arguments beyond (tokens, labels): {} or {"positions": ...} on `device`."""
        return {} if self.positions is None else {"positions": self.positions.to(device, non_blocking=True)}


class TokenLoader:
    """Batches for one data-parallel rank, resumable by position."""

    def __init__(self, source: Source, dp_rank: int, dp_size: int) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} must be in [0, {dp_size})")
        self.source, self.dp_rank, self.dp_size = source, dp_rank, dp_size
        self.position = 0  # samples already consumed by this rank

    def next(self, batch_size: int) -> Batch:
        indices = [(self.position + i) * self.dp_size + self.dp_rank for i in range(batch_size)]
        self.position += batch_size
        tokens, labels, positions = zip(*(self.source.example(g) for g in indices), strict=True)
        rows = None if positions[0] is None else torch.stack(positions)
        if rows is not None and torch.equal(rows, torch.arange(rows.shape[1]).expand_as(rows)):
            rows = None  # no document starts inside any row: the same attention as plain causal, its faster kernel
        return Batch(torch.stack(tokens), torch.stack(labels), rows)

    def next_batch(self, batch_size: int) -> tuple[Tensor, Tensor]:
        """(tokens, labels) [B, S] (sources without positions; see `next` for packed documents)."""
        batch = self.next(batch_size)
        return batch.tokens, batch.labels

    def state_dict(self) -> dict:
        return {"position": self.position, "dp_rank": self.dp_rank, "dp_size": self.dp_size,
                "source": self.source.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        if (state["dp_rank"], state["dp_size"]) != (self.dp_rank, self.dp_size):
            raise ValueError(f"data state was saved by dp rank {state['dp_rank']} of {state['dp_size']}, "
                             f"cannot resume it on dp rank {self.dp_rank} of {self.dp_size}")
        saved = state.get("source")  # absent in states saved before sources were recorded
        if saved is not None and saved != self.source.fingerprint:
            if saved == getattr(self.source, "shared_order_fingerprint", None):  # saved by an older Spartron
                raise ValueError("the data position was saved when the shuffled sources of train.data.paths shared "
                                 "one order, and each now has its own, so this run's sample order cannot go on: "
                                 "finish it with the Spartron version that started it, or start a new run (another "
                                 "train.run_dir)")
            raise ValueError(f"the data position was saved for data {saved!r}, but train.data now reads "
                             f"{self.source.fingerprint!r}: resuming would read other samples")
        self.position = int(state["position"])


class Blended:
    """Several sources by weight (spartron.data.blend): sample g is sample k of source i, both from g alone."""

    def __init__(self, sources: list[Source], schedule: BlendSchedule) -> None:
        self.sources, self.schedule = sources, schedule
        self.fingerprint = _blend_fingerprint([s.fingerprint for s in sources], schedule.counts)
        # what a position saved when all shuffled sources shared one order names (None: not shuffled)
        shared = [getattr(s, "shared_order_fingerprint", None) for s in sources]
        self.shared_order_fingerprint = None if None in shared else _blend_fingerprint(shared, schedule.counts)

    def example(self, index: int) -> Example:
        source, k = self.schedule.locate(index)
        return self.sources[source].example(k)


def _blend_fingerprint(parts: list[str], counts: tuple[int, ...]) -> str:
    return "blend[" + ";".join(f"{p}x{n}" for p, n in zip(parts, counts, strict=True)) + "]"


def _source(cfg: DataConfig, path: str | None, vocab_size: int, seq_len: int, seed: int, split: str) -> Source:
    if cfg.kind == "synthetic":
        synthetic = SyntheticTokens(vocab_size, seq_len, seed)
        return synthetic if split == "train" else HeldOutSynthetic(synthetic)
    if cfg.kind == "mmap":
        return MmapTokens(path, cfg.token_dtype, seq_len, vocab_size, cfg.val_fraction, split)
    folder = open_token_folder(path)
    where = f"train.data.path {path!r}"
    if folder.vocab_size > vocab_size:
        raise ConfigError(f"{where}: its tokenizer has {folder.vocab_size} tokens, more than model.vocab_size "
                          f"{vocab_size}")
    check_token_ids(folder.tokens, folder.meta["dtype"], vocab_size, where)
    train, held_out = split_documents(len(folder.offsets) - 1, cfg.val_fraction)
    if split != "train" and held_out is None:
        raise ConfigError("train.data.val_fraction = 0: no documents are held out for evaluation "
                          "(set train.data.val_fraction, e.g. 0.01)")
    packed = PackedDocuments(folder, train if split == "train" else held_out, seq_len, vocab_size, split)
    return PackedSource(packed, cfg.documents, folder.fingerprint)


def _data(cfg: DataConfig, vocab_size: int, seq_len: int, seed: int, split: str) -> Source:
    """The source of a [train.data] section's split: one file or folder, or the blend of `paths` (each
    shuffled in its own order, keyed by train.seed and its index in `paths`, when train.data.shuffle; the
    held-out split is never shuffled)."""
    sources = [_source(cfg, path, vocab_size, seq_len, seed, split) for path in (cfg.paths or [cfg.path])]
    if cfg.shuffle and split == "train":
        sources = [Shuffled(s, s.n_samples, seed, i) for i, s in enumerate(sources)]
    if cfg.paths is None:
        return sources[0]
    return Blended(sources, blend_schedule(cfg.weights or [1.0] * len(sources)))


def build_loader(cfg: DataConfig, vocab_size: int, seq_len: int, seed: int, dp_rank: int,
                 dp_size: int) -> TokenLoader:
    """The training loader of a [train.data] section (what build_train_loader reads from a RunConfig)."""
    return TokenLoader(_data(cfg, vocab_size, seq_len, seed, "train"), dp_rank, dp_size)


def build_train_loader(cfg: RunConfig, dp_rank: int, dp_size: int) -> TokenLoader:
    """The training split of cfg.train.data for data-parallel rank `dp_rank` of `dp_size`."""
    t = cfg.train
    return build_loader(t.data, cfg.model.vocab_size, t.seq_len, t.seed, dp_rank, dp_size)


def check_held_out_size(cfg: RunConfig, loader: TokenLoader) -> None:
    """An evaluation reads train.eval_steps x global_batch_size held-out samples: a split holding fewer would be
    read round again, some samples weighed more than others, so it is a ConfigError naming both keys."""
    t = cfg.train
    wanted, source = t.eval_steps * t.global_batch_size, loader.source
    if isinstance(source, Blended):  # how many of each source's samples the first `wanted` blended ones read
        need = [0] * len(source.sources)
        for g in range(wanted):
            i, k = source.schedule.locate(g)
            need[i] = max(need[i], k + 1)
        short = [(n, s.n_samples) for n, s in zip(need, source.sources, strict=True) if n > s.n_samples]
    else:
        short = [(wanted, source.n_samples)] if wanted > getattr(source, "n_samples", wanted) else []
    if short:
        need, held = short[0]
        which = f" ({need} of one blended source's)" if isinstance(source, Blended) else ""
        raise ConfigError(f"an evaluation reads train.eval_steps = {t.eval_steps} x train.global_batch_size = "
                          f"{t.global_batch_size} held-out samples{which}, but the held-out split holds {held}: some "
                          "would be read twice and weigh double; lower train.eval_steps or raise "
                          "train.data.val_fraction")


def check_data(cfg: RunConfig) -> None:
    """What the launcher checks before spawning ranks: the training split opens (files, sizes, metadata,
    vocabulary) and, when the run evaluates or holds documents out, the held-out split too (large enough for
    an evaluation when the run evaluates)."""
    build_train_loader(cfg, 0, 1)
    if cfg.train.data.kind != "synthetic" and (cfg.train.data.val_fraction > 0 or cfg.train.eval_every):
        held_out = build_eval_loader(cfg, 0, 1)
        if cfg.train.eval_every:
            check_held_out_size(cfg, held_out)


def build_eval_loader(cfg: RunConfig, dp_rank: int, dp_size: int) -> TokenLoader:
    """The held-out validation split of cfg.train.data (never trained on), from its first sample: each
    call starts over, so an evaluation reads the same samples every time. ConfigError naming
    train.data.val_fraction when the data holds nothing out."""
    t = cfg.train
    return TokenLoader(_data(t.data, cfg.model.vocab_size, t.seq_len, t.seed, "val"), dp_rank, dp_size)
