"""A Hugging Face Hub dataset, streamed and tokenized as training reaches it."""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from trainer.data.files import row_texts
from trainer.errors import ConfigError
from trainer.tokenizer import build_tokenizer, encode_documents

STREAM_VAL_WINDOWS = 256  # of a streamed Hub dataset, held out (the first ones) for validation


class HubStream(Dataset):
    """A Hugging Face Hub dataset, streamed: documents read in order, tokenized and cut into
    windows of seq_len + 1 as training reaches them; nothing is downloaded ahead.

    The first STREAM_VAL_WINDOWS windows are split "val" (read once and kept); split "train" is
    every window after them and split "all" every window, in stream order (`sequential`: the loader
    does not shuffle them), starting over at the stream's end. A resumed run reads (and drops) the
    stream up to its position. Every rank reads the whole stream and keeps its own windows; at
    scale, prepare a binary file instead.
    """

    def __init__(self, data, seq_len: int, split: str):
        self.data, self.seq_len = data, seq_len
        self.tokenizer = build_tokenizer(data.tokenizer)
        self.vocab_size, self.eos_id = self.tokenizer.vocab_size, self.tokenizer.eos_id
        self.first = STREAM_VAL_WINDOWS if split == "train" else 0
        self._restart()
        self.windows = [self._window(i) for i in range(STREAM_VAL_WINDOWS)] if split == "val" else None
        self.sequential = self.windows is None

    def _open(self) -> Iterator[str]:
        name, what = self.data.path, f"data.path={self.data.path}"
        try:
            _check_hub_reachable(name)
            import datasets

            rows = datasets.load_dataset(name, self.data.subset, split=self.data.split, streaming=True)
            texts = row_texts(rows, self.data.text_field, what)
            first = next(texts)
        except ConfigError:
            raise
        except StopIteration:
            raise ConfigError(f"{what} (data.split={self.data.split}) holds no documents") from None
        except Exception as e:  # the Hub's and datasets' many errors, one line for the user
            raise ConfigError(f"{what}: cannot stream the Hugging Face dataset {name} "
                              f"(data.split={self.data.split}): {type(e).__name__}: {e}".splitlines()[0]) from None
        return itertools.chain([first], texts)

    def _restart(self) -> None:
        self._groups = encode_documents(self._open(), self.tokenizer)
        self._buffer, self._start = np.zeros(0, dtype=np.int64), 0  # tokens from window self._start on

    def _window(self, index: int) -> torch.Tensor:
        if index < self._start:
            self._restart()
        skip = (index - self._start) * self.seq_len  # tokens before the window, to drop
        while len(self._buffer) < skip + self.seq_len + 1:
            if len(self._buffer) <= skip:
                skip, self._buffer = skip - len(self._buffer), self._buffer[:0]
            group = next(self._groups, None)
            if group is None:  # the end of the stream: on to its start
                self._groups = encode_documents(self._open(), self.tokenizer)
                continue
            self._buffer = np.concatenate([self._buffer, group])
        self._buffer, self._start = self._buffer[skip:], index
        return torch.from_numpy(self._buffer[: self.seq_len + 1].copy())

    def __len__(self) -> int:
        return sys.maxsize if self.windows is None else len(self.windows)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self._window(self.first + index) if self.windows is None else self.windows[index]


def _check_hub_reachable(name: str) -> None:
    """Fails in seconds, not after datasets' minute of retries, when the Hub cannot be reached."""
    if Path(name).exists() or os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE"):
        return  # a local dataset folder, or offline mode, where datasets answers from its cache at once
    import huggingface_hub

    huggingface_hub.dataset_info(name, timeout=10)
