"""Weighted mixtures: several sources read as one stream, each in proportion to its weight.

Position p of the stream is routed down a binary tree over the sources: at each node the positions
are dealt between the two subtrees like the points of a line drawn on a grid (left gets
floor(p * share + phase) of the first p), the phase seeded. So every prefix of the stream holds each
source's windows within a couple of windows of its weight, any position is found in O(log sources)
without a table, and the result depends only on the seed and p: the same in every layout, and
resumable with any number of ranks. Each source is read as its own endless stream (epoch after
epoch, in its own seeded order), so a small source repeats while a large one is still in its first
epoch, as its weight asks.
"""

from __future__ import annotations

import sys

import numpy as np

from trainer.data.order import as_stream, take
from trainer.errors import ConfigError


class Mixture:
    sequential = True  # positions are routed here; no shuffle on top

    def __init__(self, datasets: list, weights: list[float], seed: int):
        total = float(sum(weights))
        self.weights = np.array(weights, dtype=np.float64) / total
        self.streams = [as_stream(d, seed, 1 + i) for i, d in enumerate(datasets)]
        self.phases = np.random.default_rng([seed % 2**64, 0x6D6978]).random(2 * len(datasets))
        eos = {d.eos_id for d in datasets}
        if len(eos) > 1:
            raise ConfigError("data.mix: the sources end documents with different tokens "
                              f"{sorted(eos)} (token files of other tokenizers?)")
        self.eos_id = eos.pop()
        self.vocab_size = max(d.vocab_size for d in datasets)

    def __len__(self) -> int:
        return sys.maxsize

    def route(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """(source, position in that source's stream) of each stream position."""
        p = np.asarray(positions, dtype=np.int64)
        return self._route(p, 0, len(self.streams), 1)

    def _route(self, p: np.ndarray, first: int, last: int,
               node: int) -> tuple[np.ndarray, np.ndarray]:
        if last - first == 1:
            return np.full_like(p, first), p
        mid = (first + last) // 2
        share = self.weights[first:mid].sum() / self.weights[first:last].sum()
        phase = self.phases[node]
        # of the positions before p, those going left
        before = np.floor(p * share + phase).astype(np.int64)
        left = np.floor((p + 1) * share + phase).astype(np.int64) > before
        source, index = np.empty_like(p), np.empty_like(p)
        source[left], index[left] = self._route(before[left], first, mid, 2 * node)
        source[~left], index[~left] = self._route((p - before)[~left], mid, last, 2 * node + 1)
        return source, index

    def take(self, positions) -> list:
        source, index = self.route(positions)
        out = [None] * len(source)
        for s in np.unique(source):
            chosen = np.flatnonzero(source == s)
            for i, window in zip(chosen, take(self.streams[s], index[chosen])):
                out[i] = window
        return out

    def __getitem__(self, position: int):
        return self.take([position])[0]
