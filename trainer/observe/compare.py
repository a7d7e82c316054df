"""Whether two runs follow the same curve: their metrics.jsonl step by step, against the tolerance
their precision allows. Every layout reproduces the one-process run within these
(tests/test_parity.py holds them over its first steps), so a run moved to another layout, started
from a converted checkpoint or trained by a new version of this trainer can be checked the same way.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

# Relative tolerances (loss, gradient norm): fp32, fp32 with a mixture of experts (the router's
# top-k turns on a rounding difference), bf16 parameters and compute.
TOLERANCES = {"fp32": (1e-4, 2e-3), "fp32_moe": (1e-3, 1e-2), "bf16": (5e-3, 0.15)}


@dataclass
class Run:
    path: Path
    steps: dict[int, dict]  # metrics.jsonl's rows by step
    config: dict  # config.yaml (empty if the folder has none)

    @property
    def precision(self) -> str:
        """The TOLERANCES key of this run: its compute dtype (auto: bf16 unless it ran on the CPU)
        and whether its model has experts."""
        precision = self.config.get("training", {}).get("mixed_precision", {})
        dtype = precision.get("param_dtype", "float32")
        if dtype == "auto":
            dtype = "float32" if self.config.get("device") == "cpu" else "bfloat16"
        if dtype in ("bfloat16", "float16"):
            return "bf16"
        return "fp32_moe" if self.config.get("model", {}).get("n_experts") else "fp32"

    @property
    def layout(self) -> str:
        """Its mesh's degrees other than 1 (dp_shard=-1 resolved from the world size it ran on,
        ep=-1 as every dp_shard x cp rank of a model with experts)."""
        p = dict(self.config.get("parallel", {}))
        world = next(iter(self.steps.values())).get("world_size")
        if p.get("dp_shard") == -1 and world:
            p["dp_shard"] = world // math.prod(p.get(k) or 1
                                               for k in ("pp", "dp_replicate", "cp", "tp"))
        if p.get("ep") == -1 and p.get("dp_shard", 1) != -1:
            experts = self.config.get("model", {}).get("n_experts")
            p["ep"] = (p.get("dp_shard") or 1) * (p.get("cp") or 1) if experts else 1
        degrees = [f"{k}={p[k]}" for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
                   if p.get(k, 1) != 1]
        return " ".join(degrees) or "one process"


def read_run(path: str | Path) -> Run:
    """A run's output folder; a ValueError says what is missing."""
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise ValueError(f"{path} has no metrics.jsonl: not a run's output_dir")
    steps = {}
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
            steps[row["step"]] = row
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut short by a killed job
    if not steps:
        raise ValueError(f"{metrics} has no logged step")
    config = path / "config.yaml"
    return Run(path, steps, yaml.safe_load(config.read_text()) if config.is_file() else {})


@dataclass
class Comparison:
    steps: list[int]
    loss: list[float]  # relative differences, per step
    grad_norm: list[float]
    loss_rtol: float
    grad_norm_rtol: float

    @property
    def within(self) -> bool:
        return max(self.loss) <= self.loss_rtol and max(self.grad_norm) <= self.grad_norm_rtol

    def first_outside(self) -> int | None:
        return next((s for s, dl, dg in zip(self.steps, self.loss, self.grad_norm)
                     if dl > self.loss_rtol or dg > self.grad_norm_rtol), None)


def compare(a: Run, b: Run, last_step: int | None = None, rtol: float | None = None) -> Comparison:
    """The runs' relative differences at each step both logged (up to `last_step`), against the
    looser of their precisions' tolerances (or `rtol` for the loss, ten times it for the gradient
    norm)."""
    steps = sorted(s for s in a.steps.keys() & b.steps.keys() if last_step is None
                   or s <= last_step)
    if not steps:
        raise ValueError(f"{a.path} and {b.path} have no logged step in common")
    loss_rtol, grad_rtol = max(TOLERANCES[a.precision], TOLERANCES[b.precision],
                               key=lambda pair: pair[0])
    if rtol is not None:
        loss_rtol, grad_rtol = rtol, 10 * rtol

    def relative(key: str, step: int) -> float:
        x, y = a.steps[step][key], b.steps[step][key]
        return abs(x - y) / abs(y) if y else abs(x - y)

    return Comparison(steps, [relative("loss", s) for s in steps],
                      [relative("grad_norm", s) for s in steps], loss_rtol, grad_rtol)
