"""Small helpers on tensors and dtypes that every part of the trainer uses."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """The part of a DTensor this rank holds (all of it when replicated, e.g. a loss-parallel loss);
    a plain tensor as it is."""
    return value.to_local() if isinstance(value, DTensor) else value


def param_dtype(mixed_precision, device: torch.device | str) -> torch.dtype:
    """The dtype parameters compute in: `auto` is bf16 on CUDA, fp32 on the CPU."""
    name = mixed_precision.param_dtype
    if name == "auto":
        name = "bfloat16" if torch.device(device).type == "cuda" else "float32"
    return DTYPES[name]


# Called with each tensor made to hold data in host memory in the device's place (the activation
# offload's copies): on the CPU, where the host is the device, the memory count sets them apart.
HOST_COPY_LISTENERS: list = []


def note_host_copy(tensor: torch.Tensor) -> None:
    for listener in HOST_COPY_LISTENERS:
        listener(tensor)
