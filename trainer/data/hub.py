"""A Hugging Face Hub dataset, streamed and tokenized as training reaches it."""

from __future__ import annotations

import hashlib
import itertools
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from trainer.data.readers import Problems, row_texts
from trainer.data.tokenizer import build_tokenizer, encode_documents
from trainer.errors import ConfigError

STREAM_VAL_WINDOWS = 256  # of a streamed Hub dataset, held out (the first ones) for validation


class HubStream(Dataset):
    """A Hugging Face Hub dataset, streamed: documents read in order, tokenized and cut into
    windows of seq_len + 1 as training reaches them; nothing is downloaded ahead.

    Split "val" is the first STREAM_VAL_WINDOWS windows of the stream (read once and kept). Split
    "train" is every document but those the validation windows touch, split "all" every document,
    in stream order (`sequential`: not shuffled), starting over at the stream's end. The loader
    gives each data-parallel rank a shard of its own (`per_rank`; datasets' split_dataset_by_node:
    whole files when they divide evenly over the ranks, else every dp-th row), so a rank reads and
    tokenizes its share only; a resumed run reads (and drops) its shard up to its position.
    """

    def __init__(self, data, seq_len: int, split: str, shard: tuple[int, int] = (0, 1),
                 held_out: frozenset | None = None):
        self.data, self.seq_len, self.split, self.shard_of = data, seq_len, split, shard
        self.tokenizer = build_tokenizer(data.tokenizer)
        # Each rank meets the problems of its own shard (and every rank those of the validation
        # windows): rank 0 says what it meets, so that a
        # user reads each line once, not once per rank.
        self.problems = Problems(data.strict, live=os.environ.get("RANK", "0") == "0")
        self.vocab_size, self.eos_id = self.tokenizer.vocab_size, self.tokenizer.eos_id
        self.windows = None
        if split != "all" and held_out is None:
            self.windows, held_out = self._validation()
        self.held_out = held_out or frozenset()  # digests of the validation windows' documents
        self.sequential = self.per_rank = split != "val"
        if self.sequential:
            self.windows = None
            self._restart()

    def shard(self, rank: int, world: int) -> HubStream:
        """This stream as data-parallel rank `rank` of `world` reads it."""
        return HubStream(self.data, self.seq_len, self.split, (rank, world), self.held_out)

    def _open(self, whole: bool = False) -> Iterator[str]:
        """The documents of the stream (of this rank's shard unless `whole`), held-out ones left
        out."""
        name, what = self.data.path, f"data.path={self.data.path}"
        rank, world = (0, 1) if whole else self.shard_of
        try:
            _check_hub_reachable(name)
            import datasets
            from datasets.distributed import split_dataset_by_node

            rows = datasets.load_dataset(name, self.data.subset, split=self.data.split,
                                         streaming=True)
            if world > 1:
                rows = split_dataset_by_node(rows, rank=rank, world_size=world)
            texts = row_texts(rows, self.data.text_field, what, self.problems)
            if not whole and self.held_out:
                texts = (text for text in texts if _digest(text) not in self.held_out)
            first = next(texts)
        except ConfigError:
            raise
        except StopIteration:
            whose = f" for data-parallel rank {rank} of {world}" if world > 1 else ""
            left = " once the validation windows' documents are held out" if self.held_out else ""
            raise ConfigError(f"{what} (data.split={self.data.split}) holds no "
                              f"documents{whose}{left}") from None
        except Exception as e:  # the Hub's and datasets' many errors, one line for the user
            raise ConfigError(f"{what}: cannot stream the Hugging Face dataset {name} "
                              f"(data.split={self.data.split}): {type(e).__name__}: "
                              f"{e}".splitlines()[0]) from None
        return itertools.chain([first], texts)

    def _validation(self) -> tuple[list[torch.Tensor], frozenset]:
        """The first STREAM_VAL_WINDOWS windows of the whole stream, and the digests of the
        documents they touch (which training leaves out)."""
        need, held_out, groups, have = STREAM_VAL_WINDOWS * self.seq_len + 1, set(), [], 0
        for text in self._open(whole=True):
            held_out.add(_digest(text))
            groups += list(encode_documents([text], self.tokenizer))
            have += len(groups[-1])
            if have >= need:
                break
        if have < need:
            raise ConfigError(f"data.path={self.data.path} (data.split={self.data.split}) holds "
                              f"{have} tokens, too few for {STREAM_VAL_WINDOWS} validation windows "
                              f"of training.seq_len={self.seq_len}")
        tokens = np.concatenate(groups)
        windows = [torch.from_numpy(tokens[i * self.seq_len : (i + 1) * self.seq_len + 1].copy())
                   for i in range(STREAM_VAL_WINDOWS)]
        return windows, frozenset(held_out)

    def _restart(self) -> None:
        self._groups = encode_documents(self._open(), self.tokenizer)
        # tokens from window self._start on
        self._buffer, self._start = np.zeros(0, dtype=np.int64), 0

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
        return self._window(index) if self.windows is None else self.windows[index]


def hub_rows(data) -> Iterator[dict]:
    """Every row of the Hub dataset data.path (data.subset, data.split), streamed in order."""
    try:
        _check_hub_reachable(data.path)
        import datasets

        yield from datasets.load_dataset(data.path, data.subset, split=data.split, streaming=True)
    except ConfigError:
        raise
    except Exception as e:  # the Hub's and datasets' many errors, one line for the user
        raise ConfigError(f"data.path={data.path}: cannot stream the Hugging Face dataset "
                          f"(data.split={data.split}): {type(e).__name__}: "
                          f"{e}".splitlines()[0]) from None


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", errors="replace"), digest_size=16).digest()


def _check_hub_reachable(name: str) -> None:
    """Fails in seconds, not after datasets' minute of retries, when the Hub cannot be reached."""
    if (Path(name).exists() or os.environ.get("HF_HUB_OFFLINE")
        or os.environ.get("HF_DATASETS_OFFLINE")):
        # a local dataset folder, or offline mode, where datasets answers from its cache at once
        return
    import huggingface_hub

    huggingface_hub.dataset_info(name, timeout=10)
