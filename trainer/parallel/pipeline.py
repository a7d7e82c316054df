"""Pipeline parallel: the model cut into stages by layer, run by a torch.distributed.pipelining
schedule.

Each stage is the whole model's module tree, built on meta, with the modules of other stages
removed, so parameter names (and the layout-independent initialisation) are those of the whole
model. A rank holds one stage (gpipe, 1f1b) or several (the interleaved and V-shaped schedules).

Validation runs the stages one after another (`forward_only`) rather than through a schedule:
torch 2.13's V-shaped schedules cannot run without backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.microbatch import sum_reducer

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
SINGLE_STAGE = ("gpipe", "1f1b")
# Schedules that split backward into input and (deferred) weight gradients.
ZERO_BUBBLE = ("interleaved_zb", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")


def stages_per_rank(schedule: str, configured: int | None) -> int:
    """One stage per rank for gpipe and 1f1b, two for the others unless configured."""
    if configured is not None:
        return configured
    return 1 if schedule in SINGLE_STAGE else 2


def min_microbatches(schedule: str, pp: int, n_stages: int) -> int:
    """The fewest microbatches torch 2.13's schedule accepts (found by running each)."""
    if schedule == "gpipe":
        return 1
    if schedule in ("1f1b", "dualpipev"):
        return n_stages
    return pp


def stage_ids(pp_rank: int, pp: int, per_rank: int, schedule: str) -> list[int]:
    """The stages a rank runs: looped (r, r+pp, ...) or, for V-shaped schedules, (r, 2*pp-1-r).
    Without pipeline parallel (one stage per rank) the schedule is moot: the one stage."""
    if schedule in V_SHAPED and per_rank == 2:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(per_rank)]


def split_modules(embedding: str, layers: list[str], head: list[str], n_stages: int,
                  embedding_cost: float, output_cost: float) -> list[list[str]]:
    """Module names per stage, contiguous, balancing the cost of layers plus embedding and head.

    The embedding and the output head (the last module of `head`; the others, a final norm, count
    nothing) count as `embedding_cost` and `output_cost` layers. Each stage takes at least one
    layer, then more while it stays within its even share of what is left, leaving a layer for every
    later stage.
    """
    units = [(embedding, embedding_cost, False)] + [(name, 1.0, True) for name in layers]
    units += [(name, 0.0, False) for name in head[:-1]] + [(head[-1], output_cost, False)]
    stages: list[list[str]] = []
    remaining = sum(cost for _, cost, _ in units)
    position = 0
    for stage in range(n_stages):
        share = remaining / (n_stages - stage)
        taken, cost, has_layer = [], 0.0, False
        layers_left = sum(is_layer for _, _, is_layer in units[position:])
        while position < len(units):
            name, unit_cost, is_layer = units[position]
            if has_layer and is_layer and (cost + unit_cost > share + 1e-9
                                           or layers_left <= n_stages - stage - 1):
                break
            taken.append(name)
            cost += unit_cost
            has_layer |= is_layer
            layers_left -= is_layer
            position += 1
        stages.append(taken)
        remaining -= cost
    stages[-1] += [name for name, _, _ in units[position:]]
    return stages


def keep_modules(model: nn.Module, units: list[str], kept: list[str]) -> nn.Module:
    """Removes from `model` (in place) every unit of `units` (module paths) not in `kept`: a member
    of a ModuleDict (a layer) is deleted, any other module set to None."""
    for unit in units:
        if unit in kept:
            continue
        parent_path, _, name = unit.rpartition(".")
        parent = model.get_submodule(parent_path)
        if isinstance(parent, nn.ModuleDict):
            del parent[name]
        else:
            setattr(parent, name, None)
    return model


def build_schedule(schedule: str, stages: list[nn.Module], ids: list[int], n_stages: int, pp_group,
                   device, n_microbatches: int, loss_fn):
    pipeline_stages = [
        PipelineStage(module, stage_index, n_stages, device, group=pp_group)
        for module, stage_index in zip(stages, ids)
    ]
    # No scaling by the schedule: it divides all of .grad at the end of each step(), which also
    # shrinks the gradients of earlier accumulation steps again; `loss_fn` carries the whole scale.
    # The last stage outputs its microbatch's loss (a scalar): merged by summing, not concatenating.
    stage_arg = pipeline_stages[0] if schedule in SINGLE_STAGE else pipeline_stages
    return SCHEDULES[schedule](stage_arg, n_microbatches=n_microbatches, loss_fn=loss_fn,
                               scale_grads=False, output_merge_spec=sum_reducer)


def stage_owners(pp: int, per_rank: int, schedule: str) -> list[int]:
    """The pipeline rank that runs each stage, by stage index."""
    owners = {stage: rank for rank in range(pp)
              for stage in stage_ids(rank, pp, per_rank, schedule)}
    return [owners[stage] for stage in range(len(owners))]


_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@torch.no_grad()
def forward_only(parts: list[nn.Module], stages: list[int], owners: list[int], pp_rank: int, group,
                 inputs: torch.Tensor, positions: torch.Tensor,
                 labels: torch.Tensor) -> torch.Tensor | None:
    """The model's loss for `inputs` and `labels`, stage after stage, each rank running its own and
    passing the hidden states [batch, seq, dim] on; the loss on the rank of the last stage, None
    elsewhere."""
    x = inputs
    for stage, owner in enumerate(owners):
        previous = owners[stage - 1] if stage else owner
        if owner == pp_rank:
            if previous != pp_rank:
                # dtype, then the shape
                header = torch.empty(4, dtype=torch.long, device=inputs.device)
                dist.recv(header, group=group, group_src=previous)
                x = torch.empty(header[1:].tolist(), dtype=_WIRE_DTYPES[header[0]],
                                device=inputs.device)
                dist.recv(x, group=group, group_src=previous)
            x = parts[stages.index(stage)](x, positions, labels)
        elif previous == pp_rank:
            header = torch.tensor([_WIRE_DTYPES.index(x.dtype), *x.shape], device=x.device)
            dist.send(header, group=group, group_dst=owner)
            dist.send(x.contiguous(), group=group, group_dst=owner)
    return x if owners[-1] == pp_rank else None
