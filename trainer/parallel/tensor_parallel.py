"""Tensor parallel (Megatron-style) with sequence parallel and loss parallel, on the tp submesh.

A family writes its plan as data (module path -> ParallelStyle, see its `parallelize.py`); this
module applies it, leaving out the paths a pipeline stage does not hold. With loss parallel the
output stays split on the vocabulary and the loss is computed on the shards
(`loss_parallel_context`).
"""

from __future__ import annotations

import contextlib
from fnmatch import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel, parallelize_module


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict) -> None:
    """Applies `plan` (module path patterns -> styles) to `model` on `tp_mesh`."""
    parallelize_module(model, tp_mesh, {path: style for path, style in plan.items() if _resolves(model, path)})


def _resolves(module: nn.Module, path: str) -> bool:
    """Whether `path` (fnmatch patterns per dotted part) names at least one module of `module`."""
    first, _, rest = path.partition(".")
    for name, child in module.named_children():
        if fnmatch(name, first) and (not rest or _resolves(child, rest)):
            return True
    return False


class ReplicateParameters(ParallelStyle):
    """The module's parameters become DTensors replicated on the mesh; its inputs and outputs stay
    plain tensors (a norm outside sequence parallel)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            input_fn=lambda mod, inputs, mesh: tuple(
                DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs
            ),
            output_fn=lambda mod, output, mesh: output.to_local(),
        )


def loss_parallel_context(enabled: bool):
    """Where forward's loss and backward run: cross-entropy on vocabulary-split logits needs it."""
    return loss_parallel() if enabled else contextlib.nullcontext()
