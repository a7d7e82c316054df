"""Export to a Hugging Face directory that streams: one of our tensors in memory at a time, read
from the checkpoint (any layout) and written into size-capped safetensors shards, with the index
file transformers reads when there is more than one. Each shard's header is written first, from
the shapes in the checkpoint's metadata, so the bytes can follow tensor by tensor.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from trainer.checkpoint.folders import CheckpointError, verify
from trainer.checkpoint.hf import hf_tensors, write_hf_config
from trainer.checkpoint.metadata import SafeReader
from trainer.checkpoint.safetensors_io import encode_header
from trainer.checkpoint.state import quiet_single_process
from trainer.config.schema import ModelConfig
from trainer.safe_write import check_new_output

INDEX = "model.safetensors.index.json"


class CachingReader(SafeReader):
    """Reads the checkpoint's metadata once for the many loads of an export (it lists every shard
    of every tensor: megabytes for a large model saved by many ranks)."""

    def read_metadata(self, *args, **kwargs):
        if not hasattr(self, "_metadata"):
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


def export_hf(checkpoint: Path, cfg: ModelConfig, out: Path, dtype: torch.dtype = torch.bfloat16,
              max_shard_bytes: int = 5 * 10**9) -> int:
    """Writes checkpoint `checkpoint` of model `cfg` as a Hugging Face directory `out` (new or
    empty) in `dtype`, in shards of at most `max_shard_bytes` (a larger tensor gets a shard of its
    own). Returns the number of shards."""
    if (problem := verify(checkpoint)) is not None:
        raise CheckpointError(f"{checkpoint} is not a usable checkpoint: {problem}")
    reader = CachingReader(checkpoint)
    saved = reader.read_metadata().state_dict_metadata
    for _, ours, _ in hf_tensors(cfg):
        if f"model.{ours}" not in saved:
            raise CheckpointError(f"{checkpoint} has no weight {ours}: not a {cfg.name} checkpoint")
    return write_hf(lambda ours: list(saved[f"model.{ours}"].size),
                    lambda ours: read_saved(reader, ours, saved[f"model.{ours}"]),
                    cfg, out, dtype, max_shard_bytes)


def write_hf(shape_of, tensor_of, cfg: ModelConfig, out: Path, dtype: torch.dtype,
             max_shard_bytes: int) -> int:
    """Writes the weights of model `cfg` as a Hugging Face directory `out` (new or empty), each of
    our weights fetched whole by `tensor_of(name)` when its turn comes (`shape_of(name)`: its
    shape, known before); returns the number of shards."""
    check_new_output(out)
    entries = []
    for hf_name, ours, expert in hf_tensors(cfg):
        shape = shape_of(ours)
        entries.append((hf_name, ours, expert, shape if expert is None else shape[1:]))
    shards = _plan_shards(entries, dtype.itemsize, max_shard_bytes)
    out.mkdir(parents=True, exist_ok=True)
    write_hf_config(cfg, out, dtype)
    weight_map, held_name, held = {}, None, None
    for number, shard in enumerate(shards, 1):
        file = ("model.safetensors" if len(shards) == 1
                else f"model-{number:05d}-of-{len(shards):05d}.safetensors")
        with open(out / file, "wb") as f:
            f.write(encode_header([(hf_name, dtype, shape) for hf_name, _, _, shape in shard]))
            for hf_name, ours, expert, _ in shard:
                if ours != held_name:  # an expert stack stays for its experts' turns
                    held = None
                    held_name, held = ours, tensor_of(ours)
                tensor = held if expert is None else held[expert]
                f.write(tensor.to(dtype).contiguous().view(-1).view(torch.uint8).numpy())
                weight_map[hf_name] = file
    if len(shards) > 1:
        total = sum(math.prod(shape) for *_, shape in entries) * dtype.itemsize
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return len(shards)


def read_saved(reader: SafeReader, name: str, meta) -> torch.Tensor:
    """One whole weight of ours from the checkpoint, in its saved dtype."""
    tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
    with quiet_single_process():
        dcp.load({"model": {name: tensor}}, storage_reader=reader, no_dist=True)
    return tensor


def _plan_shards(entries: list, itemsize: int, max_bytes: int) -> list[list]:
    shards, size = [[]], 0
    for entry in entries:
        nbytes = math.prod(entry[3]) * itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards
