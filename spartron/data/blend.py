"""Blending several sources by weight, addressable by sample index (no iterator state).

The sample stream is cut into rounds of `round_size` samples. Every round takes n_i samples from
source i (n_i proportional to its weight, largest remainders rounded up, each at least 1) in one
fixed interleaved order: the position of each pick minimises the gap between what each source has
had so far and its share (the greedy schedule Megatron's blended datasets use). Sample g is then
source pattern[g mod R], and its index in that source is (g div R) x n_i + the number of earlier picks
of source i in the round: O(1) per sample, O(R) memory, weights realised to 1/R.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlendSchedule:
    counts: tuple[int, ...]  # samples of each source per round
    pattern: tuple[int, ...]  # the source of each position of a round
    rank: tuple[int, ...]  # each position's index among its source's picks in the round

    @property
    def round_size(self) -> int:
        return len(self.pattern)

    def locate(self, index: int) -> tuple[int, int]:
        """(source, the sample index within that source) of blended sample `index`."""
        r, j = divmod(index, len(self.pattern))
        source = self.pattern[j]
        return source, r * self.counts[source] + self.rank[j]


def blend_schedule(weights: list[float], round_size: int = 1000) -> BlendSchedule:
    """The schedule of `weights` (positive; normalised here) over rounds of `round_size` samples."""
    if not weights or any(w <= 0 for w in weights):
        raise ValueError(f"blend weights must be positive, got {weights}")
    total = sum(weights)
    shares = [w / total for w in weights]
    size = max(round_size, len(weights))
    exact = [p * size for p in shares]
    counts = [max(1, int(e)) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    for i in by_remainder:  # largest remainders first, until the round is full
        if sum(counts) >= size:
            break
        counts[i] += 1
    size = sum(counts)
    taken, pattern, rank = [0] * len(weights), [], []
    for j in range(size):  # the source furthest behind its share at this point of the round
        i = max(range(len(weights)), key=lambda i: (counts[i] * (j + 1) / size - taken[i], -i))
        pattern.append(i)
        rank.append(taken[i])
        taken[i] += 1
    return BlendSchedule(tuple(counts), tuple(pattern), tuple(rank))
