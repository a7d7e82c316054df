"""AdamW, the warmup + cosine schedule, and gradient clipping over sharded gradients."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.errors import ConfigError


def build_optimizer(model: nn.Module, optim, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    if optim.name != "adamw":
        raise ConfigError(f"optim.name={optim.name} is unknown; this version supports 'adamw'")
    # Norm weights and other 1-D parameters are not decayed.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, foreach=True)


def lr_lambda(warmup_steps: int, total_steps: int, min_ratio: float):
    """Linear warmup to the peak, then cosine decay to peak * min_ratio at the last step."""

    def factor(step: int) -> float:  # step: optimizer steps already taken
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        decay_steps = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_scheduler(optimizer, warmup_steps: int, total_steps: int, min_ratio: float):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(warmup_steps, total_steps, min_ratio))


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Clips by the global norm of all gradients and returns that norm (a plain tensor).

    Sharded (DTensor) gradients are grouped by mesh, since parameters of one model can live on
    different meshes (pipeline stages, experts); DTensor reduces each group's norm over its
    mesh, and the groups' squares are summed.
    """
    parameters = [p for p in parameters if p.grad is not None]
    by_mesh: dict = {}
    for p in parameters:
        by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    squares = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = torch.stack(squares).sum().sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach=True)
    return total
