"""Data: text the code generates itself, a user's files (text, json/jsonl, parquet; tokenized once
into a cache), a streamed Hugging Face Hub dataset, a pre-tokenized token file, or a weighted
mixture of these, packed into windows; and each rank's share of each global batch.

The loader is indexed by step, not iterated: the batch of step s depends only on the seed, the
global batch size and s, so every layout sees the same global batch and resuming is free. A rank
holds no corpus: token files are read window by window and the epoch's order is computed index by index.
"""

from __future__ import annotations

import dataclasses

from torch.utils.data import Dataset

from trainer.data.cache import cached_tokens, check_tokenizer
from trainer.data.embedded import EmbeddedText, sentence
from trainer.data.hub import STREAM_VAL_WINDOWS, HubStream
from trainer.data.loader import BatchLoader, Prefetcher, document_positions
from trainer.data.mixture import Mixture
from trainer.data.packed import VAL_FRACTION, PackedTokens
from trainer.data.readers import documents, read_token_file
from trainer.errors import ConfigError
from trainer.tokenizer import ByteTokenizer, build_tokenizer, is_bytes

SOURCES = ("embedded", "text", "json", "parquet", "hub", "binary")

__all__ = ["STREAM_VAL_WINDOWS", "SOURCES", "VAL_FRACTION", "BatchLoader", "ByteTokenizer", "EmbeddedText",
           "Mixture", "PackedTokens", "Prefetcher", "sentence", "build_dataset", "document_positions", "documents"]


def build_dataset(data, seq_len: int, seed: int, split: str = "train") -> Dataset:
    """The windows of `data` (a DataConfig) for split "train", "val" or "all" (every window)."""
    if data.mix:
        return _mixture(data, seq_len, seed, split)
    if data.source == "embedded":
        if not is_bytes(data.tokenizer):
            raise ConfigError(f"data.tokenizer={data.tokenizer} needs another data.source (the embedded text is bytes)")
        # Validation draws from a disjoint stream of the same generator.
        return EmbeddedText(seq_len, seed if split == "train" else seed + 7919)
    what = f"data.path={data.path}"
    if data.source in ("text", "json", "parquet"):
        tokens, meta = cached_tokens(data.source, data.path, data.text_field, data.tokenizer, data.cache_dir,
                                     data.strict)
        return PackedTokens(tokens, seq_len, meta["vocab_size"], meta["eos_id"], split, what)
    if data.source == "binary":
        if not data.path:
            raise ConfigError("data.path=None must name a token file for data.source=binary")
        tokens, meta = read_token_file(data.path, what)
        if not is_bytes(data.tokenizer):  # (bytes says nothing: the file's own tokenizer is used)
            check_tokenizer(meta, build_tokenizer(data.tokenizer), what, "prepare it again with this tokenizer")
        return PackedTokens(tokens, seq_len, meta["vocab_size"], meta["eos_id"], split, what)
    if data.source == "hub":
        if not data.path:
            raise ConfigError("data.path=None must name a Hugging Face dataset for data.source=hub")
        return HubStream(data, seq_len, split)
    raise ConfigError(f"data.source={data.source} is unknown; choose one of {list(SOURCES)}")


def _mixture(data, seq_len: int, seed: int, split: str) -> Mixture:
    """data.mix's sources (each read like data.source/path/..., with data's tokenizer), mixed."""
    if data.path is not None:
        raise ConfigError(f"data.path={data.path} and data.mix exclude each other: "
                          f"give each source its path in data.mix")
    datasets = []
    for i, source in enumerate(data.mix):
        if not source.weight > 0:
            raise ConfigError(f"data.mix[{i}].weight={source.weight} must be > 0 (leave the source out instead)")
        one = dataclasses.replace(data, mix=[], **{f.name: getattr(source, f.name) for f in dataclasses.fields(source)
                                                   if f.name != "weight"})
        try:
            datasets.append(build_dataset(one, seq_len, seed, split))
        except ConfigError as e:
            raise ConfigError(f"data.mix[{i}]: {e}") from None
    return Mixture(datasets, [source.weight for source in data.mix], seed)
