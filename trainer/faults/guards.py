"""Guards on each optimizer step. A step whose loss or gradient norm is NaN or infinite, or whose
loss spikes, is skipped on the device: the fused AdamW takes a `found_inf` flag and leaves weights,
moments and its step count alone when it is set. The decision is made from values every rank
already shares (the gradient norm's all-reduce carries the loss too), so every rank skips the same
steps in every layout, and no step waits on the host for it. The host reads the counts when it logs
or saves: a stop is noticed then, and until then every step after the first bad one is skipped, so
nothing is lost by the wait.
"""

from __future__ import annotations

import torch

from trainer.errors import TrainingStopped
from trainer.step_parts import StepPart
from trainer.tensors import local_tensor


class StepGuard:
    def __init__(self, training, device: torch.device):
        self.stop_on_nonfinite = training.on_nonfinite == "stop"
        self.max_skipped = training.max_skipped_steps
        self.spike = training.spike
        zero = torch.zeros((), device=device)
        self.skipped, self.in_a_row, self.nonfinite, self.spikes = (zero.clone() for _ in range(4))
        # The first non-finite step (-1: none yet) with its
        # loss and norm; the last skipped one, likewise.
        self.first_bad = torch.full((3,), -1.0, device=device)
        self.last_skipped = torch.full((3,), -1.0, device=device)
        # the loss's running statistics
        self.mean, self.var, self.seen = zero.clone(), zero.clone(), zero.clone()
        self.reported = 0  # skipped steps already said on the console
        self.last_was_spike = torch.zeros((), dtype=torch.bool, device=device)

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """Whether to skip `step` (1.0 or 0.0, on the device): `loss` is the job's mean loss and
        `grad_norm` the global gradient norm, both the same on every rank."""
        loss, grad_norm = loss.float(), grad_norm.float()
        values = torch.stack([torch.full((), float(step), device=loss.device), loss, grad_norm])
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        skip = bad
        # from the first bad step on, nothing moves until the host stops the job
        if self.stop_on_nonfinite:
            halted = self.first_bad[0] >= 0
            self.first_bad = torch.where(bad & ~halted, values, self.first_bad)
            skip = skip | halted
        if self.spike.threshold is not None:
            warm = self.seen >= self.spike.warmup_steps
            spike = ~bad & warm & (loss > self.mean + self.spike.threshold * self.var.sqrt())
            self.spikes += spike
            self.last_was_spike = spike
            skip = skip | spike
            self._follow(loss, ~skip)
        self.nonfinite += bad
        self.skipped += skip
        self.in_a_row = (self.in_a_row + 1) * skip
        self.last_skipped = torch.where(skip, values, self.last_skipped)
        return skip.float()

    def _follow(self, loss: torch.Tensor, take: torch.Tensor) -> None:
        """Moves the running mean and variance towards `loss` where `take` (the first loss sets
        them)."""
        first, decay = self.seen == 0, self.spike.decay
        delta = loss - self.mean
        mean = torch.where(first, loss, self.mean + (1 - decay) * delta)
        var = torch.where(first, torch.zeros_like(loss),
                          decay * (self.var + (1 - decay) * delta**2))
        self.mean = torch.where(take, mean, self.mean)
        self.var = torch.where(take, var, self.var)
        self.seen += take

    def check_stop(self) -> None:
        """Raises TrainingStopped when the job must stop (a host sync: call when logging or
        saving)."""
        in_a_row, first_bad = int(self.in_a_row.item()), self.first_bad.tolist()
        if first_bad[0] >= 0:
            raise TrainingStopped(f"step {first_bad[0]:.0f}: {_values(first_bad)} "
                                  "(training.on_nonfinite=stop); nothing after it was applied or "
                                  "saved")
        if self.max_skipped and in_a_row >= self.max_skipped:
            last = self.last_skipped.tolist()
            raise TrainingStopped(f"{in_a_row} steps in a row skipped (training.max_skipped_steps="
                                  f"{self.max_skipped}), the last at step {last[0]:.0f}: "
                                  f"{_values(last)}")

    def report(self) -> tuple[dict, str]:
        """metrics.jsonl's fields, and a line on what was skipped since the last report (or "");
        raises TrainingStopped when the job must stop."""
        self.check_stop()
        counts = torch.stack([self.skipped, self.nonfinite, self.spikes]).tolist()
        skipped, nonfinite, spikes = (int(v) for v in counts)
        said = ""
        if skipped > self.reported:
            last = self.last_skipped.tolist()
            said = (f"{skipped - self.reported} optimizer step(s) skipped, the last at step "
                    f"{last[0]:.0f}: {_values(last)} ({skipped} in all: {nonfinite} non-finite, "
                    f"{spikes} loss spikes)")
            self.reported = skipped
        return {"skipped_steps": skipped}, said

    def spiked(self) -> bool:
        """Whether the step just checked was skipped as a loss spike (a host sync)."""
        return bool(self.last_was_spike.item())


class SpikeRollback(StepPart):
    """training.spike.action=rollback, as a step part: after a step the guard skipped as a loss
    spike, `roll_back()` (the trainer's) takes the run back to the newest checkpoint, reading on
    past the spike's batch; with no checkpoint yet, the step just stays skipped."""

    def __init__(self, guard: StepGuard, roll_back):
        self.guard, self.roll_back = guard, roll_back

    def after_update(self, step: int) -> None:
        if self.guard.spiked():
            self.roll_back()


def _values(values: list[float]) -> str:
    return f"loss {values[1]:.4g}, gradient norm {values[2]:.4g}"


@torch.no_grad()
def check_finite(parts, optimizer, step: int) -> None:
    """Raises TrainingStopped when any parameter or optimizer state of any rank is NaN or infinite
    (collective: every rank calls it before a checkpoint is written). A frozen parameter (LoRA's
    base) cannot have changed."""
    tensors = [(name, p) for part in parts for name, p in part.named_parameters()
               if p.requires_grad]
    names = {id(p): name for name, p in tensors}
    for p, state in optimizer.state.items():
        tensors += [(f"{names.get(id(p), '?')} ({key})", v) for key, v in state.items()
                    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() > 1]
    local = [local_tensor(t) for _, t in tensors]
    finite = (torch.stack([torch.isfinite(t).all() for t in local]) if local
              else torch.ones(0, dtype=torch.bool))
    bad = (~finite).to(torch.int32).sum().reshape(1)
    torch.distributed.all_reduce(bad)
    if bad.item():
        first = next((name for (name, _), ok in zip(tensors, finite.tolist()) if not ok),
                     "on another rank")
        raise TrainingStopped(f"step {step}: not saved: parameters or optimizer state hold NaN or "
                              f"infinite values (first: {first}); the previous checkpoint stays "
                              "the newest")
