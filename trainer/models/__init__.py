"""Model construction and an initialisation that does not depend on the parallel layout."""

from __future__ import annotations

import zlib
from collections.abc import Mapping

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from trainer.config import ModelConfig, load_model_config
from trainer.errors import ConfigError
from trainer.models.llama import Llama
from trainer.models.mixtral import Mixtral

MODEL_CLASSES = {"llama": Llama, "mixtral": Mixtral}


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
    if cfg.family not in MODEL_CLASSES:
        raise ConfigError(f"model.family={cfg.family} is unknown; choose one of {sorted(MODEL_CLASSES)}")
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.family](cfg)
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
    same whatever the sharding: the condition for parity between layouts.
    """
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
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
    local = param.to_local() if isinstance(param, DTensor) else param
    full = full.to(device=local.device, dtype=local.dtype)
    if isinstance(param, DTensor):
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    local.copy_(full)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
