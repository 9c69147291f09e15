"""A keyed pseudo-random permutation of [0, n) evaluated one index at a time (no table in memory).

`shuffled_index(g, n, seed)` maps sample g of an endless stream over n samples to the sample read:
epoch e = g // n reads its n samples in the order of permutation (seed, e), so every epoch sees each
sample once, in a new order, and the stream stays addressable by one integer (resume needs nothing
else). The permutation is a 4-round Feistel network over the smallest even number of bits covering
n, with BLAKE2b round keys, cycle-walked into [0, n) (at most 4 steps expected).

Blended sources are shuffled each in its own order: source i of a blend keys its permutations with
(seed, i), so two sources of equal size are not read in lockstep (correlated). Source 0 keeps the key a
single source has ever had, (seed) alone, so an unblended run reads the order it always read.
"""

from __future__ import annotations

import hashlib

_ROUNDS = 4


def _round(key: bytes, r: int, x: int, mask: int) -> int:
    digest = hashlib.blake2b(x.to_bytes(8, "little"), digest_size=8, key=key + bytes([r])).digest()
    return int.from_bytes(digest, "little") & mask


def permute(k: int, n: int, key: bytes) -> int:
    """The image of k in [0, n) under the permutation named by `key`."""
    if not 0 <= k < n:
        raise ValueError(f"index {k} outside [0, {n})")
    bits = max(2, (n - 1).bit_length())
    half = (bits + 1) // 2
    mask = (1 << half) - 1
    x = k
    while True:
        left, right = x >> half, x & mask
        for r in range(_ROUNDS):
            left, right = right, left ^ _round(key, r, right, mask)
        x = (left << half) | right
        if x < n:
            return x


def shuffled_index(index: int, n: int, seed: int, source: int = 0) -> int:
    """Sample `index` of the shuffled stream of blended source `source` (0 when there is one source): epoch * n +
    its epoch's permutation of index mod n."""
    epoch, k = divmod(index, n)
    name = f"{seed}:{epoch}" if source == 0 else f"{seed}:source{source}:{epoch}"
    return epoch * n + permute(k, n, f"spartron-shuffle:{name}".encode()[:63])
