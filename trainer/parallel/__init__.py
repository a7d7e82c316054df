"""Applies the parallelisms to a model of any registered family, in a fixed order: tensor/sequence
parallel (and the context-parallel attention kernel), expert parallel, activation checkpointing,
compile, then FSDP. What is particular to the family comes from its spec."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from trainer.config.schema import ModelConfig
from trainer.float8 import float8_tp_plan, gather_bytes_over_gloo
from trainer.models.lora import freeze_base, has_adapters, lora_tp_plan
from trainer.models.spec import ModelSpec
from trainer.parallel.activation_checkpoint import apply_activation_checkpoint
from trainer.parallel.context_parallel import apply_cp
from trainer.parallel.dims import ParallelDims
from trainer.parallel.expert_parallel import parallelize_moe
from trainer.parallel.fsdp import apply_fsdp
from trainer.parallel.offload import ActivationOffload
from trainer.parallel.tensor_parallel import apply_tp


@dataclass(frozen=True)
class ParallelOptions:
    """The choices that shape how a model is parallelized (derived once from the job's config)."""

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    activation_checkpoint: str = "none"
    activation_checkpoint_every: int = 1
    selective_policy: str = "half_mm"
    compile: bool = False
    sequence_parallel: bool = True
    loss_parallel: bool = True
    cp_method: str = "ring"
    float8_all_gather: bool = False  # FSDP gathers the float8 layers' weights in float8
    # tensor parallel casts the float8 layers' inputs before it gathers them
    float8_tp: bool = False
    offload: str = "none"  # training.offload


def parallelize(model: nn.Module, spec: ModelSpec, dims: ParallelDims, options: ParallelOptions,
                config: ModelConfig) -> None:
    """Parallelizes `model` (a model of `spec`'s family built from `config`, or a stage of one)."""
    blocks = spec.block_modules(model)
    embedding = spec.part(model, spec.embedding)
    if dims.tp_enabled:
        plan = spec.tp_plan(config, options.sequence_parallel, options.loss_parallel)
        if has_adapters(model):
            plan = lora_tp_plan(model, plan)
        apply_tp(model, dims.view("tp"), float8_tp_plan(model, plan) if options.float8_tp else plan)
    if dims.cp_enabled:
        apply_cp(model, *dims.cp_meshes(), options.cp_method)
    parallelize_moe(model, dims)
    apply_activation_checkpoint(blocks, options.activation_checkpoint,
                                options.activation_checkpoint_every,
                                regions=spec.checkpoint_regions if dims.ep_enabled else None,
                                policy=options.selective_policy)
    if embedding is not None:
        # The embedding's output as a tensor of its own. It is a view (F.embedding's; under tensor
        # parallel, DTensor.to_local's), and an in-place op on a view an FSDP unit returned would
        # skip FSDP's pre-backward hook (torch warns of it on every run). Under compiled tensor
        # parallel it is also a collective's pending result, past which a compiled block returns its
        # gradient, lost to the embedding (torch 2.13).
        embedding.register_forward_hook(lambda module, args, output: output.clone())
    if options.offload == "activations":
        device = dims.fsdp_mesh.device_type
        ActivationOffload(torch.device(device, torch.cuda.current_device()) if device == "cuda"
                          else torch.device(device)).attach(list(blocks.values()))
    if options.compile:
        for block in blocks.values():
            block.compile()
    if has_adapters(model):  # (the styles above may have made new parameters of frozen ones)
        freeze_base(model, options.param_dtype)
    # FSDP also runs on a one-rank mesh: one code path for every layout, and its mixed precision.
    apply_fsdp(model, list(blocks.values()), embedding, spec.head_modules(model), dims.fsdp_mesh,
               options.param_dtype, options.reduce_dtype, pipelined=dims.pp_enabled,
               expert_mesh=dims.expert_fsdp_mesh if dims.ep_enabled else None,
               offload=options.offload)
    if options.float8_all_gather and dist.get_backend() == "gloo":
        gather_bytes_over_gloo(model)
