"""One rank's step loop (`fit`): batch, forward and backward (or the pipeline schedule), reduce,
clip, guard, optimizer step, then log and save. Its pieces are built by
`trainer.run.setup.build_trainer`. What acts around the step is not named here: the features are
step parts (`trainer/step_parts.py`), called at fixed points and told each phase the loop enters;
the replica groups (`self.replicas`, the job as one group without fault tolerance) take the quorum
before a step and commit its update; the passes (`trainer/run/passes.py`) hold what differs under a
pipeline."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.checkpoint import Checkpointer, TrainState, restore, roll_back
from trainer.checkpoint.folders import checkpoint_steps
from trainer.config.schema import CheckpointConfig, JobConfig
from trainer.data.microbatches import StepData
from trainer.distributed import restart_count
from trainer.faults.guards import StepGuard, check_finite
from trainer.faults.tolerance import OneGroup
from trainer.observe.describe import describe_layout
from trainer.observe.metrics import MetricsLogger, Throughput
from trainer.observe.summary import rank_peaks, summary_lines
from trainer.optim.clipping import clip_and_sum_loss_
from trainer.optim.schedule import build_scheduler
from trainer.parallel.dims import ParallelDims
from trainer.run.passes import Passes, job_loss, supervised_count, supervised_scale
from trainer.run.stop import StopRequest
from trainer.step_parts import StepPart, StepParts
from trainer.tensors import local_tensor


@dataclass
class Trainer:
    job: JobConfig
    dims: ParallelDims
    device: torch.device
    log: Callable[..., None]  # prints on rank 0
    model: nn.ModuleList  # this rank's model parts (its pipeline stages), as one module
    model_parts: list[nn.Module]
    # this rank's forward and backward (plain or the pipeline schedule's), forward only
    passes: Passes
    optimizer: torch.optim.Optimizer
    state: TrainState  # what a checkpoint holds of the model and optimizer
    data: StepData
    step: int  # the last step done
    scheduler: Any
    replicas: OneGroup  # the replica groups under fault tolerance; else the job as one group
    checkpointer: Checkpointer | None
    checkpoint_dir: Path
    logger: MetricsLogger
    throughput: Throughput
    guard: StepGuard
    stop: StopRequest
    param_mib: float
    predicted: float | None  # the plan's peak bytes of tensors, said beside the measured one once
    step_parts: StepPart = field(default_factory=lambda: StepParts([]))

    def __post_init__(self):
        self.training = self.job.training
        self.first_step = self.step + 1  # the first step this run trains
        # The first step trained, once one is (a quorum may move the run before it).
        self.first_trained: int | None = None
        # where the optimizer's weights are: the device, or the host under FSDP's offload
        self.state_device = local_tensor(next(self.model.parameters())).device

    def fit(self) -> None:
        """Trains up to training.steps, or until a signal stops the run."""
        steps = self.training.steps
        if self.step >= steps:
            self.log(f"nothing to train: already at step {self.step} (training.steps={steps}); "
                     f"raise training.steps to train on")
        while self.step < steps:
            done = self.train_step()
            if done is not None and self.log_and_save(*done):
                break
        self.finish()

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """Trains the step after self.step: forward and backward over its microbatches (a round of
        them per replica share, each round accumulating into the gradients), then clipping, the
        guard and the optimizer step. Returns (this rank's loss, the gradient norm, the lr) once the
        step counts; None when it does not, self.step then being where the run goes on from: the
        replica groups did not all finish it (it is trained again), a part moved the run (a loss
        spike's rollback), or the quorum brought a peer group's state from past the last step."""
        # The quorum: a group behind the others takes their state and step first.
        shares = self.replicas.start_step()
        step = self.step + 1
        if step > self.training.steps:
            return None
        self.first_trained = self.first_trained or step
        self.step_parts.start_step(step)
        rounds = self.data.train(step - 1, shares)
        self.step_parts.before_forward(step)
        scale = self.loss_scale(rounds)
        loss = torch.zeros((), device=self.device)
        for microbatches in rounds:
            loss = loss + self.passes.train(microbatches, scale)
        self.step_parts.after_backward(step)
        loss = self.replicas.reduce(self.model.parameters(), loss)
        grad_norm, loss_sum = clip_and_sum_loss_(self.model.parameters(), self.training.max_norm,
                                                 loss)
        skip = self.guard.check(step, loss_sum / self.passes.loss_ranks, grad_norm)
        self.step_parts.before_optimizer_step(step, skip, self.passes.microbatches * len(rounds))
        lr = self.scheduler.get_last_lr()[0]
        # The fused AdamW leaves weights, moments and step count as they were when found_inf is 1
        # (on the host with the weights, under training.offload=optimizer).
        self.optimizer.found_inf = skip.to(self.state_device)
        counted = self.replicas.commit(self.update)
        self.optimizer.zero_grad(set_to_none=True)
        self.step_parts.after_step(step)
        if counted:
            self.step = step
            self.step_parts.after_update(step)
        return (loss, grad_norm, lr) if self.step == step else None

    def loss_scale(self, rounds: list[list]) -> torch.Tensor:
        """The factor this step's token losses take (passes.supervised_scale), from the supervised
        tokens of the whole global batch (every replica share's), counted before any forward."""
        self.step_parts.enter("counting the supervised tokens")
        counts = [supervised_count(microbatches, self.dims, self.device) for microbatches in rounds]
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        self.supervised = self.replicas.sum_counts(sum(counts, zero))
        return supervised_scale(self.supervised,
                                self.dims.view("dp_cp").size() * self.replicas.shares())

    def update(self) -> None:
        """The optimizer's step and the learning rate's."""
        self.optimizer.step()
        self.scheduler.step()

    def log_and_save(self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> bool:
        """The step's log line and checkpoint, when due; whether a signal stops the run here."""
        step, every = self.step, self.job.validation.every
        validate = every > 0 and step % every == 0
        if step % self.job.metrics.log_every == 0 or step == self.training.steps or validate:
            self.log_step(loss, grad_norm, lr, validate)
        self.step_parts.enter("checkpoint")
        stop = self.stop.agreed()
        if self.checkpointer is not None and self.replicas.saves_checkpoints():
            self.checkpointer.after_step(step, self.training.steps, self.saved_state, stop)
        if stop:
            self.say_stopped()
        return stop

    def log_step(self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float,
                 validate: bool) -> None:
        """The step's record (collective: the loss and statistics are the whole job's)."""
        self.step_parts.enter("metrics")
        step, dims = self.step, self.dims
        record = {"step": step, "loss": job_loss(loss, dims), "grad_norm": grad_norm.item(),
                  "lr": lr, "supervised_tokens": int(self.supervised.item())}
        throughput = self.throughput.report(step)
        guarded, said = self.guard.report()
        if said:
            self.log(f"guard: {said}")
        record |= {
            "tokens_per_s": throughput["tokens_per_s"],
            "mfu": throughput["mfu"],
            **self.step_parts.record(),
            "param_mib": self.param_mib,
            "elapsed_s": throughput["elapsed_s"],
            "eta_s": throughput["eta_s"],
            "time": time.time(),
            "world_size": dims.world_size,
            "restart": restart_count(),
            **guarded,
        }
        if validate:
            record["val_loss"] = self.validation_loss()
        self.logger.log(record)
        measured, since = record["mem_tensor_gib"], record["mem_since_step"]
        # once, steady state
        if self.predicted is not None and measured is not None and since > self.first_step:
            predicted = self.predicted / 2**30
            self.log(f"plan: measured peak {measured:.2f} GiB of tensors on rank 0 since step "
                     f"{since}, the steady state (predicted {predicted:.2f}, "
                     f"{predicted / measured - 1:+.1%})")
            self.predicted = None
        self.throughput.reset(step)

    def validation_loss(self) -> float:
        """The job's mean loss over validation.steps batches of the validation set (collective)."""
        self.step_parts.enter("validation", long=True)
        dims = self.dims
        batches = [self.data.validation(i) for i in range(self.job.validation.steps)]
        count = supervised_count([m for microbatches in batches for m in microbatches], dims,
                                 self.device)
        scale = supervised_scale(count, dims.view("dp_cp").size())
        return job_loss(sum(self.passes.evaluate(microbatches, scale) for microbatches in batches),
                        dims)

    def roll_back(self) -> None:
        """After a loss spike: back to the newest checkpoint, reading on past the spike's batch
        (collective). With no checkpoint yet the step stays skipped."""
        self.step_parts.enter("rollback", long=True)
        back = roll_back(self.state, self.checkpoint_dir, self.checkpointer, self.log)
        if back is None:
            return
        position = self.data.loader.position(self.step)
        self.log(f"spike: step {self.step} skipped; rolled back to step {back}, reading on from "
                 f"sequence {position}")
        self.set_progress({"step": back,
                           "data_offset": position - back * self.training.global_batch_size})

    def saved_state(self) -> dict:
        """What a checkpoint of this step holds, once the guards let it be saved (collective)."""
        self.step_parts.enter("checkpoint", long=True)
        # a stop pending since the last log stops here, before anything is written
        self.guard.check_stop()
        check_finite(self.model_parts, self.optimizer, self.step)
        return self.state.for_save(self.step, self.data.loader.position(self.step))

    def progress(self) -> dict:
        """Where the run is, besides the weights and optimizer state (a recovering replica
        group's)."""
        return {"step": self.step, "data_offset": self.data.loader.offset}

    def set_progress(self, progress: dict) -> None:
        """Goes on from `progress` (a resume, a rollback, a peer group's state)."""
        self.step, self.data.loader.offset = progress["step"], progress["data_offset"]
        t = self.training
        self.scheduler = build_scheduler(self.optimizer, t.warmup_steps, t.steps,
                                         self.job.optim.min_lr_ratio, self.step)
        self.throughput.reset(self.step)

    def say_stopped(self) -> None:
        received = self.stop.received
        why = (f"on a signal ({signal.Signals(received).name})" if received
               else "on a signal to another rank")
        if self.checkpointer is None:
            self.log(f"stopped at step {self.step} {why}; nothing was saved "
                     "(checkpoint.enabled=false)")
        elif not self.replicas.saves_checkpoints():
            self.log(f"stopped at step {self.step} {why}; this replica group saves no checkpoints "
                     "(the quorum's first group does); started again, it recovers from a peer "
                     "group")
        else:
            self.log(f"checkpoint: stopped at step {self.step} {why}: saved "
                     f"{self.checkpoint_dir}/step_{self.step}; run the same command to go on from "
                     "it (checkpoint.resume=auto)")

    def finish(self) -> None:
        peaks = rank_peaks(self.device, self.stop.group)
        skipped = int(self.guard.skipped.item())
        self.stop.close()
        self.step_parts.enter("finishing", long=True)
        self.step_parts.close()
        if self.training.compile:
            self.log(f"compile: {compiled_graphs()} graphs compiled")
        self.data.close()
        if self.checkpointer is not None:
            self.checkpointer.close()
        first = self.first_trained
        if first is not None and peaks:  # rank 0, once this run has trained
            saved = checkpoint_steps(self.checkpoint_dir) if self.checkpointer is not None else None
            for line in summary_lines(first, self.step, self.training.steps,
                                      self.throughput.tokens_per_step,
                                      time.perf_counter() - self.throughput.start,
                                      self.logger.speeds, peaks, skipped, saved,
                                      steady=self.device.type == "cuda"):
                self.log(line)
        self.replicas.close()
        self.logger.close()


def resume(job: JobConfig, dims: ParallelDims, checkpoint: CheckpointConfig, state: TrainState,
           data: StepData, folders: Path | list[Path], log,
           config: dict) -> tuple[int, Path | None]:
    """Loads what checkpoint.* asks for (resume=auto: the newest in `folders`, trained with
    `config`'s settings); returns the step to go on from, with the data's position set to it, and
    the checkpoint resumed (collective)."""
    t = job.training
    start_step, position, saved_world, resumed = restore(checkpoint, state, folders, job.model, log,
                                                         config)
    if saved_world is not None and saved_world != dims.world_size:
        log(f"world changed from {saved_world} to {dims.world_size} ranks: "
            f"{describe_layout(dims)}, grad_accum_steps={dims.grad_accum_steps}, the global batch "
            f"of {t.global_batch_size} sequences kept")
    data.loader.offset = position - start_step * t.global_batch_size
    return start_step, resumed


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process. Dynamo's counters are private (torch 2.13);
    kept to this one function."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
