"""Features that act around the training step, as parts with one small lifecycle. The loop calls
each hook of every part in order; a part overrides the hooks it needs, and a feature that is off is
not in the list, so the step itself names no feature."""

from __future__ import annotations

import torch


class StepPart:
    def start_step(self, step: int) -> None:
        """`step` begins (its batch not yet read)."""

    def before_forward(self, step: int) -> None:
        """The batch is read; the forward is next."""

    def after_backward(self, step: int) -> None:
        """Every microbatch's backward is done (gradients reduced over data parallel)."""

    def before_optimizer_step(self, step: int, skipped: torch.Tensor, microbatches: int) -> None:
        """Gradients clipped and the guard's verdict known (`skipped`: 1 when the optimizer step is
        skipped, a device tensor, so no host sync); `microbatches`: those this rank ran in the
        step."""

    def after_step(self, step: int) -> None:
        """The step is over, applied or not (a failed replica round trains it again)."""

    def after_update(self, step: int) -> None:
        """The step counted: every replica group applied its update (or the guard skipped it). A
        part may move the run from here (a loss spike's rollback): the step is then neither logged
        nor saved, and the loop goes on from where the run moved."""

    def enter(self, phase: str, long: bool = False) -> None:
        """The loop enters `phase` of the step (the metrics, a checkpoint); `long`: one allowed
        distributed.timeout_s, like a start-up (a validation, a checkpoint save, a resume)."""

    def record(self) -> dict:
        """Figures for the step's logged record (collective: every rank calls it)."""
        return {}

    def close(self) -> None:
        """The run ends."""


class StepParts(StepPart):
    """Every part, called in the order given."""

    def __init__(self, parts: list[StepPart]):
        self.parts = parts

    def start_step(self, step: int) -> None:
        for part in self.parts:
            part.start_step(step)

    def before_forward(self, step: int) -> None:
        for part in self.parts:
            part.before_forward(step)

    def after_backward(self, step: int) -> None:
        for part in self.parts:
            part.after_backward(step)

    def before_optimizer_step(self, step: int, skipped: torch.Tensor, microbatches: int) -> None:
        for part in self.parts:
            part.before_optimizer_step(step, skipped, microbatches)

    def after_step(self, step: int) -> None:
        for part in self.parts:
            part.after_step(step)

    def after_update(self, step: int) -> None:
        for part in self.parts:
            part.after_update(step)

    def enter(self, phase: str, long: bool = False) -> None:
        for part in self.parts:
            part.enter(phase, long)

    def record(self) -> dict:
        return {k: v for part in self.parts for k, v in part.record().items()}

    def close(self) -> None:
        for part in self.parts:
            part.close()
