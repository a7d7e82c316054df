"""Applies the parallelisms to a model, in a fixed order:
tensor/sequence parallel (and the context-parallel attention kernel), activation checkpointing,
compile, then FSDP."""

from __future__ import annotations

import torch
from torch import nn

from trainer.parallel.activation_checkpoint import apply_activation_checkpoint
from trainer.parallel.context_parallel import apply_cp
from trainer.parallel.dims import ParallelDims
from trainer.parallel.expert_parallel import parallelize_moe
from trainer.parallel.fsdp import apply_fsdp
from trainer.parallel.tensor_parallel import apply_tp


def parallelize_llama(model: nn.Module, dims: ParallelDims, *, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
                      activation_checkpoint: str, compile: bool, sequence_parallel: bool, loss_parallel: bool,
                      cp_method: str, activation_checkpoint_every: int = 1) -> None:
    blocks = list(model.layers.values())
    if dims.tp_enabled:
        apply_tp(model, dims.view("tp"), sequence_parallel, loss_parallel)
    if dims.cp_enabled:
        apply_cp(model, dims.view("cp"), cp_method)
    parallelize_moe(model, dims)
    apply_activation_checkpoint(model.layers, activation_checkpoint, activation_checkpoint_every,
                                experts_sharded=dims.ep_enabled)
    if compile:
        if dims.tp_enabled and model.tok_embeddings is not None:
            # The embedding's tensor-parallel output is a collective's pending result (a tensor
            # subclass); a compiled block taking it as input returns its gradient past the DTensor
            # conversion, and the embedding's backward fails or loses it (torch 2.13). A copy is a
            # plain tensor, and the block needs the collective's result at once anyway.
            model.tok_embeddings.register_forward_hook(lambda module, args, output: output.clone())
        for block in blocks:
            block.compile()
    # FSDP also runs on a one-rank mesh: one code path for every layout, and its mixed precision.
    apply_fsdp(model, blocks, dims.fsdp_mesh, param_dtype, reduce_dtype, pipelined=dims.pp_enabled,
               expert_mesh=dims.expert_fsdp_mesh if dims.ep_enabled else None)


# Mixtral differs from Llama only in its feed-forward, which expert parallel handles.
PARALLELIZE = {"llama": parallelize_llama, "mixtral": parallelize_llama}
