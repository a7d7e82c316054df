"""Tokenizers: UTF-8 bytes (the default), or a local Hugging Face tokenizer (`tokenizer.json`,
read with the `tokenizers` library; nothing is downloaded).

Documents are packed end to end, each followed by the tokenizer's end-of-sequence token (and
preceded by its beginning-of-sequence token when the tokenizer's config asks for one, as Llama's
do), so a window of the stream may hold the end of one document and the start of the next.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from trainer.errors import ConfigError

CHUNK_CHARS = 1 << 18  # long documents are tokenized in pieces of about this size, cut at line ends

# Names an end-of-sequence token goes by, when tokenizer_config.json does not say.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255; byte 0 (NUL, absent from text) ends a document."""

    vocab_size = 256
    eos_id = 0
    bos_id = None
    pad_id = None
    fingerprint = "bytes"  # what identifies the ids it gives (token caches are keyed by it)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 < i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face fast tokenizer from a directory holding tokenizer.json, or the file itself."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
        if not file.is_file():
            raise ConfigError(f"data.tokenizer={path} is neither 'bytes' nor a tokenizer.json or a "
                              "directory holding one")
        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        # the tokenizers library raises its own exception class for every failure
        except Exception as e:
            raise ConfigError(f"data.tokenizer={path}: {file} is not a tokenizer the tokenizers "
                              f"library reads ({str(e).splitlines()[0]})") from None
        # Ids need not be dense (added tokens may sit above
        # the base vocabulary): the largest bounds them.
        self.vocab_size = max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        config_file = file.parent / "tokenizer_config.json"
        try:
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        except json.JSONDecodeError as e:
            raise ConfigError(f"data.tokenizer={path}: {config_file} is not JSON ({e})") from None
        eos_names = [name for name in (_token_name(config.get("eos_token")), *EOS_NAMES) if name]
        eos = [i for i in map(self.tokenizer.token_to_id, eos_names) if i is not None]
        if not eos:
            raise ConfigError(f"data.tokenizer={path} has no end-of-sequence token (looked for "
                              f"{eos_names})")
        self.eos_id = eos[0]
        # A beginning-of-sequence token only where the config names one that is not EOS and does
        # not turn it off (GPT-2-style tokenizers call EOS their BOS and add none).
        bos = _token_name(config.get("bos_token"))
        self.bos_id = (self.tokenizer.token_to_id(bos) if bos and config.get("add_bos_token", True)
                       else None)
        if self.bos_id == self.eos_id:
            self.bos_id = None
        pad = _token_name(config.get("pad_token"))
        self.pad_id = self.tokenizer.token_to_id(pad) if pad else None
        content = file.read_bytes() + f"|bos {self.bos_id}|eos {self.eos_id}".encode()
        self.fingerprint = hashlib.sha256(content).hexdigest()[:16]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def _token_name(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


def is_bytes(spec: str) -> bool:
    """Whether data.tokenizer `spec` means UTF-8 bytes (`auto` where no weights hold a
    tokenizer)."""
    return spec in ("bytes", "auto")


@functools.lru_cache(maxsize=4)
def build_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    return ByteTokenizer() if is_bytes(spec) else HFTokenizer(spec)


def pieces(documents: Iterable[str]) -> Iterator[tuple[str, bool, bool]]:
    """(text, starts a document, ends a document) for each piece of each document: a long document
    is cut at line ends into pieces of about CHUNK_CHARS, so that several processes can share it."""
    for text in documents:
        start = 0
        while True:
            end = text.find("\n", start + CHUNK_CHARS)
            end = len(text) if end < 0 else end + 1
            yield text[start:end], start == 0, end == len(text)
            start = end
            if start == len(text):
                break


def encode_pieces(group: list[tuple[str, bool, bool]], tokenizer) -> np.ndarray:
    """The tokens of consecutive pieces, with BOS before each document (when the tokenizer has one)
    and EOS after it. The trainer and scripts/prepare_data.py both tokenize this way, so they
    agree."""
    ids: list[int] = []
    for text, first, last in group:
        if first and tokenizer.bos_id is not None:
            ids.append(tokenizer.bos_id)
        ids += tokenizer.encode(text)
        if last:
            ids.append(tokenizer.eos_id)
    return np.array(ids, dtype=np.int64)


def encode_documents(documents: Iterable[str], tokenizer) -> Iterator[np.ndarray]:
    """The token stream of `documents`, piece by piece."""
    return (encode_pieces([piece], tokenizer) for piece in pieces(documents))
