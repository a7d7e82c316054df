"""Calibration: the plan's matmul efficiencies fitted to training steps measured on this machine.

Each share of the device's Efficiency is set from one layout whose step it paces, the search's best
of its kind, run for a few steps on every rank: every rank a pipeline stage (`alone`), every rank a
replica (`replicated`), FSDP over every rank (`with_collectives`), tensor parallel over every rank
(`tp`, on top of the latter). A share is the value at which the plan predicts the measured tokens/s;
the plan's tokens/s rises with it, so a bisection finds it. The peaks and link rates under the
shares are timed before (devices.measure_cpu, devices.measure_cuda).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from trainer.checks.job import check_job
from trainer.config.schema import JobConfig
from trainer.plan import make_plan
from trainer.plan.devices import Device
from trainer.plan.search import apply_overrides, describe_overrides, search

# The layout that measures each share, among the search's: a test of its overrides on `world` ranks.
KINDS = {
    "alone": lambda o, world: o["parallel.pp"] == world,
    "replicated": lambda o, world: o["parallel.dp_replicate"] == world,
    "with_collectives": lambda o, world: o["parallel.dp_shard"] == world,
    "tp": lambda o, world: o["parallel.tp"] == world,
}
# The bisection's bounds: a share outside them means the plan misses a cost the run has.
LOWEST, HIGHEST = 0.005, 2.0
WARMUP_STEPS = 2  # not timed: allocation, first dispatch


def calibration_layouts(job: JobConfig, world: int, device: Device) -> dict[str, dict]:
    """For each share, the search's best layout of the kind that measures it (fewer where `world` or
    the model allows none: one rank measures `alone` only)."""
    results = [overrides for _, overrides in search(job, world, device, who="--calibrate")]
    layouts = {}
    for share, test in KINDS.items():
        found = next((o for o in results if test(o, world)), None)
        if found is not None and (world > 1 or share == "alone"):
            layouts[share] = found
    return layouts


def fit_share(job: JobConfig, world: int, device: Device, share: str, overrides: dict,
              measured: float) -> Device:
    """The device with its `share` set so the plan of `job` in `overrides` predicts `measured`
    tokens/s."""
    candidate = apply_overrides(job, overrides)
    dims = check_job(candidate, world)
    low, high = LOWEST, HIGHEST
    for _ in range(30):
        middle = math.sqrt(low * high)
        trial = replace(device, efficiency=replace(device.efficiency, **{share: middle}))
        if make_plan(candidate, dims, trial).tokens_per_s < measured:
            low = middle
        else:
            high = middle
    return replace(device,
                   efficiency=replace(device.efficiency,
                                      **{share: round(math.sqrt(low * high), 4)}))


def calibrate(job: JobConfig, world: int, device: Device,
              measure: Callable[[dict], float]) -> tuple[Device, list]:
    """`device` with its efficiencies fitted to what `measure(overrides)` (tokens/s of `job` in that
    layout on `world` ranks) reports, and the runs: share, layout, measured and predicted
    tokens/s."""
    runs = []
    for share, overrides in calibration_layouts(job, world, device).items():
        measured = measure(overrides)
        device = fit_share(job, world, device, share, overrides, measured)
        runs.append({"share": share, "layout": describe_overrides(overrides),
                     "overrides": overrides, "measured_tokens_per_s": round(measured, 1)})
    for run in runs:
        candidate = apply_overrides(job, run["overrides"])
        plan = make_plan(candidate, check_job(candidate, world), device)
        run["predicted_tokens_per_s"] = round(plan.tokens_per_s, 1)
    return device, runs


DEGREES = ("parallel.dp_replicate", "parallel.dp_shard", "parallel.cp", "parallel.cp_method",
           "parallel.cp_ulysses", "parallel.tp", "parallel.pp", "parallel.ep",
           "parallel.pp_schedule")


def distinct_layouts(results: list[tuple]) -> list[tuple]:
    """The search's best point (plan, overrides) for each set of degrees and pipeline schedule, best
    first."""
    seen, kept = set(), []
    for plan, overrides in results:
        # the schedule counts under pp only
        keys = DEGREES if overrides["parallel.pp"] > 1 else DEGREES[:-1]
        degrees = tuple(overrides[key] for key in keys)
        if degrees not in seen:
            seen.add(degrees)
            kept.append((plan, overrides))
    return kept


def ranking(job: JobConfig, world: int, device: Device, measure: Callable[[dict], float],
            measured: dict[str, float] | None = None) -> list[dict]:
    """Each distinct layout the search considers, best predicted first: predicted and measured
    tokens/s (`measured`: those already known, by describe_overrides)."""
    measured = dict(measured or {})
    rows = []
    for plan, overrides in distinct_layouts(search(job, world, device, who="--calibrate")):
        layout = describe_overrides(overrides)
        if layout not in measured:
            measured[layout] = measure(overrides)
        rows.append({"layout": layout, "overrides": overrides,
                     "predicted_tokens_per_s": round(plan.tokens_per_s, 1),
                     "measured_tokens_per_s": round(measured[layout], 1)})
    return rows


def steady_tokens_per_s(records: list[dict]) -> float:
    """The median tokens/s of a run's logged steps after its warm-up."""
    return statistics.median(r["tokens_per_s"] for r in records if r["step"] > WARMUP_STEPS)


def torchrun_measure(overrides: list[str], world: int, steps: int) -> Callable[[dict], float]:
    """A `measure` for calibrate(): train.py under torchrun on this machine, `overrides` (the job's,
    as on the command line) and the layout's, `steps` steps, its metrics.jsonl read back."""
    train = Path(__file__).resolve().parents[2] / "train.py"

    def measure(layout: dict) -> float:
        with tempfile.TemporaryDirectory() as out:
            run = [*overrides,
                   *(f"{key}={'null' if v is None else v}" for key, v in layout.items()),
                   f"training.steps={steps}", "metrics.log_every=1", "checkpoint.enabled=false",
                   "validation.every=0", f"output_dir={out}"]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={world}", str(train), *run]
            print(f"calibration: {describe_overrides(layout)} on {world} ranks", flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=1800,
                           env={**os.environ,
                                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
            records = [json.loads(line)
                       for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
            return steady_tokens_per_s(records)

    return measure
