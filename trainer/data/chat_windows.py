"""Conversations kept in the token cache and cut into training windows.

A window is [2, seq_len + 1]: the tokens, and a flag per token (SUPERVISED: a target of the loss;
STARTS: the first token of a conversation, where positions restart and attention stops). Windows are
made when asked for, from the cached arrays, which every rank maps rather than reads whole.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch
from torch.utils.data import Dataset

from trainer.data.cache import cache_folder, cache_key, made_once, source_files
from trainer.data.chat import Conversations, chat_template, read_conversations
from trainer.errors import ConfigError

SUPERVISED, STARTS = 1, 2
VAL_FRACTION = 0.01  # of the conversations (the last ones, at least one) held out for validation
CACHE_FORMAT = 1  # bumped when the conversations read from the same rows would change
ARRAYS = ("ids", "supervised", "offsets")


def cached_conversations(data, tokenizer, seq_len: int) -> Conversations:
    """read_conversations, once: kept in the token cache (data.cache_dir) under a name made of the
    files, the format and its keys, the template and the tokenizer; made by one process of those
    that share the cache while the others wait, and read by every job after."""
    made_of = {"format": CACHE_FORMAT,
               "data": [data.source, data.format, data.messages_field, data.prompt_field,
                        data.completion_field, data.overlong, seq_len],
               "template": chat_template(data.tokenizer, data.chat_template)
               if data.format == "chat" else None, "tokenizer": tokenizer.fingerprint,
               # A Hub dataset by name (its revision is not part
               # of it: data.cache_dir elsewhere reads it anew).
               "files": [data.path, data.subset, data.split] if data.source == "hub"
               else source_files(data.path, data.source)}
    key = cache_key(made_of)
    folder = cache_folder(data.cache_dir)
    out = folder / f"{key}.chat"

    def read_and_save() -> None:
        print(f"data: reading the conversations of data.path={data.path} once, into {out}",
              flush=True)
        conversations = read_conversations(data, tokenizer, seq_len)
        tmp = folder / f"{key}.chat.tmp{os.getpid()}"
        tmp.mkdir()
        for name in ARRAYS:
            np.save(tmp / f"{name}.npy", getattr(conversations, name))
        counts = {name: getattr(conversations, name)
                  for name in ("unsupervised", "truncated", "dropped", "example")}
        (tmp / "counts.json").write_text(json.dumps(counts))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)

    made_once(out / "counts.json", folder / f"{key}.lock", read_and_save)
    arrays = {name: np.load(out / f"{name}.npy", mmap_mode="r") for name in ARRAYS}
    return Conversations(**arrays, **json.loads((out / "counts.json").read_text()))


class ChatWindows(Dataset):
    """Conversations in windows of seq_len + 1 tokens [2, seq_len + 1] (tokens, flags): packed whole
    in their order, as many as fit (`pack`), or one a window; the rest of a window is padding,
    learned from by nothing. Split "val" is the last VAL_FRACTION of the conversations (at least
    one), "train" the others, "all" every one."""

    def __init__(self, conversations: Conversations, seq_len: int, pack: bool, split: str,
                 pad_id: int, vocab_size: int, eos_id: int):
        self.conversations, self.seq_len, self.pad_id = conversations, seq_len, pad_id
        self.vocab_size, self.eos_id = vocab_size, eos_id
        count = len(conversations)
        held_out = 0 if split == "all" else max(1, int(count * VAL_FRACTION))
        if count <= held_out:
            raise ConfigError(f"data: {count} conversation(s) are too few for a validation split")
        chosen = range(count - held_out, count) if split == "val" else range(count - held_out)
        lengths = np.diff(conversations.offsets)
        firsts, used = [chosen.start], 0  # each window's first conversation
        for i in chosen:
            if used and (not pack or used + lengths[i] > seq_len + 1):
                firsts.append(i)
                used = 0
            used += lengths[i]
        self.firsts = np.array([*firsts, chosen.stop])

    def __len__(self) -> int:
        return len(self.firsts) - 1

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(index)
        offsets = self.conversations.offsets[self.firsts[index]:self.firsts[index + 1] + 1]
        start, end = int(offsets[0]), int(offsets[-1])
        # Filled through NumPy: the conversations are a read-only map of the cache, which
        # torch.from_numpy warns of (once a process) though nothing writes to it.
        window = np.zeros((2, self.seq_len + 1), dtype=np.int64)
        window[0] = self.pad_id
        window[0, :end - start] = self.conversations.ids[start:end]
        window[1, :end - start] = self.conversations.supervised[start:end] * SUPERVISED
        window[1, offsets[:-1] - start] |= STARTS
        return torch.from_numpy(window)
