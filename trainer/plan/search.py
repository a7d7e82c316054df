"""The best layouts for a model on N devices: every combination the trainer accepts, planned,
kept if it fits, ranked by predicted tokens/s.

The model, sequence length and global batch stay the job's. Varied: tp (within a node), cp, pp
with 1F1B or interleaved 1F1B, HSDP replicas, ep for a mixture of experts, activation
checkpointing, gradient accumulation and pipeline microbatches. For each layout and checkpointing
mode the fewest accumulation steps that fit are taken (more only re-gather parameters).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from trainer.checks.job import check_job
from trainer.checks.ranges import check_ranges
from trainer.config.schema import JobConfig
from trainer.errors import ConfigError
from trainer.models import build_model, count_params
from trainer.models.moe import moe_layers
from trainer.models.moe_config import n_experts
from trainer.optim.spec import state_bytes_bound
from trainer.parallel.activation_checkpoint import MODES as AC_MODES
from trainer.plan import GIB, MARGIN, Plan, make_plan, offload_on
from trainer.plan.devices import Device
from trainer.plan.options import options_for


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def candidates(job: JobConfig, gpus: int, device: Device):
    """The overrides of every layout to try (under training.offload=activations, without
    checkpointing: the two do not compose)."""
    m = job.model
    ac_modes = ("none",) if job.training.offload == "activations" else AC_MODES
    for tp in _powers_of_two(min(device.per_node, gpus)):
        # cp up to 32: long contexts, and batches too small to split the ranks otherwise (an MoE
        # model's experts are sharded over dp_shard x cp only).
        for cp in _powers_of_two(min(32, gpus // tp)):
            for pp in _powers_of_two(min(16, gpus // (tp * cp), m.n_layers)):
                dp = gpus // (tp * cp * pp)
                if dp * tp * cp * pp != gpus:
                    continue
                for dp_replicate in _powers_of_two(dp):
                    schedules = [("1f1b", 1), ("interleaved_1f1b", 2)] if pp > 1 else [("1f1b", 1)]
                    for schedule, per_rank in schedules:
                        for ep in _powers_of_two(n_experts(m)) if n_experts(m) else [1]:
                            for method, ulysses in cp_methods(cp, device.per_node // tp):
                                for ac in ac_modes:
                                    yield {"parallel.tp": tp, "parallel.cp": cp,
                                           "parallel.cp_method": method,
                                           "parallel.cp_ulysses": ulysses,
                                           "parallel.pp": pp,
                                           "parallel.dp_replicate": dp_replicate,
                                           "parallel.dp_shard": dp // dp_replicate,
                                           "parallel.ep": ep, "parallel.pp_schedule": schedule,
                                           "parallel.pp_stages_per_rank": per_rank if pp > 1
                                           else None, "training.activation_checkpoint": ac}


def cp_methods(cp: int, within: int) -> list[tuple[str, int]]:
    """(parallel.cp_method, parallel.cp_ulysses) of context parallel over `cp` ranks: the ring, and
    Ulysses over up to `within` ranks (a node's, beside tp's: its all-to-alls want the fast links),
    alone or as the inner part of a hybrid. (All-gather holds every key and value: never ahead.)"""
    if cp == 1:
        return [("ring", 1)]
    hybrids = [("ring", u) for u in _powers_of_two(min(cp // 2, within)) if u > 1]
    return [("ring", 1), *hybrids, *([("ulysses", 1)] if cp <= within else [])]


def apply_overrides(job: JobConfig, overrides: dict) -> JobConfig:
    """`job` with `overrides` (section.key -> value): new copies of the sections they touch, the
    others shared (a deep copy of the whole job a candidate was a third of the search's time)."""
    sections: dict[str, dict] = {}
    for key, value in overrides.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(job, **{section: dataclasses.replace(getattr(job, section), **fields)
                                       for section, fields in sections.items()})


def parameter_counts(job: JobConfig) -> tuple[int, int]:
    """(the model's parameters, those of its experts), counted on the meta device."""
    model = build_model(job.model, device="meta")
    experts = sum(p.numel() for layer in moe_layers(model) for p in layer.experts.parameters())
    return count_params(model), experts


def states_bound(counts: tuple[int, int], layout: dict, per_param: float = 16) -> float:
    """A lower bound of a rank's peak under `layout`: its share of the fp32 parameters, gradients
    and optimizer state (`per_param` bytes: 16 with AdamW's two moments, at least 12 under Muon's
    one), the experts sharded over pp x dp_shard x cp, the rest also over tp."""
    total, experts = counts
    shards = layout["parallel.pp"] * layout["parallel.dp_shard"] * layout["parallel.cp"]
    return per_param * (experts / shards + (total - experts) / (shards * layout["parallel.tp"]))


def search(job: JobConfig, gpus: int, device: Device, pinned: dict[str, str] | None = None,
           who: str = "--search") -> list[tuple[Plan, dict]]:
    """Plans that fit, best first, each with the overrides that give it. A layout whose parameter
    states alone exceed the device's memory is not planned; one that sets a `pinned` key (its value
    as written on a command line) otherwise is not tried. `who` names the asker in a config
    error."""
    # -1: the rest, not a pin
    pinned = {key: value for key, value in (pinned or {}).items() if value != "-1"}
    # what the candidates change (degrees, checkpointing, accumulation) is in range
    check_ranges(job)
    fitting, rejected, best_misfit = _plan_candidates(job, gpus, device, pinned)
    for option, opted in _options(job, pinned) if not fitting else []:
        # after the layouts: the first memory option with which some layout fits
        fitting = [(plan, {**overrides, **option}) for plan, overrides in
                   _plan_candidates(opted, gpus, device, pinned)[0]]
        if fitting:
            break
    if not fitting:
        reasons = ", ".join(f"{rule} ({n})" for rule, n in rejected.most_common(5))
        closest = ""
        if best_misfit is not None:
            closest = (f"; the smallest peak is {best_misfit[0] / GIB:.1f} GiB of "
                       f"{device.memory_gib * 0.9:.1f} usable "
                       f"({describe_overrides(best_misfit[1])})")
        kept = f" with {' '.join(f'{k}={v}' for k, v in pinned.items())} kept" if pinned else ""
        hint = _what_fits(job, gpus, device, pinned)
        raise ConfigError(f"{who}: no layout of {job.model.name} on {gpus} x {device.name}{kept} "
                          f"fits{closest}; rules that ruled out candidates: "
                          f"{reasons or 'none'}{hint}")
    # At equal predictions the fewer pipeline microbatches first: each costs launches and sends the
    # plan does not count (4 CPU ranks, pp=4: 16 microbatches
    # ran 8% below the default's, predicted equal).
    fitting.sort(key=lambda item: (-item[0].tokens_per_s,
                                   int(item[1].get("parallel.pp_microbatches") or 0), item[0].peak))
    return fitting


def _what_fits(job: JobConfig, gpus: int, device: Device, pinned: dict[str, str]) -> str:
    """The smallest change that fits, where every microbatch size and checkpointing mode did not:
    the pinned keys let go, else more devices (up to 16x)."""
    if pinned:
        fitting = _plan_candidates(job, gpus, device, {})[0]
        if fitting:
            return f"; without the pinned keys {describe_overrides(_fastest(fitting))} fits"
    for more in (2 * gpus, 4 * gpus, 8 * gpus, 16 * gpus):
        fitting = _plan_candidates(job, more, device, pinned)[0]
        if fitting:
            return f"; it fits on {more} devices ({describe_overrides(_fastest(fitting))})"
    return f"; not even on {16 * gpus} devices"


def fitting_option(job: JobConfig, dims, device: Device) -> str | None:
    """`it fits with KEY=VALUE (peak N GiB)` for the first memory option that makes `job`, laid
    out as `dims`, fit (and `, N% lower tokens/s` where it costs speed); None where none does."""
    for option, opted in _options(job):
        plan = make_plan(opted, dims, device)
        if plan.fits:
            said = " ".join(f"{key}={value}" for key, value in option.items())
            slower = 1 - plan.tokens_per_s / make_plan(job, dims, device).tokens_per_s
            cost = f", {100 * slower:.0f}% lower tokens/s" if slower >= 0.005 else ""
            return f"it fits with {said} (peak {plan.peak / GIB:.1f} GiB{cost})"
    return None


def _options(job: JobConfig, pinned: dict[str, str] | None = None) -> list[tuple[dict, JobConfig]]:
    """Each memory option `job` can take, with the job under it: one its config refuses (float8
    state for Muon) is left out."""
    taken = []
    for option in options_for(job, pinned):
        opted = apply_overrides(job, option)
        try:
            check_ranges(opted)
        except ConfigError:
            continue
        taken.append((option, opted))
    return taken


def _fastest(fitting: list[tuple[Plan, dict]]) -> dict:
    return max(fitting, key=lambda item: item[0].tokens_per_s)[1]


def _plan_candidates(job: JobConfig, gpus: int, device: Device, pinned: dict[str, str]):
    """The plans that fit (with their overrides), the count of candidates each rule ruled out, and
    the smallest peak of those that did not fit (with its overrides)."""
    fitting: list[tuple[Plan, dict]] = []
    rejected: Counter = Counter()
    best_misfit: tuple[float, dict] | None = None
    counts, usable = parameter_counts(job), device.memory_gib * GIB * (1 - MARGIN)
    # (LoRA: the frozen base alone, in the compute dtype, at least 2 bytes; the optimizer
    # offloaded, no bound: the device holds a few units gathered)
    per_param = (0.0 if offload_on(job, device) == "optimizer"
                 else 2.0 if job.peft.method is not None else state_bytes_bound(job.optim))
    for layout in candidates(job, gpus, device):
        if states_bound(counts, layout, per_param) > usable:
            rejected["parameter states over the memory"] += 1
            continue
        for accum in _powers_of_two(job.training.global_batch_size):
            found = False
            for mb_factor in (1, 2, 4) if layout["parallel.pp"] > 1 else (None,):
                overrides = {**layout, "training.grad_accum_steps": accum}
                if mb_factor is not None:
                    n_stages = layout["parallel.pp"] * layout["parallel.pp_stages_per_rank"]
                    overrides["parallel.pp_microbatches"] = n_stages * mb_factor
                if not keeps(overrides, pinned):
                    rejected["a pinned key"] += 1
                    continue
                candidate = apply_overrides(job, overrides)
                try:
                    dims = check_job(candidate, gpus, ranges=False)
                except ConfigError as e:
                    rejected[_rule(str(e))] += 1
                    continue
                plan = make_plan(candidate, dims, device)
                if plan.fits:
                    fitting.append((plan, overrides))
                    found = True
                elif best_misfit is None or plan.peak < best_misfit[0]:
                    best_misfit = (plan.peak, overrides)
            if found:
                break  # more accumulation would only re-gather the parameters more often
    return fitting, rejected, best_misfit


def keeps(overrides: dict, pinned: dict[str, str]) -> bool:
    """Whether `overrides` agrees with every pinned key it sets."""
    return all(key not in overrides or _as_written(overrides[key]) == value
               for key, value in pinned.items())


def _as_written(value) -> str:
    return "null" if value is None else str(value)


def _rule(message: str) -> str:
    """The key a config error names, standing for its rule."""
    return message.split("=")[0].split(":")[0]


def describe_overrides(overrides: dict) -> str:
    short = {"parallel.dp_replicate": "rep", "parallel.dp_shard": "shard", "parallel.tp": "tp",
             "parallel.cp": "cp", "parallel.pp": "pp", "parallel.ep": "ep",
             "training.activation_checkpoint": "ac", "training.grad_accum_steps": "accum",
             "parallel.pp_microbatches": "mb", "parallel.pp_schedule": "sched",
             "optim.state_dtype": "state", "training.offload": "offload"}
    parts = []
    for key, value in overrides.items():
        if key == "parallel.pp_stages_per_rank" or (key == "parallel.ep" and value == 1):
            continue
        if key in ("parallel.cp_method", "parallel.cp_ulysses") or (
                key == "parallel.pp_schedule" and overrides["parallel.pp"] == 1):
            continue
        split = ""  # how cp spans its ranks, said beside it
        if key == "parallel.cp" and value > 1 and "parallel.cp_method" in overrides:
            method, ulysses = overrides["parallel.cp_method"], overrides["parallel.cp_ulysses"]
            split = f"({cp_split(method, ulysses)})"
        parts.append(f"{short[key]}={value}{split}")
    return " ".join(parts)


def cp_split(method: str, ulysses: int) -> str:
    """How context parallel spans its ranks, in a word or two: ring, ulysses, ring x ulysses 4."""
    return method if ulysses == 1 else f"{method} x ulysses {ulysses}"


def format_search(results: list[tuple[Plan, dict]], job: JobConfig, gpus: int,
                  device: Device) -> str:
    t = job.training
    lines = [f"{job.model.name} on {gpus} x {device.name}, batch {t.global_batch_size} x "
             f"{t.seq_len}: {len(results)} best layouts that fit, by predicted tokens/s", ""]
    for i, (plan, overrides) in enumerate(results, 1):
        lines.append(f"{i:>2}. {plan.tokens_per_s:>12,.0f} tok/s  MFU {100 * plan.mfu:4.1f}%  "
                     f"peak {plan.peak / GIB:5.1f} GiB  {describe_overrides(overrides)}")
    lines += ["", "overrides of the first: " + " ".join(f"{k}={v}" for k, v in results[0][1].items()
                                                        if v is not None)]
    return "\n".join(lines)
