"""float8 training through torchao: the linear layers' matmuls in float8, with dynamic scales.

Before a model is parallelized, its `nn.Linear` layers become torchao's `Float8Linear` (same
parameter names, so checkpoints move between float8 and bf16 runs), except
- the output head, whose matmul is fused with the loss (LMHead) and stays in the compute dtype;
- the modules `training.float8.skip` names (fnmatch patterns; by default the MoE router, whose
  tiny GEMM decides the routing);
- layers with a dimension float8 GEMMs cannot take (not a multiple of 16), named at start-up.
The MoE experts' grouped GEMMs stay in the compute dtype.

With the tensorwise recipe, FSDP all-gathers the weights in float8 (half of bf16's bytes) with their
scales computed once a step after the optimizer (`Float8Scales`), and tensor parallel casts its
inputs to float8 before it gathers them (torchao's float8 styles). Both move the same bits as
casting after a high-precision gather would, so they change the communication, not the numbers.
"""

from __future__ import annotations

import dataclasses
import re
from fnmatch import fnmatch

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from trainer.config.schema import Float8Config
from trainer.errors import ConfigError
from trainer.models.head import LMHead
from trainer.step_parts import StepPart
from trainer.torchao_import import import_torchao

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's named recipes
INSTALL = 'pip install -e ".[float8]"'
ALIGN = 16  # float8 GEMMs take dimensions that are multiples of this


def torchao_float8():
    """torchao.float8, imported without the lines torchao logs when its CUDA kernels do not load
    (on a CPU box, always); a config error naming the install command if torchao is missing."""
    try:
        return import_torchao("torchao.float8")
    except ImportError:
        raise ConfigError(f"training.float8.enabled=true needs torchao: {INSTALL}") from None


def check_float8(f8: Float8Config, device: str, compile: bool) -> None:
    """The float8 keys against the device the job runs on (before any rank does real work)."""
    if not f8.enabled:
        return
    torchao_float8()
    if device != "cuda":
        return
    if not compile:
        raise ConfigError("training.float8.enabled=true on a GPU needs training.compile=true: "
                          "uncompiled, each float8 cast and scale is a kernel of its own and the "
                          "step is slower than bf16")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9) and not f8.emulate:
        raise ConfigError("training.float8.enabled=true needs a GPU with float8 matmuls (sm_89 or "
                          f"newer; this {torch.cuda.get_device_name()} is sm_{major}{minor}): set "
                          "training.float8.emulate=true to check numerics, or "
                          "training.float8.enabled=false")


def check_float8_layers(model: nn.Module, f8: Float8Config) -> None:
    """Unless training.float8.skip_unaligned, a config error naming the layers float8 cannot take
    that training.float8.skip leaves in (`model` may be on meta)."""
    unaligned = [name for name, m in _linears(model) if not _skipped(name, f8) and not _aligned(m)]
    if f8.enabled and unaligned and not f8.skip_unaligned:
        raise ConfigError(f"training.float8: {_patterns(unaligned)} have dimensions float8 matmuls "
                          f"cannot take (not multiples of {ALIGN}): add them to "
                          "training.float8.skip, or set training.float8.skip_unaligned=true")


def float8_of(training) -> Float8Config | None:
    """training.float8 when it is enabled, else None."""
    return training.float8 if training.float8.enabled else None


def gathers_in_float8(f8: Float8Config | None) -> bool:
    """Whether FSDP and tensor parallel move float8 weights and inputs (torchao: tensorwise
    only)."""
    return f8 is not None and f8.recipe == "tensorwise"


def convert(model: nn.Module, f8: Float8Config, device: torch.device | None = None,
            compute_dtype: torch.dtype | None = None) -> None:
    """Swaps `model`'s linear layers for Float8Linear, but for those float8 leaves out (see
    above); on the CPU, the matmuls go to torch's own float8 kernel (see cpu_float8_matmuls)."""
    if device is not None and device.type == "cpu" and not f8.emulate:
        cpu_float8_matmuls(compute_dtype)
    ao = torchao_float8()
    config = ao.Float8LinearConfig.from_recipe_name(f8.recipe)
    config = dataclasses.replace(config, emulate=f8.emulate,
                                 enable_fsdp_float8_all_gather=gathers_in_float8(f8))
    ao.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, name: (
        type(m) is nn.Linear and not _skipped(name, f8) and _aligned(m)))


def cpu_float8_matmuls(compute_dtype: torch.dtype | None) -> None:
    """On the CPU torch hands a float8 matmul to oneDNN where oneDNN claims one. On CPUs with AMX
    its only float8 matmul is its reference implementation (measured on a Xeon with AMX: 0.99 s
    for 512 x 256 x 256, against 1.7 ms for torch's own kernel, which gives the same bits); on
    others (AVX2, Zen 4) it claims none and torch's own runs. So a job computing in float32, whose
    matmuls do not need oneDNN, turns oneDNN off: every CPU then runs the same float8 kernel. One
    computing in bfloat16 keeps it (torch's bfloat16 matmuls are oneDNN's)."""
    if compute_dtype == torch.float32:
        torch.backends.mkldnn.enabled = False


def describe(parts: list[nn.Module], f8: Float8Config) -> str:
    """One start-up line: how many linear layers run in float8, and which stay in high precision,
    why."""
    from torchao.float8.float8_linear import Float8Linear

    converted = sum(isinstance(m, Float8Linear) for part in parts for m in part.modules())
    linears = [(name, m) for part in parts for name, m in _linears(part)]
    kept = {"the loss": [name for part in parts for name, m in part.named_modules()
                         if isinstance(m, LMHead)],
            "training.float8.skip": [name for name, m in linears if _skipped(name, f8)],
            f"dimensions not multiples of {ALIGN}": [name for name, m in linears
                                                      if not _skipped(name, f8)
                                                     and not _aligned(m)]}
    high = "; ".join(f"{_patterns(names)} "
                     f"({why})" for why, names in kept.items() if names) or "none"
    emulated = ", emulated" if f8.emulate else ""
    return (f"float8 ({f8.recipe}{emulated}): {converted} linear layers; "
            f"in high precision: {high}")


def _linears(model: nn.Module):
    return [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]


def _skipped(name: str, f8: Float8Config) -> bool:
    return any(fnmatch(name, pattern) for pattern in f8.skip)


def _aligned(linear: nn.Linear) -> bool:
    return linear.in_features % ALIGN == 0 and linear.out_features % ALIGN == 0


def _patterns(names: list[str]) -> str:
    """Module names with their layer indices folded: layers.0.router, layers.1.router ->
    layers.*.router."""
    return ", ".join(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", f".{name}.").strip(".")
                                   for name in names))


def float8_tp_plan(model: nn.Module, plan: dict) -> dict:
    """`plan` with torchao's float8 styles for the paths whose linear layers are all Float8Linear:
    the inputs are cast to float8 before they are gathered over the tp ranks."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    def all_float8(path: str) -> bool:
        modules = [m for name, m in model.named_modules() if name and fnmatch(name, path)]
        linears = [m for module in modules for m in module.modules() if isinstance(m, nn.Linear)]
        return bool(linears) and all(isinstance(m, Float8Linear) and not isinstance(m, LMHead)
                                     for m in linears)

    mapped = {}
    for path, style in plan.items():
        if type(style) in (ColwiseParallel, RowwiseParallel) and all_float8(path):
            kind = (Float8ColwiseParallel if type(style) is ColwiseParallel
                    else Float8RowwiseParallel)
            style = kind(input_layouts=style.input_layouts[0],
                         output_layouts=style.output_layouts[0],
                         use_local_output=style.use_local_output)
        elif type(style) is PrepareModuleInput and all_float8(path):
            style = PrepareFloat8ModuleInput(input_layouts=style.input_layouts,
                                             desired_input_layouts=style.desired_input_layouts,
                                             use_local_output=style.use_local_output)
        mapped[path] = style
    return mapped


def gather_bytes_over_gloo(model: nn.Module) -> None:
    """FSDP's all-gathers of `model` carry float8 weights as bytes: gloo has no float8 types."""
    gather = _byte_all_gather()  # stateless: one for every unit
    for module in model.modules():
        if hasattr(module, "set_custom_all_gather"):
            module.set_custom_all_gather(gather)


def _byte_all_gather():
    # torch (2.13) names the interface of a custom FSDP all-gather only in a private module; the
    # public hook that takes one is FSDPModule.set_custom_all_gather.
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    class ByteAllGather(AllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            if output_tensor.dtype.itemsize == 1:
                output_tensor, input_tensor = (output_tensor.view(torch.uint8),
                                               input_tensor.view(torch.uint8))
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                               async_op=async_op)

    return ByteAllGather()


def plain(t: torch.Tensor) -> torch.Tensor:
    """A weight as FSDP's float8 all-gather holds it (inside torchao's wrapper), as the plain tensor
    it wraps, sharing its storage: what a checkpoint saves, so that a run without float8 (or
    torchao) reads it, and loads into, in place. Other tensors as they are."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    if type(local).__name__ != "WeightWithDynamicFloat8CastTensor":
        return t
    if not isinstance(t, DTensor):
        return local._tensor
    return DTensor.from_local(local._tensor, t.device_mesh, t.placements, run_check=False,
                              shape=t.shape, stride=t.stride())


class Float8Scales(StepPart):
    """The scales of the float8 weights FSDP gathers in a step, in one all-reduce before its forward
    (else each unit reduces its own at every gather), so loaded weights are never stale."""

    def __init__(self, model_parts: list[nn.Module]):
        self.model_parts = model_parts

    def before_forward(self, step: int) -> None:
        # (imported quietly at build)
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in self.model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)
