"""FSDP2 (fully_shard) and HSDP: each transformer block one unit (its experts another, under expert
parallel), the embedding one, the head (final norm and output) one, and the root (whatever is left:
the embedding and head when tied)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from trainer.models.moe import moe_layers
from trainer.models.nf4 import is_nf4


def offload_policy(offload: str, device_type: str) -> OffloadPolicy:
    """FSDP's: under `optimizer`, each unit's sharded parameters and gradients live on the host
    (pinned where the device is a GPU, so the copies overlap compute), and the optimizer, built over
    them, steps there."""
    if offload == "optimizer":
        return CPUOffloadPolicy(pin_memory=device_type == "cuda")
    return OffloadPolicy()


def edge_units(embedding: nn.Module | None,
               head: list[nn.Module]) -> tuple[nn.Module | None, list[nn.Module]]:
    """The embedding and the head (the final norm and output) as FSDP units of their own: (None, [])
    when the head shares a weight with the embedding (tied), as both then stay in the root."""
    if embedding is not None:
        in_head = {id(p) for m in head for p in m.parameters()}
        if any(id(p) in in_head for p in embedding.parameters()):
            return None, []
    return embedding, head


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], embedding: nn.Module | None,
               head: list[nn.Module], mesh: DeviceMesh, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype, pipelined: bool = False,
               expert_mesh: DeviceMesh | None = None, offload: str = "none") -> None:
    """Shards `model` over `mesh`: 1-D shards parameters, 2-D (replicate, shard) is HSDP.
    `embedding` and `head` are None and [] where a pipeline stage lacks them.

    With `expert_mesh` (expert parallel), each MoE layer's experts are a unit of their own on that
    mesh. The embedding and the head are units of their own, so that a large vocabulary's weights
    are gathered only while they are used (unless tied: then both stay in the root).

    `offload`: training.offload (see offload_policy).

    Under pipeline parallel, parameters stay gathered from forward to backward: a stage runs
    many microbatches, and the zero-bubble schedules' deferred weight-gradient pass gives wrong
    gradients with parameters re-gathered for backward (measured with torch 2.13).
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    policy = offload_policy(offload, mesh.device_type)
    # QLoRA's 4-bit weights are left to FSDP only where it shards them: over one rank, torchao's
    # NF4 tensor does not take FSDP's gather (torchao 0.18).
    ignored = ({p for p in model.parameters() if is_nf4(p)} if mesh.size(mesh.ndim - 1) == 1
               else None)

    def shard(module: nn.Module | list[nn.Module], reshard: bool, on: DeviceMesh = mesh) -> None:
        sharded = fully_shard(module, mesh=on, mp_policy=mp_policy,
                              reshard_after_forward=reshard and not pipelined,
                              ignored_params=ignored, offload_policy=policy)
        # (a list of modules is one unit, whose state its first module holds)
        (sharded if isinstance(sharded, FSDPModule) else sharded[0]).set_custom_reduce_scatter(
            compute_pool_reduce_scatter(on.size()))

    embedding, head = edge_units(embedding, head)
    if embedding is not None:
        shard(embedding, reshard=True)  # needed again only at the very end of backward
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        reshard = i < len(blocks) - 1
        if expert_mesh is not None:
            for layer in moe_layers(block):
                shard(layer.experts, reshard, on=expert_mesh)
        shard(block, reshard)
    if head:
        shard(head, reshard=False)  # backward starts with them
    shard(model, reshard=True)


def reshard(parts: list[nn.Module]) -> None:
    """Frees the parameters FSDP keeps gathered after a forward for the backward that follows (the
    last block's and the head's; every unit of a pipeline stage): after a forward-only pass
    (validation) nothing else would, and a checkpoint or guard that reads the parameters then would
    see them gathered (in float8, torchao's float8 tensors)."""
    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def _default_reduce_scatter() -> type:
    # FSDP2's reduce-scatter, whose allocation compute_pool_reduce_scatter changes: the class is not
    # exported (torch 2.13), only the interface that set_custom_reduce_scatter takes.
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    return DefaultReduceScatter


def compute_pool_reduce_scatter(ranks: int):
    """FSDP's reduce-scatter, its buffers taken from the compute stream's memory.

    FSDP allocates each unit's reduced gradient on its reduce-scatter stream, and the CUDA caching
    allocator keeps a stream's freed blocks for that stream alone: the gradients' memory, freed at
    each step's zero_grad, could never hold the next forward's activations, and a run held both
    (10.4 GiB more reserved than allocated for a 2.8B-parameter model on one H200). Taken from the
    compute stream's pool (and marked used by the reduce-scatter stream, so a block is not reused
    before that stream is done with it), one pool serves both. On one rank the reduce-scatter's
    output is its input: FSDP's copy of one into the other then copies nothing, and a unit's
    gradient is held once instead of twice at the end of its backward."""

    class ComputePoolReduceScatter(_default_reduce_scatter()):
        def __init__(self):
            super().__init__()
            self.input: torch.Tensor | None = None  # one rank: the input, returned as the output

        def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            if device.type != "cuda":
                return torch.empty(*size, dtype=dtype, device=device)
            stream, compute = torch.cuda.current_stream(device), torch.cuda.default_stream(device)
            if stream == compute:  # the input, filled on the compute stream
                self.input = buffer = torch.empty(*size, dtype=dtype, device=device)
                if ranks > 1:
                    self.input = None
                return buffer
            buffer, self.input = self.input, None
            if buffer is None or buffer.numel() != math.prod(size) or buffer.dtype != dtype:
                with torch.cuda.stream(compute):
                    buffer = torch.empty(*size, dtype=dtype, device=device)
            buffer.record_stream(stream)
            return buffer

    return ComputePoolReduceScatter()
