"""One rank's training: the model, optimizer, data and checkpoints set up once (`Trainer.__init__`),
then the step loop (`fit`): batch, forward and backward (or the pipeline schedule), clip, guard,
step, log, save. Everything else plugs in around it."""

from __future__ import annotations

import signal
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from trainer.build import build_model_parts, build_options
from trainer.checkpoint import Checkpointer, TrainState, restore, roll_back
from trainer.config import CheckpointConfig, JobConfig
from trainer.data.microbatches import StepData
from trainer.distributed import restart_count
from trainer.fault_tolerance import ReplicaGroups
from trainer.faults import Faults
from trainer.float8 import describe as describe_float8
from trainer.float8 import float8_of, gathers_in_float8, precompute_scales
from trainer.guards import StepGuard, check_finite
from trainer.memory import COUNTED_STEPS, TensorMemory, peak_memory_gib, peak_tensor_gib
from trainer.metrics import MetricsLogger, MoEStats, Throughput, flops_per_token, peak_tflops
from trainer.models import family
from trainer.models.moe import update_expert_biases
from trainer.optim import build_optimizer, build_scheduler, clip_and_sum_loss_
from trainer.parallel.dims import ParallelDims
from trainer.parallel.expert_parallel import sum_grads_over_tp
from trainer.profiler import StepProfiler
from trainer.steps import describe_layout, describe_share, job_loss, make_step_fns
from trainer.stop import StopRequest
from trainer.tensors import local_tensor
from trainer.watchdog import Watchdog


class Trainer:
    def __init__(self, job: JobConfig, config: dict, dims: ParallelDims, checkpoint: CheckpointConfig,
                 device: torch.device, dataset, val_dataset, predicted: float | None, watchdog: Watchdog):
        t = self.training = job.training
        self.job, self.dims, self.device, self.watchdog, self.predicted = job, dims, device, watchdog, predicted
        dims.build_mesh(device.type)
        watchdog.groups = dims.group_names()
        self.rank = dist.get_rank()
        self.output_dir = Path(job.output_dir)
        if self.rank == 0:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        self.log = partial(print, flush=True) if self.rank == 0 else lambda *_: None

        self.parts, stages = build_model_parts(build_options(job, dims, device), dims, device)
        self.model = nn.ModuleList(self.parts)
        self.param_mib = self._describe_model()
        f8 = float8_of(t)
        if f8 is not None:
            self.log(describe_float8(self.parts, f8))
        self.float8_scales = gathers_in_float8(f8)
        self.step_fn, self.eval_fn = make_step_fns(job, dims, device, self.parts, stages, watchdog.phase)
        self.optimizer = build_optimizer(self.model, job.optim, t.lr, t.weight_decay)
        self.state = TrainState(self.parts, self.optimizer)
        self.faults = Faults.from_env(self.rank, job.output_dir)
        self._build_data(dataset, val_dataset)
        self.checkpoint_dir = self.output_dir / "checkpoints"
        # A replica group takes its state at its first quorum: from a peer group when one is past
        # step 0, else (the whole job starts) from the newest checkpoint of any group.
        self.deferred_resume = checkpoint if job.fault_tolerance.enabled else None
        self.step = self._resume(checkpoint) if self.deferred_resume is None else 0
        if self.rank == 0 and self.step < t.steps:  # a finished run's config stays as it trained
            OmegaConf.save(OmegaConf.create(config), self.output_dir / "config.yaml")
        self.scheduler = self._scheduler(self.step)
        self.replicas = None
        if job.fault_tolerance.enabled:
            self.replicas = ReplicaGroups(job, self.model, self.optimizer, (self._progress, self._set_progress),
                                          device, self.log)
            self.replicas.set_step(self.step)
        self.checkpointer = None
        if checkpoint.enabled:
            self.checkpointer = Checkpointer(self.checkpoint_dir, checkpoint.interval, checkpoint.keep_last,
                                             checkpoint.async_save, config["model"], device, job.data.tokenizer)
            self.checkpointer.before_publish = partial(self.faults.hang_or_kill, "kill_save")

        self.logger = MetricsLogger(str(self.output_dir), self.rank == 0, job.metrics.wandb, config,
                                    self.step if self.deferred_resume is None else None)
        peak = peak_tflops(device, job.metrics.peak_tflops) if self.rank == 0 else None  # only rank 0 logs mfu
        self.throughput = Throughput(t.global_batch_size * t.seq_len, flops_per_token(job.model, t.seq_len), peak,
                                     dims.world_size, self.step)
        self.moe_stats = None
        self.spec = family(job.model.family)  # where the MoE statistics find the blocks, looked up once
        if job.model.n_experts:
            self.moe_stats = MoEStats(job.model.n_layers, job.model.n_experts, device, dims.ep)
        # On the CPU, live tensors are counted through the first steps: the model's, then all the steps make.
        self.tensor_memory = TensorMemory() if device.type == "cpu" else None
        if self.tensor_memory is not None:
            self.tensor_memory.add(self.model.parameters())
            self.tensor_memory.start()
        self.counted_until = self.step + COUNTED_STEPS
        self.guard = StepGuard(t, device)
        self.loss_holders = dims.world_size // dims.pp  # the ranks holding a loss: those of the last stage
        self.rollback = t.spike.threshold is not None and t.spike.action == "rollback"
        self.profiler = StepProfiler(job.metrics.profile_step, job.output_dir, self.rank, device)
        self.stop = StopRequest()

    def fit(self) -> None:
        if self.step >= self.training.steps:
            self.log(f"nothing to train: already at step {self.step} (training.steps={self.training.steps}); "
                     f"raise training.steps to train on")
        while self.step < self.training.steps:
            shares = self.start_step()
            if self.step >= self.training.steps:  # a peer this group recovered from had finished
                break
            self.step += 1
            step = self.step
            self.watchdog.step(step)
            self.profiler.begin(step)
            result = self.train_step(self.data.train(step - 1, shares))
            self.profiler.end(step)
            if result is None:  # a replica group failed during the step: trained again by the quorum left
                self.step -= 1
                continue
            loss, grad_norm, lr = result
            if self.rollback and self.guard.spiked() and self.roll_back():
                continue
            if step == self.counted_until:
                self._stop_counting_memory()
            validate = self.job.validation.every > 0 and step % self.job.validation.every == 0
            if step % self.job.metrics.log_every == 0 or step == self.training.steps or validate:
                self.log_step(loss, grad_norm, lr, validate)
            self.watchdog.phase("checkpoint")
            stop = self.stop.agreed()
            if self.checkpointer is not None and (self.replicas is None or self.replicas.saves_checkpoints()):
                self.checkpointer.after_step(step, self.training.steps, self.saved_state, stop)
            if stop:
                self._say_stopped()
                break
        self.finish()

    def start_step(self) -> list[int] | None:
        """Under fault tolerance, the quorum of replica groups for the next step (a group behind the
        others first receives their state: self.step moves); the global batch's replica shares this
        group trains in it. None without fault tolerance."""
        if self.replicas is None:
            return None
        self.watchdog.phase("quorum")
        shares = self.replicas.start_step()
        if self.replicas.recovered_at is not None:
            self.log(f"fault tolerance: recovered from a peer group at step {self.step} in "
                     f"{self.replicas.recovered_at:.2f}s (quorum, transfer and load of the weights, optimizer state "
                     f"and step; no checkpoint read)")
        elif self.deferred_resume is not None and self.step == 0:
            self.watchdog.slow("resume")
            groups = [self.output_dir.parent / f"replica_group_{g}" / "checkpoints"
                      for g in range(self.job.parallel.dp_replicate)]
            self.step = self._resume(self.deferred_resume, groups)
            self.scheduler = self._scheduler(self.step)
            self.throughput.reset(self.step)
            self.replicas.set_step(self.step)
        if self.deferred_resume is not None:
            self.logger.begin(self.step)
            self.deferred_resume = None
        return shares

    def train_step(self, rounds: list[list]) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """Forward, backward and the optimizer step over the step's microbatches (`rounds`: a list of
        them per replica share, each round accumulating into the gradients) -> (this rank's loss, the
        gradient norm, the lr); None when the replica groups did not all finish the step."""
        step = self.step
        self.watchdog.phase("forward")
        self.faults.before_forward(step)
        if self.float8_scales:
            precompute_scales(self.parts)
        loss = torch.zeros((), device=self.device)
        for microbatches in rounds:
            loss = loss + self.step_fn(microbatches)
        self.faults.after_backward(step, self.model.parameters())
        self.watchdog.phase("optimizer")
        sum_grads_over_tp(self.parts, self.dims)
        if self.replicas is not None:
            loss = self.replicas.reduce(self.model.parameters(), loss)
        grad_norm, loss_sum = clip_and_sum_loss_(self.model.parameters(), self.training.max_norm, loss)
        # The fused AdamW leaves weights, moments and its step count as they were when found_inf is 1.
        self.optimizer.found_inf = self.guard.check(step, loss_sum / self.loss_holders, grad_norm)
        if self.moe_stats is not None:
            microbatches = self.dims.grad_accum_steps * self.dims.pp_microbatches * len(rounds)
            update_expert_biases(self.parts, microbatches, skip=self.optimizer.found_inf)
            self.moe_stats.collect(self.parts, self.spec, microbatches)
        lr = self.scheduler.get_last_lr()[0]
        if self.replicas is not None and not self.replicas.commit():
            self.optimizer.zero_grad(set_to_none=True)
            return None
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm, lr

    def log_step(self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, validate: bool) -> None:
        """The step's record (collective: the loss and statistics are the whole job's)."""
        self.watchdog.phase("metrics")
        step, dims = self.step, self.dims
        record = {"step": step, "loss": job_loss(loss, dims), "grad_norm": grad_norm.item(), "lr": lr}
        throughput = self.throughput.report(step)
        guarded, said = self.guard.report()
        if said:
            self.log(f"guard: {said}")
        record |= {
            "tokens_per_s": throughput["tokens_per_s"],
            "mfu": throughput["mfu"],
            "mem_gib": peak_memory_gib(self.device),
            "mem_tensor_gib": peak_tensor_gib(self.device, self.tensor_memory),
            "param_mib": self.param_mib,
            "elapsed_s": throughput["elapsed_s"],
            "time": time.time(),
            "world_size": dims.world_size,
            "restart": restart_count(),
            **guarded,
        }
        if self.moe_stats is not None:
            record |= self.moe_stats.report(layer_copies=dims.world_size // dims.pp)
        if validate:
            self.watchdog.slow("validation")
            val_losses = [self.eval_fn(self.data.validation(i)) for i in range(self.job.validation.steps)]
            record["val_loss"] = job_loss(torch.stack(val_losses).mean(), dims)
        self.logger.log(record)
        if self.predicted is not None and record["mem_tensor_gib"] is not None:
            self.log(f"plan: measured peak {record['mem_tensor_gib']:.2f} GiB of tensors on rank 0 by step {step} "
                     f"(predicted {self.predicted / 2**30:.2f})")
            self.predicted = None  # said once
        self.throughput.reset(step)

    def roll_back(self) -> bool:
        """After a loss spike: back to the newest checkpoint, reading on past the spike's batch (collective).
        False when there is no checkpoint yet (the step stays skipped)."""
        self.watchdog.slow("rollback")
        back = roll_back(self.state, self.checkpoint_dir, self.checkpointer, self.log)
        if back is None:
            return False
        position = self.data.loader.position(self.step)
        self.data.loader.offset = position - back * self.training.global_batch_size
        self.scheduler = self._scheduler(back)
        self.log(f"spike: step {self.step} skipped; rolled back to step {back}, reading on from sequence {position}")
        self.step = back
        self.throughput.reset(back)
        return True

    def saved_state(self) -> dict:
        """What a checkpoint of this step holds, once the guards let it be saved (collective)."""
        self.watchdog.slow("checkpoint")
        self.guard.check_stop()  # a stop pending since the last log stops here, before anything is written
        check_finite(self.parts, self.optimizer, self.step)
        return self.state.for_save(self.step, self.data.loader.position(self.step))

    def _say_stopped(self) -> None:
        received = self.stop.received
        why = f"on a signal ({signal.Signals(received).name})" if received else "on a signal to another rank"
        if self.checkpointer is None:
            self.log(f"stopped at step {self.step} {why}; nothing was saved (checkpoint.enabled=false)")
        elif self.replicas is not None and not self.replicas.saves_checkpoints():
            self.log(f"stopped at step {self.step} {why}; this replica group saves no checkpoints (the quorum's "
                     f"first group does); started again, it recovers from a peer group")
        else:
            self.log(f"checkpoint: stopped at step {self.step} {why}: saved {self.checkpoint_dir}/step_{self.step}; "
                     f"run the same command to go on from it (checkpoint.resume=auto)")

    def finish(self) -> None:
        self.stop.close()
        self.watchdog.slow("finishing")
        if self.tensor_memory is not None:
            self.tensor_memory.stop()
        if self.training.compile and self.rank == 0:
            print(f"compile: {compiled_graphs()} graphs compiled", flush=True)
        self.data.close()
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self.replicas is not None:
            self.replicas.close()
        self.logger.close()

    def _describe_model(self) -> float:
        """Prints the layout and rank 0's share of the model; returns the MiB of parameters this rank holds."""
        held = [local_tensor(p) for p in self.model.parameters()]
        param_mib = sum(p.numel() * p.element_size() for p in held) / 2**20
        total = sum(p.numel() for p in self.model.parameters())
        self.log(f"{describe_layout(self.dims)} | grad_accum_steps={self.dims.grad_accum_steps} | "
                 f"{describe_share(self.dims, total, sum(p.numel() for p in held), param_mib)}")
        if self.predicted is not None:
            self.log(f"plan: predicted peak {self.predicted / 2**30:.2f} GiB of tensors on rank 0")
        return param_mib

    def _build_data(self, dataset, val_dataset) -> None:
        dims, ft = self.dims, self.job.fault_tolerance
        eos_id = dataset.eos_id if self.job.data.document_mask else None
        self.data = StepData(dataset, val_dataset, self.training, dims, dims.view("dp").get_local_rank(),
                             dims.view("cp").get_local_rank(), eos_id,
                             partial(self.faults.corrupt, vocab_size=dataset.vocab_size),
                             self.job.parallel.dp_replicate if ft.enabled else 1, ft.replica_group if ft.enabled else 0)

    def _resume(self, checkpoint: CheckpointConfig, folders: list[Path] | None = None) -> int:
        """Loads what checkpoint.* asks for (resume=auto: from `folders`, by default this job's
        checkpoint folder); returns the step to go on from (collective)."""
        t, dims = self.training, self.dims
        start_step, position, saved_world = restore(checkpoint, self.state, folders or self.checkpoint_dir,
                                                    self.job.model, self.log)
        if saved_world is not None and saved_world != dims.world_size:
            self.log(f"world changed from {saved_world} to {dims.world_size} ranks: {describe_layout(dims)}, "
                     f"grad_accum_steps={dims.grad_accum_steps}, "
                     f"the global batch of {t.global_batch_size} sequences kept")
        self.data.loader.offset = position - start_step * t.global_batch_size
        return start_step

    def _progress(self) -> dict:
        """What a replica group recovering from this one needs besides the weights and optimizer state."""
        return {"step": self.step, "data_offset": self.data.loader.offset}

    def _set_progress(self, progress: dict) -> None:
        self.step, self.data.loader.offset = progress["step"], progress["data_offset"]
        self.scheduler = self._scheduler(self.step)
        self.throughput.reset(self.step)

    def _scheduler(self, step: int):
        t = self.training
        return build_scheduler(self.optimizer, t.warmup_steps, t.steps, self.job.optim.min_lr_ratio, step)

    def _stop_counting_memory(self) -> None:
        if self.tensor_memory is None:
            return
        self.tensor_memory.stop()
        if self.training.compile:
            # Blocks run eagerly while tensors are counted: dynamo skips a frame under a dispatch mode
            # and remembers the skip. Forgotten here, the next step compiles them.
            torch.compiler.reset()
            self.watchdog.allow_slow_step()


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process. Dynamo's counters are private (torch 2.13);
    kept to this one function."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
