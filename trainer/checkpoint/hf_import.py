"""Hugging Face import by slices: each rank reads from the safetensors files only the part of each
tensor that its own shard of the parameter holds, so its host memory is its shards and one slice,
not the model (140 GB for Llama 3 70B, on every rank of a node)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.checkpoint.hf import config_from_hf, hf_sources
from trainer.checkpoint.safetensors_io import SafetensorsFile
from trainer.errors import ConfigError
from trainer.models import copy_full, tied_names
from trainer.models.lora import is_adapter
from trainer.models.nf4 import is_nf4
from trainer.tensors import local_tensor


@torch.no_grad()
def load_hf_slices(parts: list[nn.Module], path: Path) -> None:
    """Sets every parameter of the model parts (plain, or sharded as DTensors in any layout) but
    LoRA's adapters, and every buffer the mapping names (an MoE layer's expert bias), from the
    Hugging Face directory `path`, reading this rank's slices only."""
    cfg = config_from_hf(path)
    sources = hf_sources(cfg)
    sources |= {alias: sources[name] for alias, name in tied_names(cfg).items()}
    files = _tensor_files(path)

    def read(hf_name: str, expected: list[int], box: tuple[slice, ...]) -> torch.Tensor:
        if hf_name not in files:
            raise ConfigError(f"{path} has no tensor {hf_name}: not a {cfg.family} checkpoint of "
                              "this shape")
        file = files[hf_name]
        if (shape := file.shape(hf_name)) != expected:
            raise ConfigError(f"{file.path}: {hf_name} has shape {shape}, the model needs "
                              f"{expected}")
        return file.read(hf_name, box)

    for part in parts:
        buffers = [(name, buffer) for name, buffer in part.named_buffers() if name in sources]
        weights = [(n, p) for n, p in part.named_parameters() if not is_adapter(n)]
        for name, param in [*weights, *buffers]:
            if name not in sources:
                raise ConfigError(f"{path} holds no weight for {name}")
            # (QLoRA's 4-bit weights are quantized whole)
            box = None if is_nf4(local_tensor(param)) else _local_box(param)
            if box is None:  # a shard that is not one block of the whole: read all, keep the shard
                copy_full(param, _read_box(read, sources[name], param, _whole(param)))
                continue
            local = local_tensor(param)
            local.copy_(_read_box(read, sources[name], param, box))


def _read_box(read, source: str | list[str], param, box: tuple[slice, ...]) -> torch.Tensor:
    """The region `box` (global coordinates) of our parameter `param`, from its Hugging Face
    tensor, or from one tensor per expert for our stacked experts."""
    if isinstance(source, str):
        return read(source, list(param.shape), box)
    experts = range(box[0].start, box[0].stop)
    return torch.stack([read(source[e], list(param.shape[1:]), box[1:]) for e in experts])


def _whole(param: torch.Tensor) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in param.shape)


def _local_box(param: torch.Tensor) -> tuple[slice, ...] | None:
    """Where this rank's shard of `param` lies in the whole tensor, one slice per dimension (None
    if it is not one block)."""
    if not isinstance(param, DTensor):
        return _whole(param)
    # torch has no public call for a DTensor shard's place in the whole tensor; DCP plans its reads
    # with this method.
    chunks = param.__create_chunk_list__()
    if len(chunks) != 1 or list(chunks[0].sizes) != list(param.to_local().shape):
        return None
    return tuple(slice(o, o + n) for o, n in zip(chunks[0].offsets, chunks[0].sizes))


def _tensor_files(path: Path) -> dict[str, SafetensorsFile]:
    """Hugging Face tensor name -> the file in `path` that holds it (headers read, sizes
    checked)."""
    files = {}
    for file in sorted(path.glob("*.safetensors")):
        opened = SafetensorsFile(file)
        files |= dict.fromkeys(opened.tensors, opened)
    return files
