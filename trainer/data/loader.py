"""This rank's share of each global batch, read ahead on a background thread; and where each token
stands in its document."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from trainer.data.chat_windows import STARTS, SUPERVISED
from trainer.data.order import as_stream, take
from trainer.models.head import IGNORE_INDEX


def document_positions(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Each token's position in its own document [batch, seq]: counting restarts after every EOS
    (the first window position counts as a document start)."""
    index = torch.arange(tokens.shape[1]).expand(tokens.shape)
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 1:] = tokens[:, :-1] == eos_id
    return index - torch.where(starts, index, 0).cummax(dim=1).values


class Prefetcher:
    """fn(step) for steps asked in order, each computed while the step before it trains, on one
    background thread (which alone touches the data, so a stream is read in order)."""

    def __init__(self, fn):
        self.fn, self._pool, self._next = (fn, ThreadPoolExecutor(1, thread_name_prefix="prefetch"),
                                           None)

    def __call__(self, step: int):
        if self._next is None or self._next[0] != step:  # the first step, or one out of order
            self._next = (step, self._pool.submit(self.fn, step))
        future = self._next[1]
        self._next = (step + 1, self._pool.submit(self.fn, step + 1))
        return future.result()

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


class BatchLoader:
    """This rank's share of each global batch, as grad_accum_steps microbatches.

    The global batch of step s is positions [s*G, (s+1)*G) of the dataset's stream (epoch after
    epoch, each a seeded permutation computed index by index; a stream or a mixture orders itself),
    cut into grad_accum * pp_microbatches contiguous blocks: the job's microbatches, in order. Each
    block is split evenly over the data-parallel ranks. So a microbatch of the job holds the same
    sequences in every layout, which keeps per-microbatch statistics (the MoE load-balancing loss)
    independent of the layout too. A pipeline schedule cuts each of this rank's microbatches into
    its pp_microbatches contiguous pieces. A stream read per rank (a Hub dataset) is the exception:
    each rank reads G / dp windows a step from a shard of its own, so its batches depend on dp.
    """

    def __init__(self, dataset, global_batch: int, dp_rank: int, dp_size: int, grad_accum: int,
                 seed: int, pp_microbatches: int = 1):
        # A stream read per rank (a Hub dataset) gives this rank its own shard, read in order.
        self.per_rank = getattr(dataset, "per_rank", False)
        self.stream = dataset.shard(dp_rank, dp_size) if self.per_rank else as_stream(dataset, seed)
        self.global_batch, self.grad_accum = global_batch, grad_accum
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.blocks = grad_accum * pp_microbatches
        self.share = global_batch // self.blocks // dp_size  # sequences of one block on one rank
        self.micro_batch = global_batch // dp_size // grad_accum
        self.offset = 0  # the stream position of step 0's batch; a resumed run sets it

    def position(self, steps: int) -> int:
        """Sequences of the stream consumed after `steps` steps: where the next step reads."""
        return self.offset + steps * self.global_batch

    def microbatches(self, step: int) -> list[tuple[torch.Tensor, ...]]:
        """[(inputs, labels)] for `step` (0-based), each [micro_batch, seq_len]; for conversations
        [(inputs, labels, positions)]."""
        # positions in this rank's shard (resumed with another dp size: proportionally)
        if self.per_rank:
            first = (self.offset + step * self.global_batch) // self.dp_size
            positions = [first + block * self.share + i for block in range(self.blocks)
                         for i in range(self.share)]
        else:
            block_size = self.global_batch // self.blocks
            positions = [
                self.offset + step * self.global_batch + block * block_size
                + self.dp_rank * self.share + i
                for block in range(self.blocks) for i in range(self.share)
            ]
        sequences = torch.stack(take(self.stream, positions))
        if sequences.dim() == 3:  # conversations: tokens and their flags (trainer.data.chat)
            return [conversation_batch(chunk) for chunk in sequences.split(self.micro_batch)]
        return [(chunk[:, :-1], chunk[:, 1:]) for chunk in sequences.split(self.micro_batch)]


def conversation_batch(windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Windows [batch, 2, seq + 1] of tokens and flags -> (inputs, labels, positions) [batch, seq]:
    the labels not learned are IGNORE_INDEX, and positions restart at each conversation."""
    tokens, flags = windows[:, 0], windows[:, 1]
    labels = torch.where(flags[:, 1:] & SUPERVISED > 0, tokens[:, 1:], IGNORE_INDEX)
    index = torch.arange(tokens.shape[1] - 1).expand(tokens.shape[0], -1)
    starts = flags[:, :-1] & STARTS > 0
    return tokens[:, :-1], labels, index - torch.where(starts, index, 0).cummax(dim=1).values
