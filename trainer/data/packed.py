"""A token stream cut into training windows."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from trainer.errors import ConfigError

VAL_FRACTION = 0.01  # of a packed source's windows, held out (the last ones) for validation
SCANNED_TOKENS = 1 << 20  # of a token file, checked against its vocabulary before launch


class PackedTokens(Dataset):
    """A token stream (documents joined by EOS; an array or a memory map) cut into windows of
    seq_len + 1 that overlap by one token, so every token is a label exactly once. Split "all" is
    every window; else the last VAL_FRACTION of them (at least one) is split "val" and the rest
    "train". A window is read from the stream only when asked for."""

    def __init__(self, tokens, seq_len: int, vocab_size: int, eos_id: int, split: str, what: str):
        self.tokens, self.seq_len, self.what = tokens, seq_len, what
        self.vocab_size, self.eos_id = vocab_size, eos_id
        windows = (len(tokens) - 1) // seq_len
        held_out = 0 if split == "all" else max(1, int(windows * VAL_FRACTION))
        if windows <= held_out:  # (for split all: no window at all)
            raise ConfigError(f"{what} holds {len(tokens)} tokens, too few for "
                              f"training.seq_len={seq_len}"
                              + ("" if split == "all" else " and a validation split"))
        if split == "val":
            self.first, self.size = windows - held_out, held_out
        else:
            self.first, self.size = 0, windows - held_out

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.size:
            raise IndexError(index)
        start = (self.first + index) * self.seq_len
        window = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        check_ids(window, self.vocab_size, self.what, start)
        return torch.as_tensor(window)


def check_ids(ids: np.ndarray, vocab_size: int, what: str, offset: int = 0) -> None:
    """A config error naming the first id of `ids` (tokens `offset`... of `what`) that the
    vocabulary does not hold: on a GPU the embedding would fail in a device-side assert naming
    nothing."""
    ids = np.asarray(ids, dtype=np.int64)
    bad = np.flatnonzero((ids >= vocab_size) | (ids < 0))
    if bad.size:
        raise ConfigError(f"{what} holds token id {int(ids[bad[0]])} at token {offset + bad[0]}, "
                          f"outside its vocabulary of {vocab_size} (the .json's vocab_size): the "
                          "file is damaged, or was written for another tokenizer")
