"""A user's files: the documents of text, json/jsonl and parquet files, and token files (written by
scripts/prepare_data.py or the token cache), read window by window."""

from __future__ import annotations

import glob
import gzip
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
        raise ConfigError(f"data.path={pattern} matches no readable file (needed by "
                          f"data.source={source})")
    return paths


def documents(source: str, path: str | None, text_field: str = "text",
              problems: Problems | None = None) -> Iterator[str]:
    """The documents of local files: each text file is one; each row of json/jsonl files (JSON
    lines, or one JSON array; .gz too) or parquet files (read with Hugging Face `datasets`) is one,
    its text in the column `text_field`. What cannot be read is passed over and counted in
    `problems`."""
    paths = text_paths(path, source)
    problems = problems if problems is not None else Problems(strict=False)
    if source == "text":
        return filter(None, (_text_file(p, problems) for p in paths))
    return (text for p in paths for text in row_texts(file_rows(source, p, problems), text_field, p,
                                                      problems))


def file_rows(source: str, path: str, problems: Problems) -> Iterable[dict]:
    """The rows of one json/jsonl or parquet file (parquet read with Hugging Face `datasets`)."""
    if source == "json":
        return json_rows(path, problems)
    if not _is_parquet(path, problems):
        return ()
    return parquet_rows(path, problems)


def parquet_rows(path: str, problems: Problems) -> Iterator[dict]:
    """The rows of a parquet file (read with Hugging Face `datasets`); from a damaged page on, the
    file is counted and passed over (pyarrow says what it met)."""
    import datasets

    rows = iter(datasets.load_dataset("parquet", data_files=[path], split="train", streaming=True))
    number = 0
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except (OSError, ValueError) as e:  # (pyarrow's errors derive from both)
            problems.add("damaged", path, f" after row {number} ({str(e).splitlines()[0]})")
            return
        number += 1
        yield row


def _is_parquet(path: str, problems: Problems) -> bool:
    """Whether `path` holds parquet (it starts and ends with PAR1); an empty file is counted and
    passed over, anything else is a config error (pyarrow's own comes later, as a traceback)."""
    with open(path, "rb") as f:
        head = f.read(4)
        size = f.seek(0, os.SEEK_END)
        f.seek(max(size - 4, 0))
        tail = f.read(4)
    if size == 0:
        problems.add("empty", path)
        return False
    if size < 8 or head != b"PAR1" or tail != b"PAR1":
        raise ConfigError(f"data.path: {path} is not a parquet file (data.source=parquet); "
                          f"set data.source to what it holds (text, json)")
    return True


SAID: set[str] = set()  # the lines this process has said


def say_once(line: str) -> None:
    """Prints `line` unless this process has: a job reads its data for its training windows and
    again for its validation ones, and meets the same problems."""
    if line not in SAID:
        SAID.add(line)
        print(line, flush=True)


class Problems:
    """What reading a user's data met: counted per kind and file, and passed over, or with
    data.strict=true refused at the first one. `live` (a stream read during training) says each
    kind when its count reaches 1, 10, 100, ...; else lines() sums them up once."""

    KINDS = {  # kind: (one, many)
        "undecodable": ("bytes that are not UTF-8", "bytes that are not UTF-8 (read as U+FFFD)"),
        "malformed": ("not a JSON object", "lines that are not a JSON object"),
        "no_text": ("no text in data.text_field", "rows without a text in data.text_field"),
        "empty": ("an empty file", "empty files"),
        "damaged": ("a damaged page", "files with a damaged page (the rest of each passed over)"),
    }

    def __init__(self, strict: bool, live: bool = False):
        self.strict, self.live = strict, live
        self.found: dict[str, dict[str, list]] = {}  # kind -> file -> [count, where the first was]

    def add(self, kind: str, file: str, where: str = "", count: int = 1) -> None:
        """`count` of `kind` in `file`, the first of them `where` (e.g. " at line 12")."""
        if self.strict:
            raise ConfigError(f"data.strict=true: {file}{where}: {self.KINDS[kind][0]}")
        entry = self.found.setdefault(kind, {}).setdefault(file, [0, where])
        entry[0] += count
        total = sum(n for n, _ in self.found[kind].values())
        before = total - count
        # reached 1, 10, 100, ...
        if self.live and (before == 0 or len(str(total)) > len(str(before))):
            say_once(self._line(kind))

    def _line(self, kind: str) -> str:
        files = sorted(self.found[kind].items(), key=lambda item: -item[1][0])
        total = sum(n for _, (n, _) in files)
        if kind == "empty":
            each = ", ".join(f for f, _ in files[:3])
        else:
            each = "; ".join(f"{f}: {n}" + (f" (the first{w})" if w else "")
                             for f, (n, w) in files[:3])
        more = f"; {len(files) - 3} more file(s)" if len(files) > 3 else ""
        return f"data: passed over {total} {self.KINDS[kind][1]}: {each}{more}"

    def lines(self) -> list[str]:
        return [self._line(kind) for kind in self.found]


def _decode(raw: bytes, file: str, where: str, problems: Problems) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        text = raw.decode("utf-8", errors="replace")
        problems.add("undecodable", file, f"{where or ' at'} byte {e.start}",
                     text.count("\ufffd") - raw.count("\ufffd".encode()))
        return text


def _text_file(path: str, problems: Problems) -> str | None:
    raw = Path(path).read_bytes()
    if not raw.strip():
        problems.add("empty", path)
        return None
    # Line ends as reading in text mode gives them.
    return _decode(raw, path, "", problems).replace("\r\n", "\n").replace("\r", "\n")


def json_rows(path: str, problems: Problems) -> Iterator[dict]:
    """The objects of a JSON-lines file, or of a file holding one JSON array; anything else
    counted."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if not head:
            problems.add("empty", path)
            return
        if head.startswith(b"["):
            try:
                items = json.loads(_decode(f.read(), path, "", problems))
            except ValueError as e:
                problems.add("malformed", path, f" ({e})")
                return
            lines = enumerate(items, 1)
        else:
            lines = ((n, line) for n, line in enumerate(f, 1) if line.strip())
        for number, line in lines:
            row = line
            if isinstance(line, bytes):
                try:
                    row = json.loads(_decode(line, path, f" at line {number},", problems))
                except ValueError:
                    row = None
            if isinstance(row, dict):
                yield row
            else:
                problems.add("malformed", path,
                             f" at {'line' if isinstance(line, bytes) else 'item'} {number}")


# A source whose first rows all lack data.text_field names a column it does not have: a config
# error, not rows to pass over.
FIELD_CHECK_ROWS = 100


JSON_NAMES = {type(None): "null", bool: "true/false", int: "numbers", float: "numbers",
              list: "lists", dict: "objects"}


def row_texts(rows: Iterable[dict], field: str, what: str, problems: Problems) -> Iterator[str]:
    """The texts in column `field` of the rows of `what` (a file, or a dataset); rows without one
    are counted in `problems`."""
    texts, columns, held = 0, None, set()
    for number, row in enumerate(rows, 1):
        text = row.get(field)
        if isinstance(text, str):
            texts += 1
            yield text
            continue
        columns = columns or sorted(row)
        if field in row:
            held.add(JSON_NAMES.get(type(text), type(text).__name__))
        if texts == 0 and number == FIELD_CHECK_ROWS:
            break
        problems.add("no_text", what, f" at row {number}")
    if columns is not None and texts == 0:
        if held:  # the column is there, holding numbers, lists, nulls...
            raise ConfigError(f"data.text_field={field} of {what} holds no text: its values are "
                              f"{', '.join(sorted(held))}, not strings")
        raise ConfigError(f"data.text_field={field} is not a column of {what}; its columns are "
                          f"{columns}")


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
        return np.frombuffer(os.pread(self.fd, count, start * self.dtype.itemsize),
                             dtype=self.dtype)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self[:].astype(dtype) if dtype else self[:]


def read_token_file(path: str | Path, what: str) -> tuple[TokenFile, dict]:
    """A token file and its description, the .json beside it; a config error for a file shorter or
    longer than it says."""
    meta_path = Path(f"{path}.json")
    if not Path(path).is_file() or not meta_path.is_file():
        raise ConfigError(f"{what} is not a token file with its .json beside it "
                          f"(write one with scripts/prepare_data.py)")
    meta = _description(meta_path)
    expected = meta["tokens"] * np.dtype(meta["dtype"]).itemsize
    if Path(path).stat().st_size != expected:
        raise ConfigError(f"{what} holds {Path(path).stat().st_size} bytes, not the {expected} its "
                          f".json describes ({meta['tokens']} {meta['dtype']} tokens): truncated "
                          "or replaced")
    return TokenFile(path, meta["dtype"], meta["tokens"]), meta


TOKEN_DTYPES = ("uint16", "uint32")  # what a token file holds (prepare_data.py's TokenWriter)


def _description(meta_path: Path) -> dict:
    """A token file's .json, with the keys a reader needs, each of its type: else a config error
    naming the key."""
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{meta_path} is not readable JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{meta_path} holds no JSON object (a token file's description)")
    counts = {"tokens": 0, "vocab_size": 1}  # each an integer, at least this
    for key, least in counts.items():
        value = meta.get(key)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
            raise ConfigError(f"{meta_path}: {key} is {value!r} (missing, or not an integer >= "
                              f"{least}); write the file again with scripts/prepare_data.py")
    if meta.get("dtype") not in TOKEN_DTYPES:
        raise ConfigError(f"{meta_path}: dtype is {meta.get('dtype')!r} (missing, or not one of "
                          f"{list(TOKEN_DTYPES)}); write the file again with "
                          "scripts/prepare_data.py")
    eos = meta.get("eos_id", "missing")
    if eos is not None and not (isinstance(eos, int) and 0 <= eos < meta["vocab_size"]):
        raise ConfigError(f"{meta_path}: eos_id is {eos!r}, not a token id below its vocab_size "
                          f"{meta['vocab_size']}")
    return meta
