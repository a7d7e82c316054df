"""An optimizer as the trainer knows it: an OptimizerSpec registered under the name `optim.name`
selects, like a model family's ModelSpec. It says how the optimizer is built over a model's
parameters, its config class (the keys every optimizer shares, and keys of its own), its rules, and
what the plan counts of it: the state it keeps per parameter element and the work of its step.

An optimizer defined outside trainer/ registers itself with `register_optimizer` in a module that
the config's `imports` names (the ranks import it before the config is typed)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.config.keys import nearest_key, schema_keys, wanted
from trainer.config.schema import OptimConfig
from trainer.errors import ConfigError
from trainer.models.spec import ModelSpec


@dataclass
class OptimizerInputs:
    """What an optimizer is built from: the parameter groups of the parameters it does not treat
    apart (decayed and not, one group per mesh: a foreach op takes DTensors of one mesh), those it
    treats apart (the spec's `apart`), its config, and the run's learning rate and weight decay."""

    groups: list[dict]
    apart: list[torch.Tensor]
    cfg: OptimConfig
    lr: float
    weight_decay: float
    device: torch.device | str
    # Global ranks -> their process group (ParallelDims.group_spanning): for an optimizer that
    # communicates on its own (Muon's exchange of matrix pieces).
    group_of: Callable


def _no_rules(cfg: OptimConfig) -> None:
    pass


def _fp32(cfg: OptimConfig, device_kind: str) -> torch.dtype:
    return torch.float32


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    build: Callable[[OptimizerInputs], torch.optim.Optimizer]
    config: type = OptimConfig  # OptimConfig, or a subclass declaring the keys of its own
    # its keys' rules: a ConfigError naming the key
    check: Callable[[OptimConfig], None] = _no_rules
    # The parameters it treats apart from the rest (name in the model, parameter, family): Muon's
    # block matrices. None: it treats every parameter alike.
    apart: Callable[[str, torch.Tensor, ModelSpec], bool] | None = None
    # optim.state_dtype's values it takes (its state held in that dtype)
    state_dtypes: tuple[str, ...] = ("float32",)
    # Whether its state saved at one of those precisions loads at another (a cast: AdamW's float32
    # and bfloat16 moments); float8's blocks never do.
    recasts_state: bool = True
    # words of state per parameter element: the rest, and those apart (AdamW's two moments: 2),
    # each of optim.state_dtype's bytes.
    state_words: float = 2.0
    apart_state_words: float = 2.0
    # Each matrix apart is updated whole, by the rank that owns it: the others send it their pieces
    # and take the update back (the plan counts what moves and the matrices a round holds).
    whole_matrices: bool = False
    # The step's work on one whole matrix apart (rows, cols, config -> FLOPs), and its dtype.
    matrix_flops: Callable[[int, int, OptimConfig], float] | None = None
    matrix_dtype: Callable[[OptimConfig, str], torch.dtype] = _fp32  # (config, device kind)
    step_work: str = ""  # what that work is, in words (plan.py's report)


class SkippingOptimizer(torch.optim.Optimizer):
    """A base for an optimizer of our own: step() runs the closure (torch's contract) and hands
    `update` the step guard's `found_inf` (a device tensor, 1: leave weights and state alone; None
    where no guard set one)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.update(getattr(self, "found_inf", None))
        return loss

    def update(self, skip: torch.Tensor | None) -> None:
        raise NotImplementedError


_REGISTRY: dict[str, OptimizerSpec] = {}


def register_optimizer(spec: OptimizerSpec) -> OptimizerSpec:
    _REGISTRY[spec.name] = spec
    return spec


def optimizers() -> list[str]:
    return sorted(_REGISTRY)


def optimizer_named(name: str) -> OptimizerSpec:
    if name not in _REGISTRY:
        raise ConfigError(f"optim.name={name} is unknown; choose one of {optimizers()} (or "
                          "register one in a module `imports` names)")
    return _REGISTRY[name]


def optimizer_of(cfg: OptimConfig) -> OptimizerSpec:
    """The optimizer a job's optim section selects."""
    return optimizer_named(cfg.name)


# (float8: a byte an element and one a block of 32, its scale's exponent)
STATE_BYTES = {"float32": 4, "bfloat16": 2, "float8": 1 + 1 / 32}


def check_state_dtype(cfg: OptimConfig) -> None:
    spec = optimizer_of(cfg)
    if cfg.state_dtype not in spec.state_dtypes:
        known = cfg.state_dtype in STATE_BYTES
        raise ConfigError(f"optim.state_dtype={cfg.state_dtype} "
                          + (f"is not optim.name={cfg.name}'s; it takes {list(spec.state_dtypes)}"
                             if known else f"is unknown; choose one of {list(STATE_BYTES)}"))


def state_bytes_bound(cfg: OptimConfig) -> float:
    """Bytes a parameter element costs at least: fp32 weight and gradient, and the smaller of its
    states (the search's first bound)."""
    spec = optimizer_of(cfg)
    words = min(spec.state_words,
                spec.apart_state_words if spec.apart is not None else spec.state_words)
    return 4.0 * 2 + STATE_BYTES[cfg.state_dtype] * words


def state_change(saved: dict, now: dict) -> str | None:
    """Why checkpoints saved under the flat config `saved` cannot resume under `now` (None: they
    can): one optimizer's state is not another's (AdamW's moments are not Muon's momentum)."""
    if saved.get("optim.name") != now.get("optim.name"):
        return (f"trained with optim.name={saved.get('optim.name')}, whose optimizer state "
                f"optim.name={now.get('optim.name')} cannot take")
    dtypes = [config.get("optim.state_dtype", "float32") for config in (saved, now)]
    spec = _REGISTRY.get(now.get("optim.name"))
    recasts = spec is not None and spec.recasts_state and "float8" not in dtypes
    if dtypes[0] != dtypes[1] and not recasts:
        return (f"trained with optim.state_dtype={dtypes[0]}, whose moments "
                f"optim.state_dtype={dtypes[1]} cannot take")
    return None


# Keys every optim section had before the optimizers declared their own (Muon's), with their
# defaults: a run's config.yaml or a checkpoint's written then reads as before.
RETIRED_OPTIM = {"momentum": 0.95, "nesterov": True, "ns_steps": 5, "ns_dtype": "auto",
                 "muon": {"rms_match": "match_rms_adamw"}}


def optimizer_config(node: DictConfig) -> OptimConfig:
    """The composed optim section as an instance of its optimizer's config class, every key checked
    against that class (a key it lacks: a did-you-mean line; a value of the wrong type: the line
    naming it)."""
    values = OmegaConf.to_container(node, resolve=True)
    name = values.get("name", OptimConfig.name)
    cls = optimizer_named(name).config
    keys = {f.name for f in dataclasses.fields(cls)}
    for key in [k for k in values if k not in keys]:
        if RETIRED_OPTIM.get(key, "no such key") == values[key]:
            del values[key]
            continue
        owners = [other for other, spec in sorted(_REGISTRY.items())
                  if key in {f.name for f in dataclasses.fields(spec.config)}]
        near = nearest_key(f"optim.{key}", schema_keys() | {f"optim.{k}" for k in keys})
        hint = (f"; it is optim={owners[0]}'s" if owners else f"; did you mean {near}?" if near
                else f"; optim.name={name} takes {sorted(keys)}")
        raise ConfigError(f"optim.{key} is not a config key (of optim.name={name}){hint}")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), values))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        value = OmegaConf.select(OmegaConf.create(values), key) if key else None
        raise ConfigError(f"optim.{key}={value} must be {wanted(cls, key)}") from None
