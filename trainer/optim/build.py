"""The optimizer optim.name selects, built over a model's parameters (trainer/optim/spec.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.config.schema import OptimConfig
from trainer.models.spec import ModelSpec
from trainer.optim.spec import OptimizerInputs, optimizer_of


def build_optimizer(model: nn.Module, optim: OptimConfig, lr: float, weight_decay: float,
                    spec: ModelSpec | None = None, group_of: Callable | None = None,
                    device: torch.device | str = "cpu") -> torch.optim.Optimizer:
    """optim.name's optimizer over `model`'s parameters. One that treats some parameters apart
    (Muon: the block matrices) needs the model's family (`spec`) and, on several ranks,
    `group_of` (global ranks -> their process group: ParallelDims.group_spanning)."""
    chosen = optimizer_of(optim)
    # (a frozen parameter, LoRA's base, takes no state)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    apart = [p for name, p in named if spec is not None and chosen.apart is not None
             and chosen.apart(name, p, spec)]
    ids = set(map(id, apart))
    # Norm weights and other 1-D parameters are not decayed.
    groups = [
        {"params": params, "weight_decay": weight_decay if params[0].ndim >= 2 else 0.0}
        for decayed in (True, False)
        for params in by_mesh([p for _, p in named if (p.ndim >= 2) == decayed
                               and id(p) not in ids])
    ]
    return chosen.build(OptimizerInputs(groups, apart, optim, lr, weight_decay, device,
                                        group_of or _no_groups))


def _no_groups(ranks: tuple[int, ...]):
    raise RuntimeError(f"the optimizer needs the process group of ranks {ranks}: pass "
                       "build_optimizer a group_of")


def by_mesh(parameters: list) -> list[list]:
    """Parameters split by the mesh their DTensors live on (expert weights have their own):
    a foreach op takes DTensors of one mesh only."""
    groups: dict = {}
    for p in parameters:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return list(groups.values())
