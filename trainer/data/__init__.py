"""Data: text the code generates itself, a user's files (text, json/jsonl, parquet; tokenized once
into a cache), a streamed Hugging Face Hub dataset, a pre-tokenized token file, or a weighted
mixture of these, packed into windows; and each rank's share of each global batch.

The loader is indexed by step, not iterated: the batch of step s depends only on the seed, the
global batch size and s, so every layout sees the same global batch and resuming is free. A rank
holds no corpus: token files are read window by window and the epoch's order is computed index by
index.
"""

from __future__ import annotations

import dataclasses
import os

from torch.utils.data import Dataset

from trainer.data import chat, chat_windows
from trainer.data.cache import cached_tokens, check_tokenizer
from trainer.data.embedded import EmbeddedText, sentence
from trainer.data.hub import STREAM_VAL_WINDOWS, HubStream
from trainer.data.loader import BatchLoader, Prefetcher, document_positions
from trainer.data.mixture import Mixture
from trainer.data.packed import SCANNED_TOKENS, VAL_FRACTION, PackedTokens, check_ids
from trainer.data.readers import documents, read_token_file
from trainer.data.tokenizer import ByteTokenizer, build_tokenizer, is_bytes
from trainer.errors import ConfigError

SOURCES = ("embedded", "text", "json", "parquet", "hub", "binary")

__all__ = ["STREAM_VAL_WINDOWS", "SOURCES", "VAL_FRACTION", "BatchLoader", "ByteTokenizer",
           "EmbeddedText", "Mixture", "PackedTokens", "Prefetcher", "sentence", "build_dataset",
           "document_positions", "documents", "mix_source"]


def build_dataset(data, seq_len: int, seed: int, split: str = "train") -> Dataset:
    """The windows of `data` (a DataConfig) for split "train", "val" or "all" (every window)."""
    if data.mix:
        return _mixture(data, seq_len, seed, split)
    if data.source == "embedded":
        # Validation draws from a disjoint stream of the same generator.
        return EmbeddedText(seq_len, seed if split == "train" else seed + 7919)
    what = f"data.path={data.path}"
    if data.format != "text":
        conversations = _conversations(data, seq_len)
        if split in ("train", "all") and int(os.environ.get("RANK", "0")) == 0:
            print(chat.describe(conversations, data), flush=True)
        tokenizer = build_tokenizer(data.tokenizer)
        pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
        return chat_windows.ChatWindows(conversations, seq_len, data.pack, split, pad,
                                        tokenizer.vocab_size, tokenizer.eos_id)
    if data.source in ("text", "json", "parquet"):
        tokens, meta = cached_tokens(data.source, data.path, data.text_field, data.tokenizer,
                                     data.cache_dir, data.strict)
        return PackedTokens(tokens, seq_len, meta["vocab_size"], meta["eos_id"], split, what)
    if data.source == "binary":
        tokens, meta = read_token_file(data.path, what)
        if not is_bytes(data.tokenizer):  # (bytes says nothing: the file's own tokenizer is used)
            check_tokenizer(meta, build_tokenizer(data.tokenizer), what,
                            "prepare it again with this tokenizer")
        # Before launch, the file's first ids (a file of another tokenizer shows there); each
        # window is checked again as it is read.
        check_ids(tokens[:SCANNED_TOKENS], meta["vocab_size"], what)
        return PackedTokens(tokens, seq_len, meta["vocab_size"], meta["eos_id"], split, what)
    assert data.source == "hub", data.source  # (rules.py names the sources)
    return HubStream(data, seq_len, split)


_READ: dict[str, chat.Conversations] = {}


def _conversations(data, seq_len: int) -> chat.Conversations:
    """data's conversations, read once for both splits."""
    key = repr((data, seq_len))
    if key not in _READ:
        _READ.clear()
        _READ[key] = chat_windows.cached_conversations(data, build_tokenizer(data.tokenizer),
                                                       seq_len)
    return _READ[key]


def mix_source(data, source):
    """One of data.mix's sources as a DataConfig of its own: its keys, data's for the rest (the
    tokenizer)."""
    return dataclasses.replace(data, mix=[],
                               **{f.name: getattr(source, f.name)
                                  for f in dataclasses.fields(source)
                                  if f.name != "weight"})


def _mixture(data, seq_len: int, seed: int, split: str) -> Mixture:
    """data.mix's sources (each read like data.source/path/...), mixed."""
    datasets = []
    for i, source in enumerate(data.mix):
        try:
            datasets.append(build_dataset(mix_source(data, source), seq_len, seed, split))
        except ConfigError as e:
            raise ConfigError(f"data.mix[{i}]: {e}") from None
    return Mixture(datasets, [source.weight for source in data.mix], seed)
