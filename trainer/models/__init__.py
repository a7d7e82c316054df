"""Model families, their registry, and model construction with an initialisation that does not
depend on the parallel layout.

A family is a folder (trainer/models/<family>/) whose package registers one ModelSpec; a family
defined elsewhere registers itself the same way, with `register_family`, before the job is built."""

from __future__ import annotations

import importlib
import pkgutil
import zlib
from collections.abc import Mapping

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from trainer.config import ModelConfig
from trainer.config_files import load_model_config
from trainer.errors import ConfigError
from trainer.models.spec import ModelSpec, families, family, register_family
from trainer.tensors import local_tensor

__all__ = ["ModelSpec", "build_model", "count_params", "families", "family", "import_modules", "init_weights",
           "materialize", "model_config", "register_family", "tied_names"]


def import_modules(names: list[str]) -> None:
    """Imports the modules `names` (the config's `imports`), in which families register themselves."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"imports: {name} cannot be imported ({e}); give a module on the Python path") from None


def model_config(spec: str | Mapping | ModelConfig) -> ModelConfig:
    """A ModelConfig from a config name (configs/model/NAME.yaml), a mapping, or a ModelConfig."""
    if isinstance(spec, ModelConfig):
        return spec
    if isinstance(spec, str):
        return load_model_config(spec)
    node = spec if isinstance(spec, DictConfig) else OmegaConf.create(dict(spec))
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), node))


def build_model(spec: str | Mapping | ModelConfig, *, device: str | torch.device = "cpu", seed: int = 0) -> nn.Module:
    """A plain nn.Module in fp32. On "meta" it is left uninitialised, to be sharded first."""
    cfg = model_config(spec)
    with torch.device("meta"):
        model = family(cfg.family).model(cfg)
    if torch.device(device).type != "meta":
        materialize(model, device)
        init_weights(model, seed)
    return model


def materialize(model: nn.Module, device: str | torch.device) -> None:
    """Allocates a meta model's storage on `device`, keeping tied parameters tied.

    `to_empty` gives every module a fresh Parameter, which unties e.g. the embedding and output.
    """
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, attr))
    model.to_empty(device=device)
    for (first, first_attr), *others in owners.values():
        for module, attr in others:
            setattr(module, attr, getattr(first, first_attr))


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Fills every parameter from a generator seeded by (seed, parameter name).

    Each full tensor is drawn whole and each rank keeps its own shard of it, so the model is the
    same whatever the sharding: the condition for parity between layouts. Buffers (the MoE layers'
    expert biases) start at zero.
    """
    for buffer in model.buffers():
        buffer.zero_()
    for name, param in model.named_parameters():
        local = local_tensor(param)
        full = torch.empty(param.shape, dtype=param.dtype, device=local.device)
        std = model.init_std(name)
        if std is None:
            full.fill_(1.0)
        else:
            generator = torch.Generator(device=full.device)
            generator.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            full.normal_(0.0, std, generator=generator)
        copy_full(param, full)


def copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Sets a parameter (a plain tensor, or this rank's shard of a DTensor) from its full value."""
    local = local_tensor(param)
    full = full.to(device=local.device, dtype=local.dtype)
    if isinstance(param, DTensor):
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    local.copy_(full)


def tied_names(cfg: ModelConfig) -> dict[str, str]:
    """Each name of a parameter shared with an earlier one (a tied output head) -> that one's name."""
    first: dict[int, str] = {}
    tied = {}
    for name, param in build_model(cfg, device="meta").named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        first.setdefault(id(param), name)
    return tied


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# Every folder here is a family whose package registers itself.
for _family in pkgutil.iter_modules(__path__):
    if _family.ispkg:
        importlib.import_module(f"{__name__}.{_family.name}")
