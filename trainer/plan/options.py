"""What a job that does not fit its GPUs could change to fit on them: the options that trade a
little precision or speed for memory, cheapest first (the advice names the first that fits)."""

from __future__ import annotations

from trainer.config.schema import JobConfig
from trainer.errors import ConfigError
from trainer.optim.spec import check_state_dtype
from trainer.parallel.dims import ParallelDims
from trainer.plan import GIB, make_plan
from trainer.plan.devices import Device
from trainer.plan.search import apply_overrides

# (section.key -> value): AdamW's moments in bfloat16 halve the optimizer's state at no cost in time
MEMORY_OPTIONS = ({"optim.state_dtype": "bfloat16"},)


def fitting_option(job: JobConfig, dims: ParallelDims, device: Device) -> str | None:
    """`it fits with KEY=VALUE (peak N GiB)` for the first option the job does not use already
    that makes it fit, else None."""
    for overrides in MEMORY_OPTIONS:
        if all(_value(job, key) == value for key, value in overrides.items()):
            continue
        changed = apply_overrides(job, overrides)
        try:
            check_state_dtype(changed.optim)
        except ConfigError:  # (not this optimizer's)
            continue
        plan = make_plan(changed, dims, device)
        if plan.fits:
            said = " ".join(f"{key}={value}" for key, value in overrides.items())
            return f"it fits with {said} (peak {plan.peak / GIB:.1f} GiB)"
    return None


def _value(job: JobConfig, key: str):
    section, name = key.split(".")
    return getattr(getattr(job, section), name)
