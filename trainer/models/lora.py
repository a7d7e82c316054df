"""LoRA: low-rank adapters beside a model's frozen linear layers.

A linear layer that takes an adapter becomes a `LoRALinear`: its weight (the base) keeps its name
and stays frozen, and two small matrices train beside it, `lora_A` [rank, in] and `lora_B`
[out, rank], with the output `x W^T + (alpha / rank) * dropout(x) A^T B^T` (Hugging Face peft's
arithmetic and names). B starts at zero, so training starts from the base model's function.

Under tensor parallel the adapters split so that each rank's product is its share of the
layer's: in a column-parallel layer B is split like the weight's rows (the outputs) and A is
whole on every rank; in a row-parallel layer A is split like the weight's columns (the inputs),
its product is a partial sum added to the base's, and B is whole. FSDP shards them with their
layer; a pipeline stage holds its blocks' adapters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fnmatch import fnmatch

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

ADAPTERS = ("lora_A", "lora_B")


@dataclass(frozen=True)
class LoraOptions:
    """What a model's adapters are: derived once from the job's peft section."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]  # fnmatch patterns of module names (a bare name matches the last part)
    base_dtype: str | None = None  # nf4: the adapted layers' frozen weights in 4 bits (QLoRA)


class LoRALinear(nn.Linear):
    """A frozen linear layer with a trained low-rank adapter beside it."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float,
                 dropout: float, bias: bool = False, **kwargs):
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        factory = {"device": self.weight.device, "dtype": self.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, **factory))
        self.lora_B = nn.Parameter(torch.empty(out_features, rank, **factory))
        self.rank, self.alpha, self.dropout = rank, alpha, dropout
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(x, self.dropout, self.training) if self.dropout else x
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(h, self.lora_A),
                                                              self.lora_B) * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


def is_adapter(name: str) -> bool:
    """Whether the parameter `name` is an adapter's (the rest of a LoRA model is frozen)."""
    return name.rpartition(".")[2] in ADAPTERS


def adapter_std(name: str, shape: torch.Size) -> float:
    """The std of the normal an adapter starts from: B zero; A with the variance of peft's
    Kaiming-uniform start (bound 1 / sqrt(in))."""
    return 0.0 if name.endswith("lora_B") else 1 / math.sqrt(3 * shape[1])


def matches(name: str, pattern: str) -> bool:
    """A module name against one of peft.target_modules: the whole name, or (a pattern without a
    dot) its last part."""
    return fnmatch(name, pattern) or ("." not in pattern and fnmatch(name.rpartition(".")[2],
                                                                     pattern))


def targets(model: nn.Module, patterns: tuple[str, ...] | list[str], blocks: str) -> list[str]:
    """The names of the plain linear layers inside `model`'s blocks that `patterns` match; a
    router (it chooses experts) never takes an adapter."""
    return [name for name, module in model.named_modules()
            if type(module) is nn.Linear and name.startswith(blocks + ".")
            and not name.endswith(".router") and any(matches(name, p) for p in patterns)]


def add_adapters(model: nn.Module, options: LoraOptions, blocks: str = "layers") -> list[str]:
    """Replaces the linear layers `options.targets` match with LoRALinear layers holding the same
    weight, and freezes every other parameter; returns their names."""
    names = targets(model, options.targets, blocks)
    for name in names:
        parent, _, attr = name.rpartition(".")
        old = model.get_submodule(name)
        new = LoRALinear(old.in_features, old.out_features, options.rank, options.alpha,
                         options.dropout, bias=old.bias is not None, device=old.weight.device,
                         dtype=old.weight.dtype)
        new.weight, new.bias = old.weight, old.bias
        setattr(model.get_submodule(parent), attr, new)
    freeze_base(model)
    return names


def freeze_base(model: nn.Module, dtype: torch.dtype | None = None) -> None:
    """Every parameter but the adapters' takes no gradient (tensor parallel's styles may have made
    new parameters of them); given `dtype` (the compute dtype), the frozen ones are held in it: a
    weight never updated needs no fp32 master copy (a tied one stays tied)."""
    held: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for attr, param in list(module.named_parameters(recurse=False)):
            if attr in ADAPTERS:
                param.requires_grad_(True)
                continue
            if dtype is None or param.dtype == dtype or not param.is_floating_point():
                param.requires_grad_(False)
                continue
            if id(param) not in held:
                held[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=False)
            module.register_parameter(attr, held[id(param)])


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


class LoraColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a LoRALinear: the weight and B split by output, A whole."""

    def _partition_linear_fn(self, name, module, device_mesh):
        _distribute(module, device_mesh, {"lora_A": Replicate()}, Shard(0))


class LoraRowwiseParallel(RowwiseParallel):
    """RowwiseParallel for a LoRALinear: the weight and A split by input, B and the bias whole."""

    def _partition_linear_fn(self, name, module, device_mesh):
        _distribute(module, device_mesh, {"lora_B": Replicate(), "bias": Replicate()}, Shard(1))


def _distribute(module: nn.Module, mesh, placements: dict, default) -> None:
    for key, param in list(module.named_parameters(recurse=False)):
        tensor = distribute_tensor(param, mesh, [placements.get(key, default)])
        module.register_parameter(key, nn.Parameter(tensor, requires_grad=param.requires_grad))


def lora_tp_plan(model: nn.Module, plan: dict) -> dict:
    """`plan` with the LoRA styles for the paths that name a LoRALinear (on a plain linear layer
    they place the weight and bias as torch's styles do)."""

    def any_lora(path: str) -> bool:
        return any(isinstance(m, LoRALinear) for name, m in model.named_modules()
                   if name and fnmatch(name, path))

    mapped = {}
    for path, style in plan.items():
        if type(style) in (ColwiseParallel, RowwiseParallel) and any_lora(path):
            kind = LoraColwiseParallel if type(style) is ColwiseParallel else LoraRowwiseParallel
            style = kind(input_layouts=style.input_layouts[0],
                         output_layouts=style.output_layouts[0],
                         use_local_output=style.use_local_output)
        mapped[path] = style
    return mapped
