"""The options that trade a little precision or speed for memory, cheapest first: what a job that
does not fit its GPUs could change to fit on them. The plan's advice names the first that fits;
the search (parallel=auto) tries them, in turn, when no layout fits without."""

from __future__ import annotations

from trainer.checks.ranges import value_of
from trainer.config.schema import JobConfig

# (section.key -> value): AdamW's moments in bfloat16 halve the optimizer's state, in float8 blocks
# quarter it (a coarser curve: docs/memory.md); the offload moves
# the sharded weights, gradients and optimizer to the host (the step runs there, slower); both; the
# blocks' activations to the host instead of checkpointing them (their copies cost more than full
# checkpointing's recompute where the host link is slower than the compute: most GPUs).
MEMORY_OPTIONS = ({"optim.state_dtype": "bfloat16"}, {"optim.state_dtype": "float8"},
                  {"training.offload": "optimizer"},
                  {"optim.state_dtype": "bfloat16", "training.offload": "optimizer"},
                  {"training.offload": "activations"})


def options_for(job: JobConfig, pinned: dict[str, str] | None = None) -> list[dict]:
    """The options `job` does not use already and that set no key the user pinned (whether its
    config takes one, the search's checks say)."""
    return [option for option in MEMORY_OPTIONS
            if not any(key in (pinned or {}) for key in option)
            and not all(value_of(job, key) == value for key, value in option.items())]
