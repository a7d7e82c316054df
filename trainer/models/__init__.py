"""Model families, their registry, and model construction with an initialisation that does not
depend on the parallel layout.

A family is a folder (trainer/models/<family>/) whose package registers one ModelSpec; a family
defined elsewhere registers itself the same way, with `register_family`, before the job is built."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import pkgutil
import zlib
from collections.abc import Mapping

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from trainer.config.files import load_model_file
from trainer.config.keys import wanted
from trainer.config.schema import ModelConfig
from trainer.errors import ConfigError
from trainer.models.lora import adapter_std, is_adapter
from trainer.models.nf4 import copy_full_nf4, is_nf4
from trainer.models.spec import ModelSpec, families, family, register_family
from trainer.tensors import local_tensor

__all__ = ["ModelSpec", "build_model", "count_params", "families", "family", "import_modules",
           "init_weights", "materialize", "model_config", "register_family", "tied_names"]


def import_modules(names: list[str]) -> None:
    """Imports the modules `names` (the config's `imports`), in which families register
    themselves."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"imports: {name} cannot be imported ({e}); give a module on the "
                              "Python path") from None


def model_config(spec: str | Mapping | ModelConfig) -> ModelConfig:
    """A model config from a config name (configs/model/NAME.yaml), a mapping of model keys, or a
    ModelConfig: an instance of its family's config class, every key checked against that class (a
    key it lacks: a did-you-mean line; a value of the wrong type: the line naming it)."""
    if isinstance(spec, ModelConfig):
        return spec
    node = load_model_file(spec) if isinstance(spec, str) else spec
    values = OmegaConf.to_container(node) if isinstance(node, DictConfig) else dict(node)
    name = values.get("family", ModelConfig.family)
    cls = family(name).config
    keys = {f.name for f in dataclasses.fields(cls)}
    for key in [k for k in values if k not in keys]:
        if RETIRED.get(key, "no such key") == values[key]:
            del values[key]  # a config written before the family declared its own keys
        else:
            raise ConfigError(_unknown_key(key, name, keys))
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), values))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        value = values.get(key.split(".")[0])
        raise ConfigError(f"model.{key}={value} must be {wanted(cls, key)}") from None


# Keys every model config had before the families declared their own, with the value that meant
# "not used": a saved config (a checkpoint's, a run's config.yaml) or an old config file holding
# them at that value reads as before.
RETIRED = {"head_dim": None, "n_experts": 0, "top_k": 0, "aux_loss_coef": 0.0, "z_loss_coef": 0.0,
           "capacity_factor": None, "route_score": "softmax", "route_norm": True,
           "route_scale": 1.0, "n_shared_experts": 0, "n_expert_groups": 1, "top_groups": 1,
           "bias_update_speed": 0.0}


def _unknown_key(key: str, name: str, keys: set[str]) -> str:
    """A key the family `name` does not declare: the nearest it does, or the families that have
    it."""
    near = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.6)
    if near:
        return f"model.{key} is not a key of model.family={name}; did you mean model.{near[0]}?"
    others = [f for f in families()
              if key in {k.name for k in dataclasses.fields(family(f).config)}]
    if others:
        return (f"model.{key} is not a key of model.family={name}; it is one of "
                f"model.family={' or '.join(others)}")
    shared = {f.name for f in dataclasses.fields(ModelConfig)}
    return (f"model.{key} is not a key of model.family={name}; its keys: "
            f"{', '.join(sorted(keys - shared) or ['the shared ones'])}")


def build_model(spec: str | Mapping | ModelConfig, *, device: str | torch.device = "cpu",
                seed: int = 0) -> nn.Module:
    """A plain nn.Module in fp32. On "meta" it is left uninitialised, to be sharded first."""
    cfg = model_config(spec)
    with torch.device("meta"):
        model = family(cfg.family).model(cfg)
    if torch.device(device).type != "meta":
        materialize(model, device)
        init_weights(model, seed)
    return model


def materialize(model: nn.Module, device: str | torch.device,
                params_on: str | torch.device | None = None) -> None:
    """Allocates a meta model's storage on `device` (its parameters on `params_on` where given:
    the host, for FSDP's offload), keeping tied parameters tied.

    `to_empty` gives every module a fresh Parameter, which unties e.g. the embedding and output.
    """
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, attr))
    model.to_empty(device=params_on or device)
    if params_on is not None:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.to(device))
    for (first, first_attr), *others in owners.values():
        for module, attr in others:
            setattr(module, attr, getattr(first, first_attr))


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Fills every parameter from a generator seeded by (seed, parameter name).

    Each full tensor is drawn whole and each rank keeps its own shard of it, so the model is the
    same whatever the sharding: the condition for parity between layouts. LoRA's adapters start
    as peft's do (trainer.models.lora.adapter_std). Buffers (the MoE layers'
    expert biases) start at zero.
    """
    for buffer in model.buffers():
        buffer.zero_()
    for name, param in model.named_parameters():
        # drawn on the compute device, wherever the shard lives (the host, under FSDP's offload):
        # the same values either way
        device = (param.device_mesh.device_type if isinstance(param, DTensor)
                  else local_tensor(param).device)
        full = torch.empty(param.shape, dtype=param.dtype, device=device)
        std = adapter_std(name, param.shape) if is_adapter(name) else model.init_std(name)
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
    if is_nf4(local):
        copy_full_nf4(param, full)
        return
    full = full.to(device=local.device, dtype=local.dtype)
    if isinstance(param, DTensor):
        full = distribute_tensor(full, param.device_mesh, param.placements,
                                 src_data_rank=None).to_local()
    local.copy_(full)


def tied_names(cfg: ModelConfig) -> dict[str, str]:
    """Each name of a parameter shared with an earlier one (a tied output head) -> that one's
    name."""
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
