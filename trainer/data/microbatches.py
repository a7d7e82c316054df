"""Each step's microbatches as this rank trains on them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainer.data.loader import BatchLoader, Prefetcher, document_positions
from trainer.parallel.context_parallel import shard_batch

Microbatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # inputs, labels, positions


class StepMicrobatches:
    """step -> this rank's microbatches of it: its share of the global batch, each sequence cut to
    the chunks its cp rank holds (the ranks of a cp group read the same sequences), with each
    token's position (in its document when `eos_id` is given: data.document_mask).

    `corrupt(step, batches)`, if given, may replace a step's batches (the fault injection's
    hook)."""

    def __init__(self, loader: BatchLoader, cp_rank: int, cp: int, eos_id: int | None = None,
                 corrupt: Callable[[int, list], list] | None = None):
        self.loader, self.cp_rank, self.cp = loader, cp_rank, cp
        self.eos_id, self.corrupt = eos_id, corrupt

    def __call__(self, step: int) -> list[Microbatch]:
        """`step` counts from 0 (the batch of training step `step + 1`)."""
        batches = self.loader.microbatches(step)
        if self.corrupt is not None:
            batches = self.corrupt(step + 1, batches)
        return [shard_batch(inputs, labels, self.cp_rank, self.cp, self._positions(inputs, given))
                for inputs, labels, *given in batches]

    def _positions(self, inputs: torch.Tensor, given: list) -> torch.Tensor | None:
        """The batch's own positions (conversations), else those in each document
        (data.document_mask), else None (0..seq-1)."""
        if given:
            return given[0]
        return None if self.eos_id is None else document_positions(inputs, self.eos_id)


class StepData:
    """The batches this rank trains each step on (read ahead) and validates on, and the loader whose
    stream position checkpoints record.

    Under fault tolerance the data-parallel ranks are those of every replica group (`groups` x this
    group's dp), the global batch is `groups` replica shares, and `train(step, shares)` reads the
    shares this group trains: its own read ahead, another group's as that group's ranks would."""

    def __init__(self, dataset, val_dataset, training, dims, dp_rank: int, cp_rank: int,
                 eos_id: int | None, corrupt=None, groups: int = 1, own_share: int = 0):
        self.dataset, self.training, self.dims, self.dp_rank = dataset, training, dims, dp_rank
        self.cp_rank, self.eos_id, self.groups, self.own_share = cp_rank, eos_id, groups, own_share
        self.loader = self._loader(dataset, own_share)
        self.batches = Prefetcher(StepMicrobatches(self.loader, cp_rank, dims.cp, eos_id, corrupt))
        # Each replica group validates on the whole
        # validation batch: the job's loss, whoever is alive.
        t = training
        val_loader = BatchLoader(val_dataset, t.global_batch_size, dp_rank, dims.dp,
                                 dims.grad_accum_steps, t.seed, dims.pp_microbatches)
        self.validation = StepMicrobatches(val_loader, cp_rank, dims.cp, eos_id)

    def train(self, step: int, shares: list[int] | None = None) -> list[list[Microbatch]]:
        """Step `step`'s (from 0) microbatches, one list per replica share (None: this rank's
        own)."""
        return [self.batches(step) if share == self.own_share else self._share(share)(step)
                for share in (shares if shares is not None else [self.own_share])]

    def _share(self, share: int) -> StepMicrobatches:
        loader = self._loader(self.dataset, share)
        loader.offset = self.loader.offset
        return StepMicrobatches(loader, self.cp_rank, self.dims.cp, self.eos_id)

    def _loader(self, data, share: int) -> BatchLoader:
        t, dims = self.training, self.dims
        return BatchLoader(data, t.global_batch_size, share * dims.dp + self.dp_rank,
                           self.groups * dims.dp, dims.grad_accum_steps, t.seed,
                           dims.pp_microbatches)

    def close(self) -> None:
        self.batches.close()
