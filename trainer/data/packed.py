"""A token stream cut into training windows."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from trainer.errors import ConfigError

VAL_FRACTION = 0.01  # of a packed source's windows, held out (the last ones) for validation


class PackedTokens(Dataset):
    """A token stream (documents joined by EOS; an array or a memory map) cut into windows of
    seq_len + 1 that overlap by one token, so every token is a label exactly once. Split "all" is
    every window; else the last VAL_FRACTION of them (at least one) is split "val" and the rest
    "train". A window is read from the stream only when asked for."""

    def __init__(self, tokens, seq_len: int, vocab_size: int, eos_id: int, split: str, what: str):
        self.tokens, self.seq_len = tokens, seq_len
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
        return torch.as_tensor(np.asarray(self.tokens[start : start + self.seq_len + 1],
                                          dtype=np.int64))
