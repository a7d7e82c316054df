"""The options that trade a little precision or speed for memory, cheapest first: what a job that
does not fit its GPUs could change to fit on them. The plan's advice names the first that fits;
the search (parallel=auto) tries them, in turn, when no layout fits without."""

from __future__ import annotations

from dataclasses import replace

from trainer.checks.ranges import value_of
from trainer.config.schema import JobConfig
from trainer.errors import ConfigError
from trainer.optim.spec import check_state_dtype

# (section.key -> value): AdamW's moments in bfloat16 halve the optimizer's state
MEMORY_OPTIONS = ({"optim.state_dtype": "bfloat16"},)


def options_for(job: JobConfig, pinned: dict[str, str] | None = None) -> list[dict]:
    """The options `job` can take: those it does not use already, that set no key the user
    pinned, and that its optimizer takes."""
    found = []
    for option in MEMORY_OPTIONS:
        if any(key in (pinned or {}) for key in option) or all(
                value_of(job, key) == value for key, value in option.items()):
            continue
        if "optim.state_dtype" in option:
            try:
                check_state_dtype(replace(job.optim, state_dtype=option["optim.state_dtype"]))
            except ConfigError:  # (not this optimizer's)
                continue
        found.append(option)
    return found
