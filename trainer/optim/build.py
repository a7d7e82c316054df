"""The optimizer optim.name chooses: AdamW, or Muon for the blocks' matrices (trainer/optim/muon.py)
with AdamW for the rest."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.models.spec import ModelSpec
from trainer.optim.muon import Muon, is_muon_matrix, ns_dtype


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


def by_mesh(parameters: list) -> list[list]:
    """Parameters split by the mesh their DTensors live on (expert weights have their own):
    a foreach op takes DTensors of one mesh only."""
    groups: dict = {}
    for p in parameters:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return list(groups.values())
