"""The order windows are read in: epoch after epoch, each a seeded permutation computed index by
index (a Feistel network over the next power of four, walking cycles back into range), so no rank
ever holds an epoch's order: a corpus of billions of windows costs no memory to shuffle."""

from __future__ import annotations

import sys

import numpy as np

ROUNDS = 6


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: uint64 -> uint64, every output bit depending on every input bit."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def round_keys(*seed: int) -> np.ndarray:
    rng = np.random.default_rng([s % 2**64 for s in seed])
    return rng.integers(0, 2**63, ROUNDS, dtype=np.uint64)


def permute(index: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """Where each of `index` (in range(n)) goes in the permutation of range(n) that `keys` pick."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask, shift = np.uint64((1 << half) - 1), np.uint64(half)

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        return (left << shift) | right

    out = feistel(np.asarray(index, dtype=np.uint64))
    outside = out >= n
    while outside.any():  # a permutation of range(4**half) that leaves range(n): follow it back in
        out[outside] = feistel(out[outside])
        outside = out >= n
    return out.astype(np.int64)


class Shuffled:
    """A dataset's windows as an endless stream: epoch after epoch, each in its own seeded order."""

    sequential = True  # the stream's own order: read as it is

    def __init__(self, dataset, *seed: int):
        self.dataset, self.seed, self.n = dataset, seed, len(dataset)
        self._keys: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return sys.maxsize

    def indices(self, positions: np.ndarray) -> np.ndarray:
        """The dataset's index of each stream position."""
        epochs, offsets = np.divmod(np.asarray(positions, dtype=np.int64), self.n)
        out = np.empty_like(offsets)
        for epoch in np.unique(epochs):
            if epoch not in self._keys:
                # (one epoch at a time, mostly)
                self._keys = {epoch: round_keys(*self.seed, int(epoch))}
            chosen = epochs == epoch
            out[chosen] = permute(offsets[chosen], self.n, self._keys[epoch])
        return out

    def take(self, positions) -> list:
        return [self.dataset[int(i)] for i in self.indices(positions)]

    def __getitem__(self, position: int):
        return self.take([position])[0]


def as_stream(dataset, *seed: int):
    """A dataset read in its own order (a stream, a mixture) as it is; any other shuffled."""
    return dataset if getattr(dataset, "sequential", False) else Shuffled(dataset, *seed)


def take(stream, positions) -> list:
    """The windows at `positions` of a stream."""
    return (stream.take(positions) if hasattr(stream, "take")
            else [stream[int(p)] for p in positions])
