"""The optimizer (AdamW, or Muon for the blocks' matrices: trainer/muon.py), the warmup + cosine
schedule, and gradient clipping over sharded gradients."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.models.spec import ModelSpec
from trainer.muon import Muon, is_muon_matrix, ns_dtype


def build_optimizer(model: nn.Module, optim, lr: float, weight_decay: float, spec: ModelSpec | None = None,
                    group_of: Callable | None = None, device: torch.device | str = "cpu") -> torch.optim.Optimizer:
    """optim.name's optimizer over `model`'s parameters. Muon needs the model's family (`spec`: which
    parameters are block matrices) and, on several ranks, `group_of` (global ranks -> their process
    group: ParallelDims.group_spanning)."""
    named = list(model.named_parameters())
    muon = [p for name, p in named if spec is not None and optim.name == "muon"
            and is_muon_matrix(name, p, spec.blocks, spec.adamw_matrices)]
    chosen = set(map(id, muon))
    # Norm weights and other 1-D parameters are not decayed.
    groups = [
        {"params": params, "weight_decay": weight_decay if params[0].ndim >= 2 else 0.0}
        for decayed in (True, False)
        for params in by_mesh([p for _, p in named if (p.ndim >= 2) == decayed and id(p) not in chosen])
    ]
    betas = (optim.beta1, optim.beta2)
    if optim.name != "muon":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=optim.eps, fused=True)
    return Muon(muon, groups, lr=lr, weight_decay=weight_decay, betas=betas, eps=optim.eps, momentum=optim.momentum,
                nesterov=optim.nesterov, ns_steps=optim.ns_steps, ns_dtype=ns_dtype(optim.ns_dtype, device),
                rms_match=optim.muon.rms_match, group_of=group_of or _no_groups)


def _no_groups(ranks: tuple[int, ...]):
    raise RuntimeError(f"Muon needs the process group of ranks {ranks}: pass build_optimizer a group_of")


def lr_lambda(warmup_steps: int, total_steps: int, min_ratio: float):
    """Linear warmup to the peak, then cosine decay to peak * min_ratio at the last step."""

    def factor(step: int) -> float:  # step: optimizer steps already taken
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        decay_steps = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_scheduler(optimizer, warmup_steps: int, total_steps: int, min_ratio: float, start_step: int = 0):
    """The schedule from optimizer step `start_step` on (a resumed run's)."""
    factor = lr_lambda(warmup_steps, total_steps, min_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: factor(start_step + step))


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Clips by the global norm of all gradients and returns that norm, the same on every rank."""
    return clip_and_sum_loss_(parameters, max_norm)[0]


@torch.no_grad()
def clip_and_sum_loss_(parameters, max_norm: float, loss: torch.Tensor | None = None):
    """Clips by the global norm of all gradients; returns that norm and, given this rank's `loss`,
    the sum of every rank's (both the same on every rank, from one all-reduce).

    Each rank sums the squares of its local gradient shards, each divided by the number of ranks
    that hold the same values (the mesh dimensions a DTensor is replicated on; every rank for a
    plain tensor), and one all-reduce over all ranks adds them up. That is exact for any mix of
    sharding, replication and pipeline stages, and every rank gets the same bits.
    """
    parameters = [p for p in parameters if p.grad is not None]
    world = dist.get_world_size() if dist.is_initialized() else 1
    by_copies: dict[int, list[torch.Tensor]] = {}
    for p in parameters:
        grad = p.grad
        if isinstance(grad, DTensor):
            copies = math.prod(grad.device_mesh.size(i) for i, pl in enumerate(grad.placements) if pl.is_replicate())
            grad = grad.to_local()
        else:
            copies = world
        by_copies.setdefault(copies, []).append(grad)
    squares = sum(
        torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True).double() ** 2 / copies
        for copies, grads in by_copies.items()
    )
    summed = squares if loss is None else torch.stack([squares, loss.detach().double().to(squares.device)])
    if world > 1:
        dist.all_reduce(summed)
    total = summed.reshape(-1)[0].sqrt().float()
    if max_norm > 0:
        scale_([g for grads in by_copies.values() for g in grads], (max_norm / (total + 1e-6)).clamp(max=1.0))
    return total, (None if loss is None else summed[1])


def scale_(local_grads: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiplies the gradients' local shards by `factor` in place (torch's clip_grads_with_norm_ arithmetic).
    On the shards, not the DTensors: DTensor's sharding propagation for a foreach op over many
    gradients on a 2-D mesh took 17 s in the first step of a 4-rank HSDP + EP run."""
    by_kind: dict = {}
    for grad in local_grads:
        by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, _), grads in by_kind.items():
        torch._foreach_mul_(grads, factor.to(device))  # torch's own clipping calls this op


def by_mesh(parameters: list) -> list[list]:
    """Parameters split by the mesh their DTensors live on (expert weights have their own):
    a foreach op takes DTensors of one mesh only."""
    groups: dict = {}
    for p in parameters:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return list(groups.values())
