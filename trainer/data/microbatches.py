"""Each step's microbatches as this rank trains on them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainer.data.loader import BatchLoader, document_positions
from trainer.parallel.context_parallel import shard_batch

Microbatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # inputs, labels, positions


class StepMicrobatches:
    """step -> this rank's microbatches of it: its share of the global batch, each sequence cut to the
    chunks its cp rank holds (the ranks of a cp group read the same sequences), with each token's
    position (in its document when `eos_id` is given: data.document_mask).

    `corrupt(step, batches)`, if given, may replace a step's batches (the fault injection's hook)."""

    def __init__(self, loader: BatchLoader, cp_rank: int, cp: int, eos_id: int | None = None,
                 corrupt: Callable[[int, list], list] | None = None):
        self.loader, self.cp_rank, self.cp, self.eos_id, self.corrupt = loader, cp_rank, cp, eos_id, corrupt

    def __call__(self, step: int) -> list[Microbatch]:
        """`step` counts from 0 (the batch of training step `step + 1`)."""
        batches = self.loader.microbatches(step)
        if self.corrupt is not None:
            batches = self.corrupt(step + 1, batches)
        return [
            shard_batch(inputs, labels, self.cp_rank, self.cp,
                        None if self.eos_id is None else document_positions(inputs, self.eos_id))
            for inputs, labels in batches
        ]
