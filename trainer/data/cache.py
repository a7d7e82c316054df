"""Token files and the token cache: text/json/parquet sources are tokenized once, into the format
scripts/prepare_data.py writes, which every rank reads window by window.

A cache file is named by what made it: the files (path, size, modification time), the column read
and the tokenizer. A lock file lets one process on a shared filesystem tokenize while the others
wait for its file, which appears whole (written aside, then renamed) or not at all.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from trainer.data.readers import (
    Problems,
    TokenFile,
    documents,
    read_token_file,
    say_once,
    text_paths,
)
from trainer.data.tokenizer import build_tokenizer, encode_documents, is_bytes
from trainer.errors import ConfigError
from trainer.safe_write import temporary_beside

# bumped when the tokens written for the same input would change (2: empty files skipped)
CACHE_FORMAT = 2


class TokenWriter:
    """Writes a token file: ids appended in order (uint16 when the vocabulary fits, else uint32)
    to a file aside; `finish` puts it and its description (OUT.json) in place by renames, so a
    reader sees the whole file or none. Leaving the block without `finish` removes the partial
    file."""

    def __init__(self, out: Path, tokenizer):
        self.out, self.tokenizer, self.tokens = Path(out), tokenizer, 0
        self.dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
        self.tmp = temporary_beside(self.out)

    def __enter__(self) -> TokenWriter:
        self.file = open(self.tmp, "wb")
        return self

    def write(self, ids: np.ndarray) -> None:
        self.file.write(ids.astype(self.dtype).tobytes())
        self.tokens += len(ids)

    def finish(self, **description) -> dict:
        self.file.close()
        tok = self.tokenizer
        meta = {"dtype": np.dtype(self.dtype).name, "tokens": self.tokens,
                "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "bos_id": tok.bos_id,
                "tokenizer_hash": tok.fingerprint, **description}
        meta_tmp = self.tmp.with_name(self.tmp.name + ".json")
        meta_tmp.write_text(json.dumps(meta, indent=1))
        os.replace(self.tmp, self.out)
        os.replace(meta_tmp, f"{self.out}.json")
        return meta

    def __exit__(self, *exc) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def cache_folder(cache_dir: str | None) -> Path:
    if cache_dir:
        return Path(cache_dir)
    return Path(os.environ.get("TRAINER_CACHE") or Path.home() / ".cache" / "trainer") / "tokens"


def cached_tokens(source: str, path: str | None, text_field: str, tokenizer_spec: str,
                  cache_dir: str | None, strict: bool = False) -> tuple[TokenFile, dict]:
    """The token stream of local text/json/parquet files, read from the cache (tokenized
    into it first by whichever process gets there first). What the tokenizing passed over is kept
    with the cache and said again by each job that reads it (refused under `strict`)."""
    tokenizer = build_tokenizer(tokenizer_spec)
    files = source_files(path, source)
    made_of = {"format": CACHE_FORMAT, "source": source, "text_field": text_field,
               "tokenizer": tokenizer.fingerprint, "files": files}
    key = hashlib.sha256(json.dumps(made_of).encode()).hexdigest()[:24]
    folder = cache_folder(cache_dir)
    out = folder / f"{key}.bin"

    def tokenize() -> None:
        print(f"data: tokenizing {len(files)} file(s) of data.path={path} once, into {out}",
              flush=True)
        _tokenize(out, tokenizer, source, path, text_field, tokenizer_spec, strict)

    made_once(Path(f"{out}.json"), folder / f"{key}.lock", tokenize)
    tokens, meta = read_token_file(out, f"the token cache {out} (of data.path={path})")
    check_tokenizer(meta, tokenizer, f"the token cache {out} (of data.path={path})", "delete it")
    # cached by a lenient job: read again, to name the first problem
    if meta.get("problems") and strict:
        for _ in documents(source, path, text_field, Problems(strict=True)):
            pass
    if os.environ.get("RANK", "0") == "0":
        for line in meta.get("problems", []):
            say_once(f"{line} (of data.path={path}; data.strict=true refuses them)")
    return tokens, meta


def source_files(path: str | None, source: str) -> list:
    """[path, size, modification time] of each file data.path names: what a cache key is made of."""
    return [[str(Path(p).resolve()), (st := os.stat(p)).st_size, st.st_mtime_ns]
            for p in text_paths(path, source)]


def cache_key(made_of: dict) -> str:
    return hashlib.sha256(json.dumps(made_of, sort_keys=True).encode()).hexdigest()[:24]


def made_once(done: Path, lock_file: Path, make) -> None:
    """Calls `make` unless `done` exists, in one process of those sharing the cache folder (the
    others wait on the lock, then find `done`). `make` must write `done` last, whole (written aside,
    renamed)."""
    if done.is_file():
        return
    try:
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        lock = open(lock_file, "w")
    except OSError as e:
        raise ConfigError(f"data.cache_dir={lock_file.parent} cannot hold the token cache: "
                          f"{e}") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            make()


def _tokenize(out: Path, tokenizer, source: str, path: str, text_field: str, tokenizer_spec: str,
              strict: bool) -> None:
    problems = Problems(strict)
    with TokenWriter(out, tokenizer) as writer:
        for ids in encode_documents(documents(source, path, text_field, problems), tokenizer):
            writer.write(ids)
        named = "bytes" if is_bytes(tokenizer_spec) else tokenizer_spec
        writer.finish(tokenizer=named, source=source, path=path, text_field=text_field,
                      problems=problems.lines())


def check_tokenizer(meta: dict, tokenizer, what: str, remedy: str) -> None:
    """A config error when a token file was written with another tokenizer than `tokenizer`."""
    if meta.get("tokenizer_hash", tokenizer.fingerprint) != tokenizer.fingerprint:
        raise ConfigError(f"{what} was tokenized with {meta.get('tokenizer')}, not with this "
                          f"data.tokenizer (its ids would stand for other tokens): {remedy}")
