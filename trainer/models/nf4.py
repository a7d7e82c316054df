"""QLoRA's frozen base: the weights of the layers that take adapters stored in 4-bit NormalFloat
(torchao's NF4Tensor: 64-weight blocks, their scales quantized once more), turned back into the
compute dtype per layer in the forward.

torchao's NF4Tensor is what torchtune's and torchao's own QLoRA use under FSDP2: FSDP shards it by
rows and gathers its 4-bit codes and scales, not a high-precision weight. torchao is imported only
when a job asks for nf4.

A weight is quantized whole (its scales' mean is over all of it) and each rank keeps its rows, so
the base is the same in every layout.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from trainer.torchao_import import import_torchao

BLOCK = 64  # weights per scale (QLoRA's)
SCALER_BLOCK = 256  # scales per scale of theirs (QLoRA's double quantization)
# Bytes an element held: its 4-bit code, an int8 scale a block, an fp32 one per 256 of those.
NF4_BYTES = 0.5 + 1 / BLOCK + 4 / (BLOCK * SCALER_BLOCK)
# Bytes an element of the matrix being dequantized takes at once, besides the compute dtype's:
# torchao unpacks the two codes of each byte into int64 indices.
DEQUANTIZE_BYTES = 8
# Bytes of memory traffic an element's dequantization takes (bf16): its code read, two int64 indices
# written and read, the looked-up value, its scaling and the interleaving each written and read.
DEQUANTIZE_TRAFFIC = 26


def scaler_block(numel: int) -> int:
    """Scales per second-level scale for a weight of `numel` elements: QLoRA's 256, or fewer (a
    power of two) where that leaves the weight fewer than 8 groups, or a number of them that 8
    does not divide (a small model's layers), so that they split into 2, 4 or 8 shards."""
    blocks, size = numel // BLOCK, SCALER_BLOCK
    while size > 1 and blocks % (size * 8):
        size //= 2
    return size


def misfit(shape: torch.Size | tuple[int, ...], shards: int) -> str | None:
    """Why a weight of `shape` cannot be held in nf4 split into `shards` row blocks (None: it
    can)."""
    numel = shape[0] * shape[1]
    if numel % BLOCK:
        return f"its {numel} weights are not a multiple of {BLOCK}"
    groups = numel // (BLOCK * scaler_block(numel))
    if shape[0] % shards or groups % shards:
        return (f"its {shape[0]}x{shape[1]} weights, {groups} groups of 4-bit blocks, do not split "
                f"by rows into {shards} shards of whole groups")
    return None


def is_nf4(tensor: torch.Tensor) -> bool:
    module = sys.modules.get("torchao.quantization")
    return module is not None and isinstance(tensor, module.NF4Tensor)


def stored_bytes(tensor: torch.Tensor) -> int:
    """The bytes a (local) tensor holds: an nf4 one's codes and scales, not its nominal dtype's."""
    if is_nf4(tensor):
        return sum(t.numel() * t.element_size() for t in
                   (tensor.quantized_data, tensor.quantized_scalers, tensor.quantization_factor))
    return tensor.numel() * tensor.element_size()


def quantize(full: torch.Tensor):
    """`full` (2-D) in nf4."""
    to_nf4 = import_torchao("torchao.quantization").to_nf4
    return to_nf4(full.contiguous(), BLOCK, scaler_block(full.numel()))


def placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device | str):
    """An nf4 weight of `shape` whose codes and scales are on `device` (meta: allocated later, by
    FSDP's to_empty); its lookup table and scales' mean are allocated now, as torchao's empty_like
    leaves those where they are."""
    NF4Tensor = import_torchao("torchao.quantization").NF4Tensor  # noqa: N806 (its class)
    meta = quantize(torch.empty(shape, dtype=dtype, device="meta"))
    real = quantize(torch.zeros(BLOCK * meta.scaler_block_size, dtype=dtype, device=device))
    args = meta.__tensor_flatten__()[1]["tensor_meta"]
    return NF4Tensor(args, BLOCK, meta.n_blocks, meta.scaler_block_size, meta.quantized_scalers,
                     meta.quantization_factor, real.scaler_mean, meta.quantized_data, real.nf4)


def quantize_base(model: nn.Module, dtype: torch.dtype, device: torch.device | str) -> None:
    """Holds the weight of every LoRA layer of `model` in nf4 (frozen)."""
    from trainer.models.lora import LoRALinear

    for module in model.modules():
        if isinstance(module, LoRALinear):
            weight = placeholder(module.weight.shape, dtype, device)
            module.weight = nn.Parameter(weight, requires_grad=False)


@torch.no_grad()
def copy_full_nf4(param: torch.Tensor, full: torch.Tensor) -> None:
    """Sets an nf4 parameter (plain, or this rank's rows of one FSDP shards) from its full
    high-precision value."""
    local = param.to_local() if isinstance(param, DTensor) else param
    quantized = quantize(full.to(device=local.device, dtype=local.dtype))
    if isinstance(param, DTensor):
        coordinate = param.device_mesh.get_coordinate()
        for dim, placement in enumerate(param.placements):
            if isinstance(placement, Shard):
                quantized = torch.chunk(quantized, param.device_mesh.size(dim))[coordinate[dim]]
    local.copy_(quantized)
