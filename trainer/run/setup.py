"""Everything one rank's training loop runs with, built once: the model on the mesh, the optimizer,
the data, the checkpoints (resumed from), the logs, and the parts that act around each step."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainer.checkpoint import Checkpointer, TrainState
from trainer.checkpoint.folders import adapter_base
from trainer.config.schema import CheckpointConfig, JobConfig
from trainer.data.microbatches import StepData
from trainer.faults.guards import SpikeRollback, StepGuard
from trainer.faults.injection import FaultInjection
from trainer.faults.tolerance import OneGroup, ReplicaGroups
from trainer.faults.watchdog import Watchdog
from trainer.float8 import Float8Scales, float8_of, gathers_in_float8
from trainer.float8 import describe as describe_float8
from trainer.models import family
from trainer.models.moe_config import n_experts
from trainer.models.nf4 import stored_bytes
from trainer.observe.describe import (
    describe_layout,
    describe_lora,
    describe_share,
    describe_ulysses,
)
from trainer.observe.health import RankHealth
from trainer.observe.measured_memory import MemoryFigures
from trainer.observe.memory_snapshot import MemorySnapshot, known_tensors
from trainer.observe.metrics import MetricsLogger, Throughput, flops_per_token, peak_tflops
from trainer.observe.profiler import StepProfiler
from trainer.optim.build import build_optimizer
from trainer.optim.f8_state import warmup_note
from trainer.optim.schedule import build_scheduler
from trainer.parallel.build import build_model_parts, build_options
from trainer.parallel.dims import ParallelDims
from trainer.run.loop import Trainer, resume
from trainer.run.moe_upkeep import MoEUpkeep
from trainer.run.output import save_config
from trainer.run.passes import make_passes
from trainer.run.stop import StopRequest
from trainer.step_parts import StepParts
from trainer.tensors import local_tensor


def build_trainer(job: JobConfig, config: dict, dims: ParallelDims, checkpoint: CheckpointConfig,
                  device: torch.device, dataset, val_dataset, predicted: float | None,
                  watchdog: Watchdog) -> Trainer:
    t = job.training
    dims.build_mesh(device.type)
    watchdog.groups = dims.group_names()
    rank = dist.get_rank()
    output_dir = Path(job.output_dir)
    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
    log = partial(print, flush=True) if rank == 0 else lambda *_: None

    options = build_options(job, dims, device)
    model_parts, stages = build_model_parts(options, dims, device)
    model = nn.ModuleList(model_parts)
    param_mib = describe_model(model, dims, log)
    if predicted is not None:
        log(f"plan: predicted peak {predicted / 2**30:.2f} GiB of tensors on rank 0")
    describe_features(job, dims, options, model_parts, log if rank == 0 else None)
    passes = make_passes(job, dims, device, model_parts, stages, watchdog.phase)
    optimizer = build_optimizer(model, job.optim, t.lr, t.weight_decay, family(job.model.family),
                                dims.group_spanning, device)
    if hasattr(optimizer, "describe"):
        log(optimizer.describe())
    state = TrainState(model_parts, optimizer)
    stop = StopRequest()
    faults = FaultInjection.from_env(rank, job.output_dir, model.parameters(), stop)
    data = build_data(job, dims, dataset, val_dataset, faults)
    checkpoint_dir = output_dir / "checkpoints"
    # A replica group takes its state at its first quorum: from a peer group when one is past step
    # 0, else (the whole job starts) from the newest checkpoint of any group.
    deferred = checkpoint if job.fault_tolerance.enabled else None
    step, resumed = ((0, None) if deferred is not None
                     else resume(job, dims, checkpoint, state, data, checkpoint_dir, log, config))
    if rank == 0 and step < t.steps:  # a finished run's config stays as it trained
        save_config(output_dir, config, log)

    # (a LoRA run's checkpoints name their frozen base)
    adapter = ({**config["peft"], "base": adapter_base(checkpoint.initial)} if job.peft.method
               else None)
    checkpointer = build_checkpointer(checkpoint, checkpoint_dir, config, device,
                                      job.data.tokenizer, faults, adapter)
    if checkpointer is not None and deferred is None:
        checkpointer.continue_run(checkpoint.resume, resumed)
    # only rank 0 logs mfu
    peak = peak_tflops(device, job.metrics.peak_tflops) if rank == 0 else None
    trainer = Trainer(
        job=job, dims=dims, device=device, log=log, model=model, model_parts=model_parts,
        passes=passes, optimizer=optimizer, state=state, data=data, step=step,
        scheduler=build_scheduler(optimizer, t.warmup_steps, t.steps, job.optim.min_lr_ratio, step),
        replicas=OneGroup(), checkpointer=checkpointer, checkpoint_dir=checkpoint_dir,
        logger=MetricsLogger(str(output_dir), rank == 0, job.metrics.wandb, config,
                             None if deferred else step, job.metrics.tensorboard.enabled),
        throughput=Throughput(t.global_batch_size * t.seq_len,
                              flops_per_token(job.model, t.seq_len, job.peft.method is not None),
                              peak, dims.world_size, step, t.steps),
        guard=StepGuard(t, device), stop=stop, param_mib=param_mib, predicted=predicted,
    )
    attach(trainer, optimizer, watchdog, faults, deferred, config)
    return trainer


def attach(trainer: Trainer, optimizer, watchdog: Watchdog, faults: FaultInjection | None,
           deferred: CheckpointConfig | None, config: dict) -> None:
    """What acts around the trainer's steps: the replica groups (under fault tolerance, which
    resume at their first quorum: `deferred`) and the step parts."""
    job, dims, device, log = trainer.job, trainer.dims, trainer.device, trainer.log
    step = trainer.step
    if deferred is not None:
        trainer.replicas = ReplicaGroups(job, trainer.model, optimizer,
                                         (trainer.progress, trainer.set_progress), device, log,
                                         watchdog.phase,
                                         partial(resume_at_first_quorum, trainer, deferred,
                                                 config))
        trainer.replicas.set_step(step)
    health = health_check(job, dims, device, trainer.stop.group, log)
    parts = build_step_parts(job, dims, device, trainer.model, trainer.model_parts, optimizer,
                             watchdog, health, faults, step)
    spike = job.training.spike
    if spike.threshold is not None and spike.action == "rollback":
        parts.append(SpikeRollback(trainer.guard, trainer.roll_back))
    trainer.step_parts = StepParts(parts)


def resume_at_first_quorum(trainer: Trainer, checkpoint: CheckpointConfig, config: dict,
                           received: bool) -> None:
    """Under fault tolerance, after a replica group's first quorum: unless a peer group's state came
    in it, every group is at step 0 and resumes from the newest checkpoint of any group (and its
    checkpoints continue that checkpoint's run; a group that took a peer's state keeps its own)."""
    if not received and trainer.step == 0:
        trainer.step_parts.enter("resume", long=True)
        job = trainer.job
        groups = [trainer.checkpoint_dir.parent.parent / f"replica_group_{g}" / "checkpoints"
                  for g in range(job.parallel.dp_replicate)]
        step, resumed = resume(job, trainer.dims, checkpoint, trainer.state, trainer.data, groups,
                               trainer.log, config)
        if trainer.checkpointer is not None:
            trainer.checkpointer.continue_run(checkpoint.resume, resumed)
        trainer.set_progress({"step": step, "data_offset": trainer.data.loader.offset})
        trainer.replicas.set_step(trainer.step)
    trainer.logger.begin(trainer.step)


def build_checkpointer(checkpoint: CheckpointConfig, checkpoint_dir: Path, config: dict,
                       device: torch.device, tokenizer: str,
                       faults: FaultInjection | None,
                       adapter: dict | None = None) -> Checkpointer | None:
    """The checkpointer (None with checkpoint.enabled=false); a `kill_save` fault fires before it
    publishes."""
    if not checkpoint.enabled:
        return None
    checkpointer = Checkpointer(checkpoint_dir, checkpoint.interval, checkpoint.keep_last,
                                checkpoint.async_save, config, device, tokenizer, adapter)
    if faults is not None:
        checkpointer.before_publish = partial(faults.hang_or_kill, "kill_save")
    return checkpointer


def build_step_parts(job: JobConfig, dims: ParallelDims, device: torch.device, model: nn.Module,
                     model_parts: list,
               optimizer, watchdog: Watchdog, health: RankHealth | None,
                     faults: FaultInjection | None,
               step: int) -> list:
    """The features acting around the step, in the order their hooks run: the allocator's recorder
    first (it sees every part's allocations), the watchdog (a fault then hangs inside the phase it
    names), the straggler check's clocks around the rest (an injected slowdown is timed in its
    phase), the profiler around everything else."""
    m, rank = job.metrics, dist.get_rank()
    parts = [*([MemorySnapshot(m.memory_snapshot_step, job.output_dir, rank, device,
                               known_tensors(model, optimizer))]
               if m.memory_snapshot_step is not None and device.type == "cuda" else []),
             watchdog, *([health] if health else []),
             StepProfiler(m.profile_step, job.output_dir, rank, device)]
    if faults is not None:
        parts.append(faults)
    if gathers_in_float8(float8_of(job.training)):
        parts.append(Float8Scales(model_parts))
    if n_experts(job.model):
        parts.append(MoEUpkeep(model_parts, family(job.model.family), dims, job.model.moe_layers(),
                               n_experts(job.model), device))
    parts.append(MemoryFigures(device, model.parameters(), step, job.training.compile,
                               watchdog.allow_slow_step))
    return parts


def health_check(job: JobConfig, dims: ParallelDims, device: torch.device, group,
                 log) -> RankHealth | None:
    """The straggler check, on jobs of several ranks with metrics.health_every set (collective)."""
    m = job.metrics
    if m.health_every is None or dims.world_size == 1:
        return None
    stage = dims.view("pp").get_local_rank() if dims.pp_enabled else 0
    return RankHealth(m.health_every, m.slow_rank_window, m.slow_rank_threshold, device, stage,
                      group, log)


def build_data(job: JobConfig, dims: ParallelDims, dataset, val_dataset,
               faults: FaultInjection | None) -> StepData:
    ft = job.fault_tolerance
    eos_id = dataset.eos_id if job.data.document_mask else None
    corrupt = partial(faults.corrupt, vocab_size=dataset.vocab_size) if faults is not None else None
    return StepData(dataset, val_dataset, job.training, dims, dims.view("dp").get_local_rank(),
                    dims.view("cp").get_local_rank(), eos_id, corrupt,
                    job.parallel.dp_replicate if ft.enabled else 1,
                    ft.replica_group if ft.enabled else 0)


def describe_features(job: JobConfig, dims: ParallelDims, options, model_parts: list,
                      log) -> None:
    """The start-up lines of Ulysses' repeated key/value heads, LoRA and float8 (rank 0: `log`
    given)."""
    if log is None:
        return
    if (ulysses := describe_ulysses(job.model, dims)) is not None:
        log(ulysses)
    if options.lora is not None:
        log(describe_lora(job.model, options.lora))
    f8 = float8_of(job.training)
    if f8 is not None:
        log(describe_float8(model_parts, f8))
    if (note := warmup_note(job.optim.state_dtype, job.training.warmup_steps)) is not None:
        log(note)


def describe_model(model: nn.Module, dims: ParallelDims, log) -> float:
    """Prints the layout and rank 0's share of the model; returns the MiB of parameters this rank
    holds."""
    held = [local_tensor(p) for p in model.parameters()]
    param_mib = sum(stored_bytes(p) for p in held) / 2**20
    total = sum(p.numel() for p in model.parameters())
    log(f"{describe_layout(dims)} | grad_accum_steps={dims.grad_accum_steps} | "
        f"{describe_share(dims, total, sum(p.numel() for p in held), param_mib)}")
    return param_mib
