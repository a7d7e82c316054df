"""Data: a byte tokenizer, text the code generates itself, and the per-rank batch split.

The loader is indexed by step, not iterated: the batch of step s depends only on the seed, the
global batch size and s, so every layout sees the same global batch and resuming is free.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from torch.utils.data import Dataset

from trainer.errors import ConfigError


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255; fits any model with vocab_size >= 256."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


_NAMES = "anna ben clara david emma felix grace henry iris jack kate leo mia noah olive paul".split()
_NOUNS = "cat dog bird horse river stone tree house boat garden window road king queen child letter".split()
_ADJECTIVES = "red small old quiet bright cold green heavy warm tall dark gentle".split()
_VERBS = "sees finds holds paints follows carries watches builds opens keeps".split()
_PLACES = "the market,the hill,the sea,the old town,the forest,the station".split(",")


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randrange(50), rng.randrange(50)
        return f"{a} plus {b} is {a + b}."
    if kind == 1:
        return f"{rng.choice(_NAMES).title()} {rng.choice(_VERBS)} the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}."
    if kind == 2:
        return f"The {rng.choice(_NOUNS)} near {rng.choice(_PLACES)} is {rng.choice(_ADJECTIVES)}."
    name = rng.choice(_NAMES).title()
    return f"{name} walks to {rng.choice(_PLACES)}, and {name} {rng.choice(_VERBS)} a {rng.choice(_NOUNS)}."


class EmbeddedText(Dataset):
    """Sequences of generated English-like text: counting facts and simple sentences.

    Sequence i is made from its own seeded generator, so no corpus is stored and any index is
    produced in isolation. Regular enough that a small model's loss falls quickly.
    """

    def __init__(self, seq_len: int, seed: int, size: int = 1_000_000):
        self.seq_len, self.seed, self.size = seq_len, seed, size
        self.tokenizer = ByteTokenizer()

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        rng = random.Random(self.seed * 1_000_003 + index)
        ids: list[int] = []
        while len(ids) < self.seq_len + 1:
            ids += self.tokenizer.encode(_sentence(rng) + " ")
        return torch.tensor(ids[: self.seq_len + 1], dtype=torch.long)


class TextFile(Dataset):
    """A local UTF-8 text file, byte-tokenized and cut into consecutive windows."""

    def __init__(self, path: str, seq_len: int):
        self.seq_len = seq_len
        self.tokens = torch.tensor(list(Path(path).read_bytes()), dtype=torch.long)
        if len(self.tokens) <= seq_len:
            raise ConfigError(f"data.path={path} holds {len(self.tokens)} tokens, fewer than training.seq_len+1")

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]


def build_dataset(data, seq_len: int, seed: int, split: str = "train") -> Dataset:
    if data.tokenizer != "bytes":
        raise ConfigError(f"data.tokenizer={data.tokenizer} is unknown; this version supports 'bytes'")
    if data.source == "embedded":
        # Validation draws from a disjoint stream of the same generator.
        return EmbeddedText(seq_len, seed if split == "train" else seed + 7919)
    if data.source == "text":
        if not data.path or not Path(data.path).is_file():
            raise ConfigError(f"data.path={data.path} is not a readable file (needed by data.source=text)")
        return TextFile(data.path, seq_len)
    raise ConfigError(f"data.source={data.source} is unknown; choose 'embedded' or 'text'")


class BatchLoader:
    """This rank's share of each global batch, as grad_accum_steps microbatches.

    The global batch of step s is positions [s*G, (s+1)*G) of a seeded permutation of the dataset
    (a new one each epoch), cut into grad_accum * pp_microbatches contiguous blocks: the job's
    microbatches, in order. Each block is split evenly over the data-parallel ranks. So a
    microbatch of the job holds the same sequences in every layout, which keeps per-microbatch
    statistics (the MoE load-balancing loss) independent of the layout too. A pipeline schedule
    cuts each of this rank's microbatches into its pp_microbatches contiguous pieces.
    """

    def __init__(self, dataset: Dataset, global_batch: int, dp_rank: int, dp_size: int, grad_accum: int, seed: int,
                 pp_microbatches: int = 1):
        self.dataset, self.global_batch, self.seed = dataset, global_batch, seed
        self.dp_rank, self.grad_accum = dp_rank, grad_accum
        self.blocks = grad_accum * pp_microbatches
        self.share = global_batch // self.blocks // dp_size  # sequences of one block on one rank
        self.micro_batch = global_batch // dp_size // grad_accum
        self.offset = 0  # the stream position of step 0's batch; a resumed run sets it
        self._epoch, self._order = -1, None

    def _position(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.dataset))
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch, self._order = epoch, torch.randperm(len(self.dataset), generator=generator)
        return int(self._order[offset])

    def position(self, steps: int) -> int:
        """Sequences of the stream consumed after `steps` steps: where the next step reads."""
        return self.offset + steps * self.global_batch

    def microbatches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[(inputs, labels)] for `step` (0-based), each [micro_batch, seq_len]."""
        block_size = self.global_batch // self.blocks
        positions = [
            self.offset + step * self.global_batch + block * block_size + self.dp_rank * self.share + i
            for block in range(self.blocks) for i in range(self.share)
        ]
        sequences = torch.stack([self.dataset[self._position(p)] for p in positions])
        return [(chunk[:, :-1], chunk[:, 1:]) for chunk in sequences.split(self.micro_batch)]
