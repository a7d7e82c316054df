"""The training job: check the config, set up the mesh and model, run the step loop."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn

from trainer.allocator import reuse_freed_memory
from trainer.build import build_model_parts, build_options
from trainer.checkpoint import Checkpointer, TrainState, restore, roll_back
from trainer.config import CheckpointConfig, JobConfig
from trainer.data import BatchLoader, Prefetcher, build_dataset, document_positions
from trainer.distributed import init_distributed, resolve_device, restart_count, shutdown, world_size
from trainer.errors import ConfigError, TrainingStopped
from trainer.faults import Faults
from trainer.guards import StepGuard, check_finite
from trainer.memory import COUNTED_STEPS, TensorMemory, peak_memory_gib, peak_tensor_gib
from trainer.metrics import MetricsLogger, MoEStats, flops_per_token, peak_tflops
from trainer.models import family, import_modules
from trainer.optim import build_optimizer, build_scheduler, clip_and_sum_loss_
from trainer.output import OutputLock, check_writable
from trainer.parallel.context_parallel import shard_batch
from trainer.parallel.dims import ParallelDims
from trainer.parallel.expert_parallel import sum_grads_over_tp
from trainer.plan import make_plan
from trainer.plan.devices import local_device
from trainer.profiler import StepProfiler
from trainer.rules import check_checkpoint, check_job
from trainer.steps import describe_layout, describe_share, job_loss, local_tensor, make_step_fns
from trainer.watchdog import Watchdog, enable_flight_recorder


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
    import_modules(job.imports)
    device = resolve_device(job.device)
    dims = check_job(job, world_size())
    checkpoint = check_checkpoint(job.checkpoint)
    if job.training.spike.action == "rollback" and not checkpoint.enabled:
        raise ConfigError("training.spike.action=rollback needs checkpoint.enabled=true (a checkpoint to go back to)")
    check_writable(job.output_dir)
    predicted = check_memory(job, dims, device) if job.plan.check else None
    if device.type == "cpu" and job.training.cpu_reuse_memory:
        reuse_freed_memory()
    dataset, val_dataset = build_datasets(job)
    if dataset.vocab_size > job.model.vocab_size:
        raise ConfigError(f"model.vocab_size={job.model.vocab_size} must be >= the tokenizer's {dataset.vocab_size} "
                          f"(data.tokenizer={job.data.tokenizer})")
    enable_flight_recorder(job.output_dir)
    lock = watchdog = None
    try:
        init_distributed(device, job.distributed.timeout_s)
        lock = OutputLock(job.output_dir, dist.get_rank())
        watchdog = Watchdog(job.distributed.step_timeout_s, job.distributed.timeout_s, job.output_dir)
        train(job, OmegaConf.to_container(cfg, resolve=True), dims, checkpoint, device, dataset, val_dataset, predicted,
              watchdog)
    except TrainingStopped as e:
        # Every rank reaches the same decision from the same all-reduced values; one line each.
        sys.stderr.write(f"training stopped: {e}\n")
        sys.stderr.flush()
        raise SystemExit(1) from None
    finally:
        if watchdog is not None:
            watchdog.close()
        if lock is not None:
            lock.release()
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
          dataset, val_dataset, predicted: float | None, watchdog: Watchdog) -> None:
    t = job.training
    dims.build_mesh(device.type)
    watchdog.groups = dims.group_names()
    rank = dist.get_rank()
    output_dir = Path(job.output_dir)
    if rank == 0:
        output_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.create(config), output_dir / "config.yaml")

    parts, stages = build_model_parts(build_options(job, dims, device), dims, device)
    model = nn.ModuleList(parts)
    held = [local_tensor(p) for p in model.parameters()]
    param_mib = sum(p.numel() * p.element_size() for p in held) / 2**20
    if rank == 0:
        total = sum(p.numel() for p in model.parameters())
        print(f"{describe_layout(dims)} | grad_accum_steps={t.grad_accum_steps} | "
              f"{describe_share(dims, total, sum(p.numel() for p in held), param_mib)}", flush=True)
        if predicted is not None:
            print(f"plan: predicted peak {predicted / 2**30:.2f} GiB of tensors on rank 0", flush=True)
    loss_parallel = dims.tp_enabled and job.parallel.loss_parallel
    step_fn, eval_fn = make_step_fns(job, dims, device, parts, stages, loss_parallel, watchdog.phase)

    optimizer = build_optimizer(model, job.optim, t.lr, t.weight_decay)
    dp_rank, cp_rank = dims.view("dp").get_local_rank(), dims.view("cp").get_local_rank()
    loader, val_loader = (
        BatchLoader(data, t.global_batch_size, dp_rank, dims.dp, t.grad_accum_steps, t.seed, dims.pp_microbatches)
        for data in (dataset, val_dataset)
    )
    state = TrainState(parts, optimizer)
    log = partial(print, flush=True) if rank == 0 else lambda *_: None
    start_step, position, saved_world = restore(checkpoint, state, output_dir / "checkpoints", job.model, log)
    if saved_world is not None and saved_world != dims.world_size:
        log(f"world changed from {saved_world} to {dims.world_size} ranks: {describe_layout(dims)}, "
            f"grad_accum_steps={t.grad_accum_steps}, the global batch of {t.global_batch_size} sequences kept")
    loader.offset = position - start_step * t.global_batch_size
    scheduler = build_scheduler(optimizer, t.warmup_steps, t.steps, job.optim.min_lr_ratio, start_step)
    checkpointer = None
    if checkpoint.enabled:
        checkpointer = Checkpointer(output_dir / "checkpoints", checkpoint.interval, checkpoint.keep_last,
                                    checkpoint.async_save, config["model"], device)

    faults = Faults.from_env(rank, job.output_dir)
    if checkpointer is not None:
        checkpointer.before_publish = partial(faults.hang_or_kill, "kill_save")

    def microbatches(loader: BatchLoader, step: int) -> list[tuple[torch.Tensor, ...]]:
        batches = loader.microbatches(step)
        if loader is not val_loader and faults.at("garbage_batch", step + 1):
            batches = faults.garbage(batches, dataset.vocab_size)
        # The ranks of a cp group read the same sequences; each keeps its share of them.
        return [
            shard_batch(inputs, labels, cp_rank, dims.cp,
                        document_positions(inputs, dataset.eos_id) if job.data.document_mask else None)
            for inputs, labels in batches
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
    guard = StepGuard(t, device)
    loss_holders = dims.world_size // dims.pp  # the ranks holding a loss: those of the last stage
    rollback = t.spike.threshold is not None and t.spike.action == "rollback"
    profiler = StepProfiler(job.metrics.profile_step, job.output_dir, rank, device)
    start = last_time = time.perf_counter()
    step = last_step = start_step
    while step < t.steps:
        step += 1
        watchdog.step(step)
        profiler.begin(step)
        batches = train_batches(step - 1)
        watchdog.phase("forward")
        faults.hang_or_kill("hang", step)
        loss = step_fn(batches)
        faults.hang_or_kill("kill", step)
        watchdog.phase("optimizer")
        sum_grads_over_tp(parts, dims)
        if faults.at("nan_grad", step):
            faults.poison(model.parameters())
        if moe_stats is not None:
            moe_stats.collect(parts, family(job.model.family), t.grad_accum_steps * dims.pp_microbatches)
        grad_norm, loss_sum = clip_and_sum_loss_(model.parameters(), t.max_norm, loss)
        # The fused AdamW leaves weights, moments and its step count as they were when found_inf is 1.
        optimizer.found_inf = guard.check(step, loss_sum / loss_holders, grad_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        profiler.end(step)
        if rollback and guard.spiked():
            watchdog.slow("rollback")
            back = roll_back(state, output_dir / "checkpoints", checkpointer, log)
            if back is not None:  # on from the checkpoint's step, with the data after the spike's batch
                position = loader.position(step)
                loader.offset = position - back * t.global_batch_size
                scheduler = build_scheduler(optimizer, t.warmup_steps, t.steps, job.optim.min_lr_ratio, back)
                log(f"spike: step {step} skipped; rolled back to step {back}, reading on from sequence {position}")
                step, last_step, last_time = back, back, time.perf_counter()
                continue
        if step == counted_until and tensor_memory is not None:
            tensor_memory.stop()
            if t.compile:
                # Blocks run eagerly while tensors are counted: dynamo skips a frame under a dispatch
                # mode and remembers the skip. Forgotten here, the next step compiles them.
                torch.compiler.reset()
                watchdog.allow_slow_step()

        validate = job.validation.every > 0 and step % job.validation.every == 0
        if step % job.metrics.log_every == 0 or step == t.steps or validate:
            watchdog.phase("metrics")
            loss = job_loss(loss, dims)
            now = time.perf_counter()
            tokens_per_s = tokens_per_step * (step - last_step) / (now - last_time)
            guarded, said = guard.report()
            if said:
                log(f"guard: {said}")
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
                "time": time.time(),
                "world_size": dims.world_size,
                "restart": restart_count(),
                **guarded,
            }
            if moe_stats is not None:
                record |= moe_stats.report(layer_copies=dims.world_size // dims.pp)
            if validate:
                watchdog.slow("validation")
                val_losses = [eval_fn(microbatches(val_loader, i)) for i in range(job.validation.steps)]
                record["val_loss"] = job_loss(torch.stack(val_losses).mean(), dims)
            logger.log(record)
            if predicted is not None and record["mem_tensor_gib"] is not None:
                log(f"plan: measured peak {record['mem_tensor_gib']:.2f} GiB of tensors on rank 0 by step {step} "
                    f"(predicted {predicted / 2**30:.2f})")
                predicted = None  # said once
            last_step, last_time = step, time.perf_counter()
        watchdog.phase("checkpoint")
        if checkpointer is not None and checkpointer.after_step(step, t.steps, partial(
                saved_state, watchdog, guard, parts, optimizer, state, step, loader.position(step))):
            break
    watchdog.slow("finishing")
    if tensor_memory is not None:
        tensor_memory.stop()
    if t.compile and rank == 0:
        print(f"compile: {compiled_graphs()} graphs compiled", flush=True)
    train_batches.close()
    if checkpointer is not None:
        checkpointer.close()
    logger.close()


def saved_state(watchdog: Watchdog, guard: StepGuard, parts, optimizer, state: TrainState, step: int,
                position: int) -> dict:
    """What a checkpoint of `step` holds, once the guards let it be saved (collective)."""
    watchdog.slow("checkpoint")
    guard.check_stop()  # a stop pending since the last log stops here, before anything is written
    check_finite(parts, optimizer, step)
    return state.for_save(step, position)


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process. Dynamo's counters are private (torch 2.13);
    kept to this one function."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
