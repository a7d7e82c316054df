"""Data: text the code generates itself, a user's files (text, json/jsonl, parquet), a streamed
Hugging Face Hub dataset or a pre-tokenized binary file, packed into windows; and the per-rank
batch split.

The loader is indexed by step, not iterated: the batch of step s depends only on the seed, the
global batch size and s, so every layout sees the same global batch and resuming is free.
"""

from __future__ import annotations

import functools
import glob
import itertools
import json
import os
import random
import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from trainer.errors import ConfigError
from trainer.tokenizer import ByteTokenizer, build_tokenizer, encode_documents

SOURCES = ("embedded", "text", "json", "parquet", "hub", "binary")
VAL_FRACTION = 0.01  # of a packed source's windows, held out (the last ones) for validation
STREAM_VAL_WINDOWS = 256  # of a streamed Hub dataset, held out (the first ones) for validation


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
        self.vocab_size, self.eos_id = ByteTokenizer.vocab_size, ByteTokenizer.eos_id

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
    one token, so every token is a label exactly once. Split "all" is every window; else the last
    VAL_FRACTION of them (at least one) is split "val" and the rest "train"."""

    def __init__(self, tokens, seq_len: int, vocab_size: int, eos_id: int, split: str, what: str):
        self.tokens, self.seq_len, self.vocab_size, self.eos_id = tokens, seq_len, vocab_size, eos_id
        windows = (len(tokens) - 1) // seq_len
        held_out = 0 if split == "all" else max(1, int(windows * VAL_FRACTION))
        if windows <= held_out:  # (for split all: no window at all)
            raise ConfigError(f"{what} holds {len(tokens)} tokens, too few for training.seq_len={seq_len}"
                              + ("" if split == "all" else " and a validation split"))
        self.first, self.size = (windows - held_out, held_out) if split == "val" else (0, windows - held_out)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.size:
            raise IndexError(index)
        start = (self.first + index) * self.seq_len
        return torch.as_tensor(np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))


def text_paths(pattern: str | None, source: str = "text") -> list[str]:
    """The files a glob (or a plain path) names, sorted; a config error when there are none."""
    paths = sorted(p for p in glob.glob(pattern) if Path(p).is_file()) if pattern else []
    if not paths:
        raise ConfigError(f"data.path={pattern} matches no readable file (needed by data.source={source})")
    return paths


def documents(source: str, path: str | None, text_field: str = "text") -> Iterator[str]:
    """The documents of local files: each text file is one; each row of json, jsonl or parquet
    files (read with Hugging Face `datasets`) is one, its text in the column `text_field`."""
    paths = text_paths(path, source)
    if source == "text":
        return (Path(p).read_text(errors="replace") for p in paths)
    import datasets

    builder = {"json": "json", "parquet": "parquet"}[source]
    rows = datasets.load_dataset(builder, data_files=paths, split="train", streaming=True)
    return _texts(rows, text_field, f"data.path={path}")


def _texts(rows: Iterable[dict], field: str, what: str) -> Iterator[str]:
    for row in rows:
        if field not in row:
            raise ConfigError(f"data.text_field={field} is not a column of {what}; its columns are {sorted(row)}")
        yield row[field]


@functools.lru_cache(maxsize=2)
def _token_stream(source: str, path: str, text_field: str, tokenizer_spec: str) -> np.ndarray:
    """Local files' token stream, tokenized once for the training and validation splits."""
    groups = list(encode_documents(documents(source, path, text_field), build_tokenizer(tokenizer_spec)))
    return np.concatenate(groups) if groups else np.zeros(0, dtype=np.int64)


def read_binary(path: str | None) -> tuple[np.ndarray, dict]:
    """A pre-tokenized file of scripts/prepare_data.py (memory-mapped) and its description."""
    meta_path = Path(f"{path}.json") if path else None
    if meta_path is None or not Path(path).is_file() or not meta_path.is_file():
        raise ConfigError(f"data.path={path} is not a token file with its .json beside it "
                          f"(write one with scripts/prepare_data.py)")
    meta = json.loads(meta_path.read_text())
    return np.memmap(path, dtype=meta["dtype"], mode="r"), meta


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
            texts = _texts(rows, self.data.text_field, what)
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


def build_dataset(data, seq_len: int, seed: int, split: str = "train") -> Dataset:
    """The windows of `data` (a DataConfig) for split "train", "val" or "all" (every window)."""
    if data.source == "embedded":
        if data.tokenizer != "bytes":
            raise ConfigError(f"data.tokenizer={data.tokenizer} needs another data.source (the embedded text is bytes)")
        # Validation draws from a disjoint stream of the same generator.
        return EmbeddedText(seq_len, seed if split == "train" else seed + 7919)
    what = f"data.path={data.path}"
    if data.source in ("text", "json", "parquet"):
        tokens = _token_stream(data.source, data.path, data.text_field, data.tokenizer)
        tokenizer = build_tokenizer(data.tokenizer)
        return PackedTokens(tokens, seq_len, tokenizer.vocab_size, tokenizer.eos_id, split, what)
    if data.source == "binary":
        tokens, meta = read_binary(data.path)
        return PackedTokens(tokens, seq_len, meta["vocab_size"], meta["eos_id"], split, what)
    if data.source == "hub":
        if not data.path:
            raise ConfigError("data.path=None must name a Hugging Face dataset for data.source=hub")
        return HubStream(data, seq_len, split)
    raise ConfigError(f"data.source={data.source} is unknown; choose one of {list(SOURCES)}")


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
        self.fn, self._pool, self._next = fn, ThreadPoolExecutor(1, thread_name_prefix="prefetch"), None

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
        if getattr(self.dataset, "sequential", False):
            return position  # a stream is read in its own order
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
