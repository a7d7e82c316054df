"""Data: text the code generates itself, a user's text files or pre-tokenized binary file packed
into windows, and the per-rank batch split.

The loader is indexed by step, not iterated: the batch of step s depends only on the seed, the
global batch size and s, so every layout sees the same global batch and resuming is free.
"""

from __future__ import annotations

import functools
import glob
import json
import random
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from trainer.errors import ConfigError
from trainer.tokenizer import ByteTokenizer, build_tokenizer, tokenize_document

VAL_FRACTION = 0.01  # of a packed source's windows, held out (the last ones) for validation


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
        self.vocab_size = ByteTokenizer.vocab_size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        rng = random.Random(self.seed * 1_000_003 + index)
        ids: list[int] = []
        while len(ids) < self.seq_len + 1:
            ids += self.tokenizer.encode(_sentence(rng) + " ")
        return torch.tensor(ids[: self.seq_len + 1], dtype=torch.long)


class PackedTokens(Dataset):
    """A token stream (documents joined by EOS) cut into windows of seq_len + 1 that overlap by
    one token, so every token is a label exactly once. The last VAL_FRACTION of the windows (at
    least one) is the validation split."""

    def __init__(self, tokens, seq_len: int, vocab_size: int, split: str, what: str):
        self.tokens, self.seq_len, self.vocab_size = tokens, seq_len, vocab_size
        windows = (len(tokens) - 1) // seq_len
        held_out = max(1, int(windows * VAL_FRACTION))
        if windows <= held_out:
            raise ConfigError(f"{what} holds {len(tokens)} tokens, too few for training.seq_len={seq_len} "
                              f"and a validation split")
        self.first, self.size = (0, windows - held_out) if split == "train" else (windows - held_out, held_out)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.size:
            raise IndexError(index)
        start = (self.first + index) * self.seq_len
        return torch.as_tensor(np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))


def text_paths(pattern: str | None) -> list[str]:
    """The files a glob (or a plain path) names, sorted; a config error when there are none."""
    paths = sorted(p for p in glob.glob(pattern) if Path(p).is_file()) if pattern else []
    if not paths:
        raise ConfigError(f"data.path={pattern} matches no readable file (needed by data.source=text)")
    return paths


@functools.lru_cache(maxsize=1)
def _text_stream(paths: tuple[str, ...], tokenizer_spec: str) -> tuple[np.ndarray, int]:
    """The files' token stream (tokenized once for the training and validation splits)."""
    tokenizer = build_tokenizer(tokenizer_spec)
    tokens = [t for p in paths for t in tokenize_document(Path(p).read_text(errors="replace"), tokenizer)]
    return np.array(tokens, dtype=np.int64), tokenizer.vocab_size


def read_binary(path: str | None) -> tuple[np.ndarray, dict]:
    """A pre-tokenized file of scripts/prepare_data.py (memory-mapped) and its description."""
    meta_path = Path(f"{path}.json") if path else None
    if meta_path is None or not Path(path).is_file() or not meta_path.is_file():
        raise ConfigError(f"data.path={path} is not a token file with its .json beside it "
                          f"(write one with scripts/prepare_data.py)")
    meta = json.loads(meta_path.read_text())
    return np.memmap(path, dtype=meta["dtype"], mode="r"), meta


def build_dataset(data, seq_len: int, seed: int, split: str = "train") -> Dataset:
    if data.source == "embedded":
        if data.tokenizer != "bytes":
            raise ConfigError(f"data.tokenizer={data.tokenizer} needs data.source=text (the embedded text is bytes)")
        # Validation draws from a disjoint stream of the same generator.
        return EmbeddedText(seq_len, seed if split == "train" else seed + 7919)
    if data.source == "text":
        tokens, vocab_size = _text_stream(tuple(text_paths(data.path)), data.tokenizer)
        return PackedTokens(tokens, seq_len, vocab_size, split, f"data.path={data.path}")
    if data.source == "binary":
        tokens, meta = read_binary(data.path)
        return PackedTokens(tokens, seq_len, meta["vocab_size"], split, f"data.path={data.path}")
    raise ConfigError(f"data.source={data.source} is unknown; choose 'embedded', 'text' or 'binary'")


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
