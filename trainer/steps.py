"""The functions that run one step on this rank's model parts: forward and backward over
the step's microbatches (plain or through a pipeline schedule), forward only for validation, and
the job's mean loss."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from trainer.config import JobConfig
from trainer.parallel.dims import ParallelDims
from trainer.parallel.fsdp import reshard
from trainer.parallel.pipeline import build_schedule, forward_only, stage_owners


def make_step_fns(job: JobConfig, dims: ParallelDims, device: torch.device, parts: list[nn.Module],
                  stages: list[int], mark=lambda phase: None):
    """The forward and backward of one optimizer step, and the forward only (validation): each maps
    this rank's microbatches to its mean loss (0 on pipeline ranks without the last stage). The
    model computes the loss itself, given the labels (its LMHead). `mark` is told each phase the
    step enters (the watchdog's)."""
    pp_group = dims.view("pp").get_group() if dims.pp_enabled else None
    owners = stage_owners(dims.pp, dims.pp_stages_per_rank, job.parallel.pp_schedule)
    pp_rank = dims.view("pp").get_local_rank()

    def eval_fn(microbatches: list) -> torch.Tensor:
        total = torch.zeros((), device=device)
        for inputs, labels, positions in microbatches:
            loss = forward_only(parts, stages, owners, pp_rank, pp_group, inputs.to(device), positions.to(device),
                                labels.to(device))
            if loss is not None:
                total += loss / len(microbatches)
        reshard(parts)
        return total

    if not dims.pp_enabled:
        return partial(train_step, parts[0], device=device, mark=mark), eval_fn
    # Accumulation steps are more microbatches of one schedule run: FSDP gathers and reduce-scatters
    # once a step, and the pipeline fills and drains once.
    n_microbatches = dims.grad_accum_steps * dims.pp_microbatches

    def loss_fn(loss, labels):
        # The last stage's output is its microbatch's loss: its share of the step's mean, so that the
        # gradients sum to the mean's.
        return loss.sum() / n_microbatches

    n_stages = dims.pp * dims.pp_stages_per_rank
    schedule = build_schedule(job.parallel.pp_schedule, parts, stages, n_stages, pp_group, device,
                              n_microbatches, loss_fn)
    step = partial(pipeline_step, schedule, device=device, first=0 in stages, last=n_stages - 1 in stages, mark=mark)
    return step, eval_fn


def train_step(model, microbatches: list, *, device: torch.device, mark) -> torch.Tensor:
    """Forward and backward over this rank's microbatches; returns their mean loss."""
    total = torch.zeros((), device=device)
    for i, (inputs, labels, positions) in enumerate(microbatches):
        # Gradients are reduced across data-parallel ranks once, after the last microbatch.
        model.set_requires_gradient_sync(i == len(microbatches) - 1)
        mark(f"forward (microbatch {i + 1} of {len(microbatches)})")
        loss = model(inputs.to(device), positions.to(device), labels.to(device)) / len(microbatches)
        mark(f"backward (microbatch {i + 1} of {len(microbatches)})")
        loss.backward()
        total += loss.detach()
    return total


def pipeline_step(schedule, microbatches: list, *, device: torch.device, first: bool, last: bool,
                  mark) -> torch.Tensor:
    """One schedule run over the step's microbatches (the accumulation steps' together, in order):
    the schedule cuts them into pipeline microbatches and (on the last stage) records each one's
    already scaled loss, so they sum to the mean."""
    inputs, labels, positions = (torch.cat(parts) for parts in zip(*microbatches))
    losses: list[torch.Tensor] = []
    args = (inputs.to(device),) if first else ()
    mark("forward and backward (pipeline schedule)")
    # Every stage's blocks need the positions, and the last stage's head the labels: the schedule
    # splits them like the inputs.
    labels = labels.to(device)
    schedule.step(*args, target=labels if last else None, losses=losses, positions=positions.to(device),
                  labels=labels)
    if not last:
        return torch.zeros((), device=device)
    return torch.stack([loss.detach() for loss in losses]).sum()


def job_loss(loss: torch.Tensor, dims: ParallelDims) -> float:
    """The whole job's mean loss from each rank's: averaged over the data-parallel (and context-
    parallel) ranks, summed over pipeline stages, of which only the last holds a loss."""
    value = loss.detach().clone()
    dp_cp = dims.view("dp_cp")
    dist.all_reduce(value, group=dp_cp.get_group())
    if dims.pp_enabled:
        dist.all_reduce(value, group=dims.view("pp").get_group())
    return value.item() / dp_cp.size()
