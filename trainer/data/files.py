"""A user's files: the documents of text, json/jsonl and parquet files, and token files (written by
scripts/prepare_data.py or the token cache), read window by window."""

from __future__ import annotations

import glob
import json
import os
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from trainer.errors import ConfigError


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
    return row_texts(rows, text_field, f"data.path={path}")


def row_texts(rows: Iterable[dict], field: str, what: str) -> Iterator[str]:
    for row in rows:
        if field not in row:
            raise ConfigError(f"data.text_field={field} is not a column of {what}; its columns are {sorted(row)}")
        yield row[field]


class TokenFile:
    """A token file read a slice at a time (pread), never mapped whole: a rank's memory holds the
    windows it asked for, whatever the file's size. (A memory map would count every page it
    touched, and those the kernel maps around them, in each rank's resident memory.)"""

    def __init__(self, path: str | Path, dtype: str, tokens: int):
        self.dtype, self.size = np.dtype(dtype), tokens
        self.fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: slice) -> np.ndarray:
        start, stop, step = key.indices(self.size)
        if step != 1:
            raise IndexError("a token file is read in contiguous slices")
        count = max(0, stop - start) * self.dtype.itemsize
        return np.frombuffer(os.pread(self.fd, count, start * self.dtype.itemsize), dtype=self.dtype)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self[:].astype(dtype) if dtype else self[:]


def read_token_file(path: str | Path, what: str) -> tuple[TokenFile, dict]:
    """A token file and its description, the .json beside it; a config error for a file shorter or
    longer than it says."""
    meta_path = Path(f"{path}.json")
    if not Path(path).is_file() or not meta_path.is_file():
        raise ConfigError(f"{what} is not a token file with its .json beside it "
                          f"(write one with scripts/prepare_data.py)")
    meta = json.loads(meta_path.read_text())
    expected = meta["tokens"] * np.dtype(meta["dtype"]).itemsize
    if Path(path).stat().st_size != expected:
        raise ConfigError(f"{what} holds {Path(path).stat().st_size} bytes, not the {expected} its .json "
                          f"describes ({meta['tokens']} {meta['dtype']} tokens): truncated or replaced")
    return TokenFile(path, meta["dtype"], meta["tokens"]), meta
