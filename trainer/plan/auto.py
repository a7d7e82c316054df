"""parallel=auto: the layout chosen at launch, the fastest the plan predicts among those it predicts
to fit, for the world the job starts with (again after an elastic restart on another number of
ranks).

Every rank makes the same choice without a word to the others: the search is deterministic given the
job, the world size and the device's figures, and those are read, never timed at launch:
plan.device's (a table entry or a profile `scripts/plan.py --calibrate` measured), else the table's
for a GPU and fixed figures for a CPU; the memory is the machine's (CUDA's total, or the CPU's total
shared by its ranks, not what happens to be free: that differs from rank to rank). A key given on
the command line (`parallel.tp=2`, `training.activation_checkpoint=full`) is pinned: the search
keeps it. A recipe's own degrees are not: they are what `parallel=auto` replaces.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from trainer.config.schema import JobConfig
from trainer.plan import GIB
from trainer.plan.devices import DEVICES, Device, cpu_device, local_device
from trainer.plan.profiles import get_device, profile_path
from trainer.plan.search import apply_overrides, describe_overrides, search

# What the search chooses (the memory options, the optimizer's state dtype and the offload, only
# where no layout fits without); any of them given on the command line is kept as given.
CHOSEN = ("parallel.dp_replicate", "parallel.dp_shard", "parallel.cp", "parallel.cp_method",
          "parallel.cp_ulysses", "parallel.tp", "parallel.pp", "parallel.ep",
          "parallel.pp_schedule", "parallel.pp_stages_per_rank", "parallel.pp_microbatches",
          "training.activation_checkpoint", "training.grad_accum_steps", "optim.state_dtype",
          "training.offload")
# A CPU rank's figures where no profile is named: one thread a rank with a core to itself on the
# 2-core development box (2026-11-27: a 512-wide matmul, a gloo all-reduce between 2 processes).
CPU_FIGURES = cpu_device(0.0, bf16_tflops=0.2, fp32_tflops=0.1, gbps=1.4, ranks=1)


def pinned_keys(overrides: list[str]) -> dict[str, str]:
    """The chosen keys the command line sets (`key=value`, `+key=value`), as written."""
    pinned = {}
    for arg in overrides:
        key, eq, value = arg.lstrip("+").partition("=")
        if eq and key in CHOSEN:
            pinned[key] = value
    return pinned


def auto_device(device: torch.device, local_ranks: int, named: str | None = None) -> Device:
    """The device the search plans for, the same on every rank of a machine like this one: `named`
    (plan.device: a table entry or a profile) where it is of the kind the job runs on, else the CUDA
    device's table entry or the CPU's fixed figures. Memory is the machine's: what CUDA reports, or
    the CPU's total shared by its ranks, whose compute is shared too where they outnumber the
    cores."""
    # a missing profile: a config error
    base = get_device(named) if named and named != "cpu" else None
    if base is not None and base.kind != device.type:  # a GPU recipe's figures, on a CPU run
        base = None
    if device.type == "cuda":
        local = local_device(device, local_ranks)
        return local if base is None else replace(base, memory_gib=local.memory_gib)
    base = base or CPU_FIGURES
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    share = core_share(local_ranks) / core_share(base.per_node)
    return replace(base, memory_gib=total / local_ranks, bf16_tflops=base.bf16_tflops * share,
                   fp32_tflops=base.fp32_tflops * share, per_node=local_ranks,
                   lent_idle=1 - core_share(local_ranks))


def core_share(ranks: int) -> float:
    """The share of a core each of `ranks` single-threaded ranks gets on this machine."""
    return min(1.0, len(os.sched_getaffinity(0)) / ranks)


def choose_layout(job: JobConfig, world: int, device: Device,
                  pinned: dict[str, str]) -> tuple[JobConfig, dict, str]:
    """The job in the layout the search ranks first (pinned keys kept), the overrides that give it,
    and what to say: the pick and the runners-up. The search chooses the accumulation: a recipe's
    training.micro_batch_size (which would derive it) is dropped."""
    job, cleared = for_search(job)
    results = search(job, world, device, pinned, who="parallel=auto")
    plan, overrides = results[0]
    lines = [f"parallel=auto: {describe_overrides(overrides)} on {world} x {device.name} "
             f"(predicted {plan.peak / GIB:.2f} GiB a rank, {plan.tokens_per_s:,.0f} tokens/s)"]
    lines += [f"  runner-up: {describe_overrides(o)} ({p.peak / GIB:.2f} GiB, "
              f"{p.tokens_per_s:,.0f} tokens/s; {deciding_term(plan, p)})" for p, o in results[1:4]]
    return apply_overrides(job, overrides), {**overrides, **cleared}, "\n".join(lines)


def for_search(job: JobConfig) -> tuple[JobConfig, dict]:
    """The job the search chooses for, and what was cleared for it: a training.micro_batch_size
    would derive the accumulation the search chooses."""
    cleared = ({"training.micro_batch_size": None} if job.training.micro_batch_size is not None
               else {})
    return apply_overrides(job, cleared), cleared


TERMS = {"compute_s": "compute", "fsdp_s": "FSDP", "tp_s": "tensor parallel",
         "cp_s": "context parallel", "ep_s": "expert all-to-all", "pp_s": "pipeline sends",
         "optimizer_s": "optimizer"}


def deciding_term(pick, other) -> str:
    """The step-time term the runner-up loses most on against the pick (its pipeline bubble counted
    as idle compute): what the plan's ranking rests on."""
    def terms(plan) -> dict:
        t = plan.time
        found = {name: getattr(t, key) for key, name in TERMS.items()}
        found["pipeline bubble"] = t.step_s * t.bubble
        return found

    mine, theirs = terms(pick), terms(other)
    name = max(theirs, key=lambda k: theirs[k] - mine[k])
    return f"{name} {theirs[name] - mine[name]:+.3f} s a step"


def calibration_note(named: str | None, device_kind: str) -> str | None:
    """What to say when the figures the search ranks with (auto_device's) are not a measurement."""
    profile = named and named not in ("cpu", *DEVICES) and profile_path(named).is_file()
    if profile and get_device(named).kind == device_kind:
        return None
    table = named in DEVICES and DEVICES[named].kind == device_kind
    figures = f"the {named} table's figures" if table else f"fixed {device_kind.upper()} figures"
    return (f"plan: parallel=auto predicts from {figures}, not measured here (the figures can be "
            "several times off on another machine; the ranking holds better); to rank with this "
            "machine's: python scripts/plan.py --calibrate --name NAME --world N <this job's "
            "overrides>, then launch with plan.device=NAME")
