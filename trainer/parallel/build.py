"""This rank's model, built one way for training and for the memory plan: on meta, pruned to a
pipeline stage, parallelized, then (except for the plan) allocated and initialised shard by shard.

`BuildOptions` is derived once from the job's config; a new model option is one field here and one
step in `build_part`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from trainer.config.schema import Float8Config, JobConfig, ModelConfig
from trainer.float8 import convert as convert_float8
from trainer.float8 import float8_of, gathers_in_float8
from trainer.models import build_model, family, init_weights, materialize
from trainer.models.attention import attend_within_documents
from trainer.models.head import set_loss_chunk
from trainer.models.lora import LoraOptions, add_adapters
from trainer.models.moe import set_aux_loss_scale
from trainer.models.nf4 import quantize_base
from trainer.parallel import ParallelOptions, parallelize
from trainer.parallel.dims import ParallelDims
from trainer.parallel.pipeline import keep_modules, split_modules, stage_ids
from trainer.tensors import DTYPES, param_dtype


@dataclass(frozen=True)
class BuildOptions:
    model: ModelConfig
    parallel: ParallelOptions
    # the module names of each pipeline stage (one stage: all of them)
    stage_modules: list[list[str]]
    pp_schedule: str
    document_mask: bool = False
    seed: int = 0
    aux_loss_scale: float = 1.0  # the MoE auxiliary losses' gradient scale (see set_aux_loss_scale)
    # tokens per chunk of the output head and its loss (LMHead)
    loss_chunk_tokens: int | None = 2048
    float8: Float8Config | None = None  # the linear layers in float8 (None: not)
    lora: LoraOptions | None = None  # LoRA adapters on a frozen base (None: every weight trains)


def build_options(job: JobConfig, dims: ParallelDims, device: torch.device | str) -> BuildOptions:
    t, p = job.training, job.parallel
    float8 = float8_of(t)
    parallel = ParallelOptions(
        param_dtype=param_dtype(t.mixed_precision, device),
        reduce_dtype=DTYPES[t.mixed_precision.reduce_dtype],
        activation_checkpoint=t.activation_checkpoint,
        activation_checkpoint_every=t.activation_checkpoint_every,
        selective_policy=t.selective_policy, compile=t.compile,
        sequence_parallel=p.sequence_parallel, loss_parallel=p.loss_parallel, cp_method=p.cp_method,
        float8_all_gather=gathers_in_float8(float8),
        # gloo has no float8 types: tensor parallel gathers in high precision there, unless it
        # gathers nothing (no sequence parallel). The
        # bits are the same; only the bytes moved differ.
        float8_tp=gathers_in_float8(float8)
        and (torch.device(device).type == "cuda" or not p.sequence_parallel),
        offload=t.offload,
    )
    # A step's microbatch losses are averaged; the MoE auxiliary losses' gradients follow suit.
    # Under tensor parallel each tp rank's router sees its slice of the sequence and the router's
    # gradients are summed over the tp ranks: each slice's loss counts 1/tp.
    aux_loss_scale = 1 / (dims.grad_accum_steps * dims.pp_microbatches * dims.tp)
    return BuildOptions(model=job.model, parallel=parallel, stage_modules=stage_modules(job, dims),
                        pp_schedule=p.pp_schedule, document_mask=attends_within_documents(job.data),
                        seed=t.seed, aux_loss_scale=aux_loss_scale,
                        loss_chunk_tokens=t.loss_chunk_tokens, float8=float8,
                        lora=lora_options(job))


def lora_options(job: JobConfig) -> LoraOptions | None:
    """peft.* as the model build takes it (None: no adapters)."""
    peft = job.peft
    if peft.method != "lora":
        return None
    patterns = peft.target_modules or family(job.model.family).lora_targets
    return LoraOptions(peft.rank, peft.alpha, peft.dropout, tuple(patterns), peft.base_dtype)


def attends_within_documents(data) -> bool:
    """data.document_mask, or conversations packed into windows: attention stays within each."""
    return data.document_mask or (data.format != "text" and data.pack)


def stage_modules(job: JobConfig, dims: ParallelDims) -> list[list[str]]:
    """The family's pipeline units per stage: the configured split, else a balanced one."""
    spec = family(job.model.family)
    units = spec.pipeline_units(job.model.n_layers)
    if not dims.pp_enabled:
        return [units]
    if job.parallel.pp_stage_modules:
        return job.parallel.pp_stage_modules
    layers = [u for u in units if spec.is_block(u)]
    return split_modules(spec.embedding, layers, list(spec.head), dims.pp * dims.pp_stages_per_rank,
                         job.parallel.pp_embedding_cost, job.parallel.pp_output_cost)


def build_part(options: BuildOptions, dims: ParallelDims, modules: list[str],
               device: torch.device | str) -> nn.Module:
    """One stage (or the whole model) holding `modules`, parallelized over `dims`; on "meta" it is
    left unallocated."""
    spec = family(options.model.family)
    part = build_model(options.model, device="meta")
    if options.document_mask:
        attend_within_documents(part)
    keep_modules(part, spec.pipeline_units(options.model.n_layers), modules)
    if options.float8 is not None:
        convert_float8(part, options.float8, torch.device(device), options.parallel.param_dtype)
    if options.lora is not None:
        add_adapters(part, options.lora, spec.blocks)
        if options.lora.base_dtype == "nf4":
            quantize_base(part, options.parallel.param_dtype, device)
    parallelize(part, spec, dims, options.parallel, options.model)
    if torch.device(device).type != "meta":
        materialize(part, device, params_on="cpu" if options.parallel.offload == "optimizer"
                    else None)
        init_weights(part, options.seed)
    set_aux_loss_scale(part, options.aux_loss_scale)
    set_loss_chunk(part, options.loss_chunk_tokens, compiled=options.parallel.compile)
    return part


def build_model_parts(options: BuildOptions, dims: ParallelDims,
                      device: torch.device) -> tuple[list[nn.Module], list[int]]:
    """This rank's parts (its pipeline stages, or the whole model) and their stage indices."""
    stages = stage_ids(dims.view("pp").get_local_rank(), dims.pp, dims.pp_stages_per_rank,
                       options.pp_schedule)
    return [build_part(options, dims, options.stage_modules[s], device) for s in stages], stages


def one_block(options: BuildOptions, modules: list[str],
              index: int = 0) -> tuple[BuildOptions, list[str]]:
    """Options and stage modules for a stand-in of `modules` with one block, block `index` (blocks
    of one kind are alike: the memory plan builds one of each kind and counts it for each), compiled
    and checkpointed nowhere."""
    spec = family(options.model.family)
    kept = [spec.block_name(index), *(name for name in modules if not spec.is_block(name))]
    parallel = dataclasses.replace(options.parallel, activation_checkpoint="none", compile=False,
                                   param_dtype=torch.float32, reduce_dtype=torch.float32,
                                   float8_all_gather=False, float8_tp=False)
    model = dataclasses.replace(options.model, n_layers=index + 1)
    options = dataclasses.replace(options, model=model, parallel=parallel, stage_modules=[kept],
                                  float8=None)
    return options, kept
