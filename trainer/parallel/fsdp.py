"""FSDP2 (fully_shard) and HSDP: each transformer block one unit, the root (embedding, norm,
output) another."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype, pipelined: bool = False, expert_mesh: DeviceMesh | None = None) -> None:
    """Shards `model` over `mesh`: 1-D shards parameters, 2-D (replicate, shard) is HSDP.

    With `expert_mesh` (expert parallel), each block's experts are a unit of their own on that mesh.

    Under pipeline parallel, parameters stay gathered from forward to backward: a stage runs
    many microbatches, and the zero-bubble schedules' deferred weight-gradient pass gives wrong
    gradients with parameters re-gathered for backward (measured with torch 2.13).
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        reshard = not pipelined and i < len(blocks) - 1
        if expert_mesh is not None:
            experts = block.feed_forward.experts
            fully_shard(experts, mesh=expert_mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=not pipelined)
