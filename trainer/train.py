"""The training job: check the config, set up the mesh and model, run the step loop."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.checkpoint import Checkpointer, TrainState, restore
from trainer.config import CheckpointConfig, JobConfig
from trainer.data import BatchLoader, Prefetcher, build_dataset, document_positions
from trainer.distributed import init_distributed, resolve_device, shutdown, world_size
from trainer.errors import ConfigError
from trainer.memory import COUNTED_STEPS, TensorMemory, peak_memory_gib, peak_tensor_gib
from trainer.metrics import MetricsLogger, MoEStats, flops_per_token, peak_tflops
from trainer.models import build_model, init_weights, materialize
from trainer.models.llama import attend_within_documents
from trainer.models.moe import set_aux_loss_scale
from trainer.optim import build_optimizer, build_scheduler, clip_grad_norm_
from trainer.parallel import PARALLELIZE
from trainer.parallel.context_parallel import shard_batch
from trainer.parallel.dims import ParallelDims
from trainer.parallel.expert_parallel import sum_grads_over_tp
from trainer.parallel.pipeline import (
    build_schedule,
    forward_only,
    keep_modules,
    split_modules,
    stage_ids,
    stage_owners,
)
from trainer.parallel.tensor_parallel import loss_parallel_context
from trainer.plan import make_plan
from trainer.plan.devices import local_device
from trainer.rules import DTYPES, check_checkpoint, check_job, param_dtype


def build_datasets(job: JobConfig):
    """The training windows and the validation ones: validation.path's files (all of them), else
    the training data's held-out split."""
    t = job.training
    if job.validation.path is None:
        return (build_dataset(job.data, t.seq_len, t.seed, split) for split in ("train", "val"))
    val_data = dataclasses.replace(job.data, path=job.validation.path)
    return build_dataset(job.data, t.seq_len, t.seed, "all"), build_dataset(val_data, t.seq_len, t.seed, "all")


def run(cfg: DictConfig) -> None:
    """Runs the job `cfg` (the composed Hydra config) on this rank."""
    job: JobConfig = OmegaConf.to_object(cfg)
    device = resolve_device(job.device)
    dims = check_job(job, world_size())
    checkpoint = check_checkpoint(job.checkpoint)
    predicted = check_memory(job, dims, device) if job.plan.check else None
    dataset, val_dataset = build_datasets(job)
    if dataset.vocab_size > job.model.vocab_size:
        raise ConfigError(f"model.vocab_size={job.model.vocab_size} must be >= the tokenizer's {dataset.vocab_size} "
                          f"(data.tokenizer={job.data.tokenizer})")
    init_distributed(device)
    try:
        train(job, OmegaConf.to_container(cfg, resolve=True), dims, checkpoint, device, dataset, val_dataset, predicted)
    finally:
        shutdown()


def check_memory(job: JobConfig, dims: ParallelDims, device: torch.device) -> float:
    """The plan's peak bytes on this rank's pipeline position; a `config error:` if it will not fit."""
    target = local_device(device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    pp_rank = int(os.environ.get("RANK", "0")) // (dims.world_size // dims.pp)
    # The plan builds a fake world of the job's size: in a process of its own, so that nothing torch
    # keeps about that world (a mesh's coordinates, measured: checkpoints then saved every rank's
    # shards as rank 0's) reaches the real one.
    with multiprocessing.get_context("fork").Pool(1) as pool:
        peak, error = pool.apply(_planned_peak, (job, dims, target, pp_rank))
    if error is not None:
        raise ConfigError(error)
    return peak


def _planned_peak(job: JobConfig, dims: ParallelDims, device, pp_rank: int) -> tuple[float | None, str | None]:
    try:
        plan = make_plan(job, dims, device)
        plan.check_fits()
    except ConfigError as e:
        return None, str(e)
    return plan.ranks[pp_rank].peak, None


def train(job: JobConfig, config: dict, dims: ParallelDims, checkpoint: CheckpointConfig, device: torch.device,
          dataset, val_dataset, predicted: float | None) -> None:
    t = job.training
    dims.build_mesh(device.type)
    rank = dist.get_rank()
    output_dir = Path(job.output_dir)
    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.create(config), output_dir / "config.yaml")

    parts, stages = build_model_parts(job, dims, device)
    model = nn.ModuleList(parts)
    held = [_local(p) for p in model.parameters()]
    param_mib = sum(p.numel() * p.element_size() for p in held) / 2**20
    if rank == 0:
        total = sum(p.numel() for p in model.parameters())
        print(describe_layout(dims, total, sum(p.numel() for p in held), param_mib), flush=True)
        if predicted is not None:
            print(f"plan: predicted peak {predicted / 2**30:.2f} GiB of tensors on rank 0", flush=True)
    loss_parallel = dims.tp_enabled and job.parallel.loss_parallel
    step_fn, eval_fn = make_step_fns(job, dims, device, parts, stages, loss_parallel)

    optimizer = build_optimizer(model, job.optim, t.lr, t.weight_decay)
    dp_rank, cp_rank = dims.view("dp").get_local_rank(), dims.view("cp").get_local_rank()
    loader, val_loader = (
        BatchLoader(data, t.global_batch_size, dp_rank, dims.dp, t.grad_accum_steps, t.seed, dims.pp_microbatches)
        for data in (dataset, val_dataset)
    )
    state = TrainState(parts, optimizer)
    log = partial(print, flush=True) if rank == 0 else lambda *_: None
    start_step, position = restore(checkpoint, state, output_dir / "checkpoints", job.model, log)
    loader.offset = position - start_step * t.global_batch_size
    scheduler = build_scheduler(optimizer, t.warmup_steps, t.steps, job.optim.min_lr_ratio, start_step)
    checkpointer = None
    if checkpoint.enabled:
        checkpointer = Checkpointer(output_dir / "checkpoints", checkpoint.interval, checkpoint.keep_last,
                                    checkpoint.async_save, config["model"], device)

    def microbatches(loader: BatchLoader, step: int) -> list[tuple[torch.Tensor, ...]]:
        # The ranks of a cp group read the same sequences; each keeps its share of them.
        return [
            shard_batch(inputs, labels, cp_rank, dims.cp,
                        document_positions(inputs, dataset.eos_id) if job.data.document_mask else None)
            for inputs, labels in loader.microbatches(step)
        ]

    train_batches = Prefetcher(partial(microbatches, loader))

    logger = MetricsLogger(str(output_dir), rank == 0, job.metrics.wandb, config)
    peak = peak_tflops(device, job.metrics.peak_tflops) if rank == 0 else None  # only rank 0 logs mfu
    flops = flops_per_token(job.model, t.seq_len)
    tokens_per_step = t.global_batch_size * t.seq_len
    moe_stats = MoEStats(job.model.n_layers, job.model.n_experts, device, dims.ep) if job.model.n_experts else None
    # On the CPU, live tensors are counted through the first steps: the model's, then all the steps make.
    tensor_memory = TensorMemory() if device.type == "cpu" else None
    if tensor_memory is not None:
        tensor_memory.add(model.parameters())
        tensor_memory.start()
    counted_until = start_step + COUNTED_STEPS
    start = last_time = time.perf_counter()
    last_step = start_step
    for step in range(start_step + 1, t.steps + 1):
        loss = step_fn(train_batches(step - 1))
        sum_grads_over_tp(parts, dims)
        if moe_stats is not None:
            moe_stats.collect(parts, t.grad_accum_steps * dims.pp_microbatches)
        grad_norm = clip_grad_norm_(model.parameters(), t.max_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step == counted_until and tensor_memory is not None:
            tensor_memory.stop()
            if t.compile:
                # Blocks run eagerly while tensors are counted: dynamo skips a frame under a dispatch
                # mode and remembers the skip. Forgotten here, the next step compiles them.
                torch.compiler.reset()

        validate = job.validation.every > 0 and step % job.validation.every == 0
        if step % job.metrics.log_every == 0 or step == t.steps or validate:
            loss = job_loss(loss, dims)
            now = time.perf_counter()
            tokens_per_s = tokens_per_step * (step - last_step) / (now - last_time)
            record = {
                "step": step,
                "loss": loss,
                "grad_norm": grad_norm.item(),
                "lr": lr,
                "tokens_per_s": tokens_per_s,
                "mfu": None if peak is None else tokens_per_s * flops / (peak * 1e12 * dims.world_size),
                "mem_gib": peak_memory_gib(device),
                "mem_tensor_gib": peak_tensor_gib(device, tensor_memory),
                "param_mib": param_mib,
                "elapsed_s": now - start,
            }
            if moe_stats is not None:
                record |= moe_stats.report(layer_copies=dims.world_size // dims.pp)
            if validate:
                val_losses = [eval_fn(microbatches(val_loader, i)) for i in range(job.validation.steps)]
                record["val_loss"] = job_loss(torch.stack(val_losses).mean(), dims)
            logger.log(record)
            if predicted is not None and record["mem_tensor_gib"] is not None:
                log(f"plan: measured peak {record['mem_tensor_gib']:.2f} GiB of tensors on rank 0 by step {step} "
                    f"(predicted {predicted / 2**30:.2f})")
                predicted = None  # said once
            last_step, last_time = step, time.perf_counter()
        if checkpointer is not None and checkpointer.after_step(step, t.steps,
                                                                lambda: state.for_save(step, loader.position(step))):
            break
    if tensor_memory is not None:
        tensor_memory.stop()
    if t.compile and rank == 0:
        print(f"compile: {compiled_graphs()} graphs compiled", flush=True)
    train_batches.close()
    if checkpointer is not None:
        checkpointer.close()
    logger.close()


def build_model_parts(job: JobConfig, dims: ParallelDims, device: torch.device) -> tuple[list[nn.Module], list[int]]:
    """This rank's model: the whole model, or its pipeline stages, each built on meta, parallelized,
    then allocated and initialised shard by shard. Returns the parts and their stage indices."""
    t = job.training
    parallelize = partial(
        PARALLELIZE[job.model.family], dims=dims, param_dtype=param_dtype(t.mixed_precision, device),
        reduce_dtype=DTYPES[t.mixed_precision.reduce_dtype], activation_checkpoint=t.activation_checkpoint,
        activation_checkpoint_every=t.activation_checkpoint_every,
        compile=t.compile, sequence_parallel=job.parallel.sequence_parallel, loss_parallel=job.parallel.loss_parallel,
        cp_method=job.parallel.cp_method,
    )
    stages = stage_ids(dims.view("pp").get_local_rank(), dims.pp, dims.pp_stages_per_rank, job.parallel.pp_schedule)
    if dims.pp_enabled:
        stage_modules = job.parallel.pp_stage_modules or split_modules(
            job.model.n_layers, dims.pp * dims.pp_stages_per_rank, job.parallel.pp_embedding_cost,
            job.parallel.pp_output_cost,
        )
    parts = []
    for stage in stages:
        part = build_model(job.model, device="meta")
        if job.data.document_mask:
            attend_within_documents(part)
        if dims.pp_enabled:
            keep_modules(part, stage_modules[stage])
        parallelize(part)
        materialize(part, device)
        init_weights(part, t.seed)
        # A step's microbatch losses are averaged; the MoE auxiliary losses' gradients follow suit.
        # Under tensor parallel each tp rank's router sees its slice of the sequence and the
        # router's gradients are summed over the tp ranks: each slice's loss counts 1/tp.
        set_aux_loss_scale(part, 1 / (t.grad_accum_steps * dims.pp_microbatches * dims.tp))
        parts.append(part)
    return parts, stages


def make_step_fns(job: JobConfig, dims: ParallelDims, device: torch.device, parts: list[nn.Module],
                  stages: list[int], loss_parallel: bool):
    """The forward and backward of one optimizer step, and the forward only (validation): each maps
    this rank's microbatches to its mean loss (0 on pipeline ranks without the last stage)."""
    pp_group = dims.view("pp").get_group() if dims.pp_enabled else None
    owners = stage_owners(dims.pp, dims.pp_stages_per_rank, job.parallel.pp_schedule)
    pp_rank = dims.view("pp").get_local_rank()

    def eval_fn(microbatches: list) -> torch.Tensor:
        total = torch.zeros((), device=device)
        for inputs, labels, positions in microbatches:
            logits = forward_only(parts, stages, owners, pp_rank, pp_group, inputs.to(device), positions.to(device))
            if logits is not None:
                with loss_parallel_context(loss_parallel):
                    total += _local(cross_entropy(logits, labels.to(device))) / len(microbatches)
        return total

    if not dims.pp_enabled:
        return partial(train_step, parts[0], device=device, loss_parallel=loss_parallel), eval_fn
    # Accumulation steps are more microbatches of one schedule run: FSDP gathers and reduce-scatters
    # once a step, and the pipeline fills and drains once.
    n_microbatches = job.training.grad_accum_steps * dims.pp_microbatches

    def loss_fn(logits, labels):
        # Each microbatch's share of the step's mean loss, so gradients sum to the mean's.
        return cross_entropy(logits, labels) / n_microbatches

    n_stages = dims.pp * dims.pp_stages_per_rank
    schedule = build_schedule(job.parallel.pp_schedule, parts, stages, n_stages, pp_group, device,
                              n_microbatches, loss_fn)
    step = partial(pipeline_step, schedule, device=device, loss_parallel=loss_parallel, first=0 in stages,
                   last=n_stages - 1 in stages)
    return step, eval_fn


def describe_layout(dims: ParallelDims, total: int, held: int, held_mib: float) -> str:
    """One line on what the job is split into and how much of its model (its stages, under pipeline
    parallel) rank 0 holds."""
    degrees = ", ".join(f"{name}={getattr(dims, name)}" for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    scope = "rank 0's stages" if dims.pp_enabled else "the model"
    return (f"mesh {degrees} | {scope}: {total / 1e6:.2f}M parameters, rank 0 holds {held / 1e6:.2f}M "
            f"({held_mib:.1f} MiB, 1/{total / held:.2f})")


def train_step(model, microbatches: list, *, device: torch.device, loss_parallel: bool) -> torch.Tensor:
    """Forward and backward over this rank's microbatches; returns their mean loss."""
    total = torch.zeros((), device=device)
    for i, (inputs, labels, positions) in enumerate(microbatches):
        # Gradients are reduced across data-parallel ranks once, after the last microbatch.
        model.set_requires_gradient_sync(i == len(microbatches) - 1)
        with loss_parallel_context(loss_parallel):
            logits = model(inputs.to(device), positions.to(device))
            loss = cross_entropy(logits, labels.to(device)) / len(microbatches)
            loss.backward()
        total += _local(loss.detach())
    return total


def pipeline_step(schedule, microbatches: list, *, device: torch.device, loss_parallel: bool, first: bool,
                  last: bool) -> torch.Tensor:
    """One schedule run over the step's microbatches (the accumulation steps' together, in order):
    the schedule cuts them into pipeline microbatches and (on the last stage) records each one's
    already scaled loss, so they sum to the mean."""
    inputs, labels, positions = (torch.cat(parts) for parts in zip(*microbatches))
    losses: list[torch.Tensor] = []
    args = (inputs.to(device),) if first else ()
    with loss_parallel_context(loss_parallel):
        # Every stage's blocks need the positions; the schedule splits them like the inputs.
        schedule.step(*args, target=labels.to(device) if last else None, losses=losses,
                      positions=positions.to(device))
    if not last:
        return torch.zeros((), device=device)
    return torch.stack([_local(loss.detach()) for loss in losses]).sum()


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process. Dynamo's counters are private (torch 2.13);
    kept to this one function."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _local(value: torch.Tensor) -> torch.Tensor:
    """The part of a DTensor this rank holds (all of it when replicated, e.g. a loss-parallel loss)."""
    return value.to_local() if isinstance(value, DTensor) else value


def job_loss(loss: torch.Tensor, dims: ParallelDims) -> float:
    """The whole job's mean loss from each rank's: averaged over the data-parallel (and context-
    parallel) ranks, summed over pipeline stages, of which only the last holds a loss."""
    value = loss.detach().clone()
    dp_cp = dims.view("dp_cp")
    dist.all_reduce(value, group=dp_cp.get_group())
    if dims.pp_enabled:
        dist.all_reduce(value, group=dims.view("pp").get_group())
    return value.item() / dp_cp.size()
