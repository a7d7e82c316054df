"""Tensor parallel (Megatron-style) with sequence parallel and loss parallel, on the tp submesh.

A family writes its plan as data (module path -> ParallelStyle, see its `parallelize.py`); this
module applies it, leaving out the paths a pipeline stage does not hold. The plans of the shared
building blocks, and the styles of the output head and of a replicated norm, live beside those
modules (trainer/models/tp_plans.py).
"""

from __future__ import annotations

from fnmatch import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict) -> None:
    """Applies `plan` (module path patterns -> styles) to `model` on `tp_mesh`."""
    parallelize_module(model, tp_mesh,
                       {path: style for path, style in plan.items() if _resolves(model, path)})


def _resolves(module: nn.Module, path: str) -> bool:
    """Whether `path` (fnmatch patterns per dotted part) names at least one module of `module`."""
    first, _, rest = path.partition(".")
    for name, child in module.named_children():
        if fnmatch(name, first) and (not rest or _resolves(child, rest)):
            return True
    return False
