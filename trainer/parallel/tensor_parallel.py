"""Tensor parallel (Megatron-style) with sequence parallel and loss parallel, on the tp submesh.

A family writes its plan as data (module path -> ParallelStyle, see its `parallelize.py`); this
module applies it, leaving out the paths a pipeline stage does not hold. The output head with its
loss (trainer.models.head.LMHead) takes `LMHeadParallel`: with loss parallel its weight is split on
the vocabulary and each rank computes the loss's sums on its shard.
"""

from __future__ import annotations

from fnmatch import fnmatch

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module


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


class LMHeadParallel(ParallelStyle):
    """The output head with its loss (an LMHead) on the tp mesh. Its input, the hidden states laid out
    as `input_layout` (Shard(1) under sequence parallel), is gathered whole on every rank. With
    `vocab_parallel` its weight is split on the vocabulary (each rank computes its shard's logits;
    the input's gradient is a partial sum, reduced by the layout), else replicated (each rank
    computes the whole loss)."""

    def __init__(self, input_layout: Placement, vocab_parallel: bool):
        super().__init__()
        self.input_layout, self.vocab_parallel = input_layout, vocab_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        placement = Shard(0) if self.vocab_parallel else Replicate()

        def partition(name, mod, mesh):
            for key, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [placement])))

        def gather_input(mod, inputs, mesh):
            h, *rest = inputs
            if not isinstance(h, DTensor):  # (sequence parallel's norm hands on a DTensor)
                h = DTensor.from_local(h, mesh, [self.input_layout], run_check=False)
            h = h.redistribute(mesh, [Replicate()])
            grad = Partial() if self.vocab_parallel else Replicate()
            return (h.to_local(grad_placements=[grad]), *rest)

        return distribute_module(module, device_mesh, partition, gather_input)
