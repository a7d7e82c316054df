"""Text the code generates itself: the default source, which needs no files or network."""

from __future__ import annotations

import random

import torch
from torch.utils.data import Dataset

from trainer.data.tokenizer import ByteTokenizer

_NAMES = ("anna ben clara david emma felix grace henry iris jack kate leo mia noah olive "
          "paul".split())
_NOUNS = ("cat dog bird horse river stone tree house boat garden window road king queen child "
          "letter".split())
_ADJECTIVES = "red small old quiet bright cold green heavy warm tall dark gentle".split()
_VERBS = "sees finds holds paints follows carries watches builds opens keeps".split()
_PLACES = "the market,the hill,the sea,the old town,the forest,the station".split(",")


def sentence(rng: random.Random) -> str:
    """One sentence of the embedded text, drawn from `rng` (tests make text of their own with
    it)."""
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randrange(50), rng.randrange(50)
        return f"{a} plus {b} is {a + b}."
    if kind == 1:
        return (f"{rng.choice(_NAMES).title()} {rng.choice(_VERBS)} the {rng.choice(_ADJECTIVES)} "
                f"{rng.choice(_NOUNS)}.")
    if kind == 2:
        return f"The {rng.choice(_NOUNS)} near {rng.choice(_PLACES)} is {rng.choice(_ADJECTIVES)}."
    name = rng.choice(_NAMES).title()
    return (f"{name} walks to {rng.choice(_PLACES)}, and {name} {rng.choice(_VERBS)} a "
            f"{rng.choice(_NOUNS)}.")


class EmbeddedText(Dataset):
    """Sequences of generated English-like text: counting facts and simple sentences.

    Sequence i is made from its own seeded generator, so no corpus is stored and any index is
    produced in isolation. Regular enough that a small model's loss falls quickly.
    """

    def __init__(self, seq_len: int, seed: int, size: int = 1_000_000):
        self.seq_len, self.seed, self.size = seq_len, seed, size
        self.tokenizer = ByteTokenizer()
        self.vocab_size, self.eos_id = ByteTokenizer.vocab_size, ByteTokenizer.eos_id

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        rng = random.Random(self.seed * 1_000_003 + index)
        ids: list[int] = []
        while len(ids) < self.seq_len + 1:
            ids += self.tokenizer.encode(sentence(rng) + " ")
        return torch.tensor(ids[: self.seq_len + 1], dtype=torch.long)
