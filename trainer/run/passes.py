"""The functions that run one step on this rank's model parts: forward and backward over
the step's microbatches (plain or through a pipeline schedule), forward only for validation, and
the job's mean loss.

A step's loss is the sum of its token losses over the supervised tokens (labels not IGNORE_INDEX) of
the global batch, divided by their number, in every layout: each rank's token losses are summed and
scaled by supervised_scale, so that the data-parallel mean of the ranks' losses and gradients (and
under fault tolerance the mean over the replica shares) is that mean. With every label supervised it
is the mean of the microbatches' means, as before."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from trainer.config.schema import JobConfig
from trainer.models.head import IGNORE_INDEX, sum_token_losses
from trainer.parallel.dims import ParallelDims
from trainer.parallel.fsdp import reshard
from trainer.parallel.pipeline import build_schedule, forward_only, stage_owners


@dataclass
class Passes:
    """What this rank runs of a step. `train(microbatches, scale)`: forward and backward over its
    microbatches of one round, scaled by a supervised_scale -> its share of the loss (0 on pipeline
    ranks without the last stage); `evaluate`: the same, forward only. `microbatches`: the forward
    passes of one round (a pipeline's microbatches are smaller than a rank's batch); `loss_ranks`:
    the ranks that hold a loss (the last pipeline stage's)."""

    train: Callable[[list, torch.Tensor], torch.Tensor]
    evaluate: Callable[[list, torch.Tensor], torch.Tensor]
    microbatches: int
    loss_ranks: int


def make_passes(job: JobConfig, dims: ParallelDims, device: torch.device,
                model_parts: list[nn.Module], stages: list[int], mark=lambda phase: None) -> Passes:
    """This rank's passes, plain or through the pipeline schedule. The model computes the sum of its
    token losses itself, given the labels (its LMHead). `mark` is told each phase the step enters
    (the watchdog's)."""
    for part in model_parts:
        sum_token_losses(part)
    pp_group = dims.view("pp").get_group() if dims.pp_enabled else None
    owners = stage_owners(dims.pp, dims.pp_stages_per_rank, job.parallel.pp_schedule)
    pp_rank = dims.view("pp").get_local_rank()

    def eval_fn(microbatches: list, scale: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), device=device)
        for inputs, labels, positions in microbatches:
            loss = forward_only(model_parts, stages, owners, pp_rank, pp_group, inputs.to(device),
                                positions.to(device), labels.to(device))
            if loss is not None:
                total += loss * scale
        reshard(model_parts)
        return total

    # Accumulation steps are more microbatches of one schedule run: FSDP gathers and reduce-scatters
    # once a step, and the pipeline fills and drains once.
    n_microbatches = dims.grad_accum_steps * dims.pp_microbatches
    if not dims.pp_enabled:
        return Passes(partial(forward_backward, model_parts[0], device=device, mark=mark), eval_fn,
                      n_microbatches, dims.world_size)
    this_step = {}  # the step's supervised_scale, which the schedule's loss function applies

    def loss_fn(loss, labels):
        # The last stage's output is its microbatch's summed token losses: scaled, its share of the
        # step's loss, so that the gradients sum to the loss's.
        return loss.sum() * this_step["scale"]

    n_stages = dims.pp * dims.pp_stages_per_rank
    schedule = build_schedule(job.parallel.pp_schedule, model_parts, stages, n_stages, pp_group,
                              device, n_microbatches, loss_fn)

    def step(microbatches: list, scale: torch.Tensor) -> torch.Tensor:
        this_step["scale"] = scale
        return pipeline_step(schedule, microbatches, device=device, first=0 in stages, last=n_stages
                             - 1 in stages, mark=mark)

    return Passes(step, eval_fn, n_microbatches, dims.world_size // dims.pp)


def supervised_count(microbatches: list, dims: ParallelDims, device: torch.device) -> torch.Tensor:
    """The supervised tokens (labels not IGNORE_INDEX) of these microbatches over the data- and
    context-parallel ranks: counted from the labels on the host, summed by one all-reduce of a
    scalar on the device (no host sync)."""
    local = sum(int((labels != IGNORE_INDEX).sum()) for _, labels, _ in microbatches)
    count = torch.tensor(float(local), dtype=torch.float64, device=device)
    if dims.view("dp_cp").size() > 1:
        dist.all_reduce(count, group=dims.view("dp_cp").get_group())
    return count


def supervised_scale(count: torch.Tensor, ranks: int) -> torch.Tensor:
    """The factor a rank's token losses take so that, averaged over `ranks` (the data-parallel
    ranks, and under fault tolerance the replica shares, over which losses and gradients are
    averaged), they make the mean over `count` supervised tokens."""
    return (ranks / count.clamp(min=1)).float()


def forward_backward(model, microbatches: list, scale: torch.Tensor, *, device: torch.device,
                     mark) -> torch.Tensor:
    """Forward and backward over this rank's microbatches; returns their scaled loss."""
    total = torch.zeros((), device=device)
    for i, (inputs, labels, positions) in enumerate(microbatches):
        # Gradients are reduced across data-parallel ranks once, after the last microbatch.
        model.set_requires_gradient_sync(i == len(microbatches) - 1)
        mark(f"forward (microbatch {i + 1} of {len(microbatches)})")
        loss = model(inputs.to(device), positions.to(device), labels.to(device)) * scale
        mark(f"backward (microbatch {i + 1} of {len(microbatches)})")
        loss.backward()
        total += loss.detach()
    return total


def pipeline_step(schedule, microbatches: list, *, device: torch.device, first: bool, last: bool,
                  mark) -> torch.Tensor:
    """One schedule run over the step's microbatches (the accumulation steps' together, in order):
    the schedule cuts them into pipeline microbatches and (on the last stage) records each one's
    already scaled loss, so they sum to the step's."""
    inputs, labels, positions = (torch.cat(pieces) for pieces in zip(*microbatches))
    losses: list[torch.Tensor] = []
    args = (inputs.to(device),) if first else ()
    mark("forward and backward (pipeline schedule)")
    # Every stage's blocks need the positions, and the last stage's head the labels: the schedule
    # splits them like the inputs.
    labels = labels.to(device)
    schedule.step(*args, target=labels if last else None, losses=losses,
                  positions=positions.to(device), labels=labels)
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
