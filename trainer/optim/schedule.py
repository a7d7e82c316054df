"""The learning rate's schedule: a linear warmup, then cosine decay."""

from __future__ import annotations

import math

import torch


def lr_lambda(warmup_steps: int, total_steps: int, min_ratio: float):
    """Linear warmup to the peak, then cosine decay to peak * min_ratio at the last step."""

    def factor(step: int) -> float:  # step: optimizer steps already taken
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        decay_steps = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_scheduler(optimizer, warmup_steps: int, total_steps: int, min_ratio: float,
                    start_step: int = 0):
    """The schedule from optimizer step `start_step` on (a resumed run's)."""
    factor = lr_lambda(warmup_steps, total_steps, min_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: factor(start_step + step))
