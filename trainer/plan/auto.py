"""parallel=auto: the layout chosen at launch, the fastest the plan predicts among those it predicts
to fit, for the world the job starts with (again after an elastic restart on another number of ranks).

Every rank makes the same choice without a word to the others: the search is deterministic given the
job, the world size and the device's figures, and those are the device table's for a GPU (its memory
as CUDA reports it) and, on the CPU, fixed figures with the machine's total memory shared by its
ranks (not what happens to be free: that differs from rank to rank). A key given on the command line
(`parallel.tp=2`, `training.activation_checkpoint=full`) is pinned: the search keeps it. A recipe's
own degrees are not: they are what `parallel=auto` replaces.
"""

from __future__ import annotations

import os

import torch

from trainer.config import JobConfig
from trainer.plan import GIB
from trainer.plan.devices import Device, local_device
from trainer.plan.search import apply_overrides, describe_layout, search

# What the search chooses; any of them given on the command line is kept as given.
CHOSEN = ("parallel.dp_replicate", "parallel.dp_shard", "parallel.cp", "parallel.tp", "parallel.pp", "parallel.ep",
          "parallel.pp_schedule", "parallel.pp_stages_per_rank", "parallel.pp_microbatches",
          "training.activation_checkpoint", "training.grad_accum_steps")
# A CPU rank's figures where none is measured: one thread a rank on the 2-core development box
# (2026-11-27: a 512-wide matmul, a gloo all-reduce between 2 processes).
CPU_TFLOPS = {"bf16": 0.2, "fp32": 0.1}
CPU_GBPS = 1.4


def pinned_keys(overrides: list[str]) -> dict[str, str]:
    """The chosen keys the command line sets (`key=value`, `+key=value`), as written."""
    pinned = {}
    for arg in overrides:
        key, eq, value = arg.lstrip("+").partition("=")
        if eq and key in CHOSEN:
            pinned[key] = value
    return pinned


def auto_device(device: torch.device, local_ranks: int) -> Device:
    """The device the search plans for, the same on every rank of a machine like this one."""
    if device.type == "cuda":
        return local_device(device, local_ranks)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return Device("cpu", total / local_ranks, CPU_TFLOPS["bf16"], CPU_TFLOPS["fp32"], CPU_GBPS, CPU_GBPS,
                  local_ranks, link_efficiency=1.0)


def choose_layout(job: JobConfig, world: int, device: Device, pinned: dict[str, str]) -> tuple[JobConfig, dict, str]:
    """The job in the layout the search ranks first (pinned keys kept), the overrides that give it,
    and what to say: the pick and the runners-up. The search chooses the accumulation: a recipe's
    training.micro_batch_size (which would derive it) is dropped."""
    cleared = {"training.micro_batch_size": None} if job.training.micro_batch_size is not None else {}
    job = apply_overrides(job, cleared)
    results = search(job, world, device, pinned, who="parallel=auto")
    plan, overrides = results[0]
    lines = [f"parallel=auto: {describe_layout(overrides)} on {world} x {device.name} "
             f"(predicted {plan.peak / GIB:.2f} GiB a rank, {plan.tokens_per_s:,.0f} tokens/s)"]
    lines += [f"  runner-up: {describe_layout(o)} ({p.peak / GIB:.2f} GiB, {p.tokens_per_s:,.0f} tokens/s)"
              for p, o in results[1:4]]
    return apply_overrides(job, overrides), {**overrides, **cleared}, "\n".join(lines)
