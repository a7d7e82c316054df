"""Tokenizers: UTF-8 bytes (the default), or a local Hugging Face tokenizer (`tokenizer.json`,
read with the `tokenizers` library; nothing is downloaded).

Documents are packed end to end with the tokenizer's end-of-sequence token between them, so a
window of the stream may hold the end of one document and the start of the next.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainer.errors import ConfigError

# Names an end-of-sequence token goes by, when tokenizer_config.json does not say.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255; byte 0 (NUL, absent from text) ends a document."""

    vocab_size = 256
    eos_id = 0

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
            raise ConfigError(f"data.tokenizer={path} is neither 'bytes' nor a tokenizer.json or a directory holding one")
        self.tokenizer = Tokenizer.from_file(str(file))
        # Ids need not be dense (added tokens may sit above the base vocabulary): the largest bounds them.
        self.vocab_size = max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        self.eos_id = self._eos_id(file.parent, path)

    def _eos_id(self, folder: Path, path: str) -> int:
        config = folder / "tokenizer_config.json"
        names = list(EOS_NAMES)
        if config.is_file():
            eos = json.loads(config.read_text()).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if eos:
                names.insert(0, eos)
        for name in names:
            token = self.tokenizer.token_to_id(name)
            if token is not None:
                return token
        raise ConfigError(f"data.tokenizer={path} has no end-of-sequence token (looked for {names})")

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def build_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    return ByteTokenizer() if spec == "bytes" else HFTokenizer(spec)


def tokenize_document(text: str, tokenizer, chunk_chars: int = 1 << 20) -> list[int]:
    """A document's tokens followed by EOS. Long texts are cut at line ends into ~1 MB chunks,
    tokenized one by one (the same cut in prepare_data.py and in the trainer, so both agree)."""
    ids: list[int] = []
    start = 0
    while start < len(text):
        end = text.find("\n", start + chunk_chars)
        end = len(text) if end < 0 else end + 1
        ids += tokenizer.encode(text[start:end])
        start = end
    ids.append(tokenizer.eos_id)
    return ids
