"""The rules of the peft section: LoRA's keys, the layers its patterns name, and what it does not
combine with."""

from __future__ import annotations

import dataclasses
import importlib.util

from trainer.config.schema import JobConfig, PeftConfig
from trainer.errors import ConfigError
from trainer.models import build_model, family
from trainer.models.lora import matches, targets
from trainer.models.nf4 import misfit
from trainer.parallel.dims import ParallelDims

METHODS = ("lora",)
BASE_DTYPES = ("nf4",)


def check_peft(job: JobConfig) -> None:
    """peft.* alone, then against the model (its linear layers) and the other sections."""
    peft = job.peft
    if peft.method is None:
        changed = [f.name for f in dataclasses.fields(PeftConfig)
                   if getattr(peft, f.name) != getattr(PeftConfig(), f.name)]
        if changed:
            raise ConfigError(f"peft.{changed[0]}={getattr(peft, changed[0])} is set but "
                              "peft.method is not: add peft.method=lora (null: every weight "
                              "trains)")
        return
    if peft.method not in METHODS:
        raise ConfigError(f"peft.method={peft.method} is unknown; choose one of {list(METHODS)} "
                          "(null: every weight trains)")
    if peft.rank < 1:
        raise ConfigError(f"peft.rank={peft.rank} must be at least 1")
    if peft.alpha <= 0:
        raise ConfigError(f"peft.alpha={peft.alpha} must be above 0")
    if not 0 <= peft.dropout < 1:
        raise ConfigError(f"peft.dropout={peft.dropout} must be in [0, 1)")
    if job.optim.name != "adamw":
        why = (": Muon orthogonalizes a layer's whole update, and an adapter's update is two thin "
               "factors of one" if job.optim.name == "muon" else "")
        raise ConfigError(f"peft.method=lora trains its adapters with optim.name=adamw, not "
                          f"optim.name={job.optim.name}{why}")
    if job.training.float8.enabled:
        raise ConfigError("peft.method=lora does not combine with training.float8.enabled=true: "
                          "the adapters' layers stay in high precision; set one of them")
    if peft.base_dtype is not None and peft.base_dtype not in BASE_DTYPES:
        raise ConfigError(f"peft.base_dtype={peft.base_dtype} is unknown; choose nf4 (QLoRA) or "
                          "null (the compute dtype)")
    if peft.base_dtype == "nf4" and importlib.util.find_spec("torchao") is None:
        raise ConfigError("peft.base_dtype=nf4 needs torchao's NF4 tensor: "
                          "pip install -e \".[qlora]\"")
    check_targets(job)


def check_qlora(job: JobConfig, dims: ParallelDims) -> None:
    """QLoRA's 4-bit base is sharded by FSDP alone (by rows, whole 4-bit blocks to each rank)."""
    if job.peft.base_dtype != "nf4":
        return
    if dims.tp_enabled:
        raise ConfigError(f"peft.base_dtype=nf4 does not combine with parallel.tp={dims.tp}: the "
                          "4-bit base splits by rows under FSDP (with pp, cp, ep and HSDP), not "
                          "by tensor parallel's columns; use parallel.tp=1 or peft.base_dtype=null")
    spec, shards = family(job.model.family), dims.dp_shard * dims.cp
    model = build_model(job.model, device="meta")
    for name in targets(model, job.peft.target_modules or list(spec.lora_targets), spec.blocks):
        why = misfit(model.get_submodule(name).weight.shape, shards)
        if why is not None:
            raise ConfigError(f"peft.base_dtype=nf4 cannot hold {name} in 4 bits over "
                              f"dp_shard*cp={shards} ranks: {why}")


def check_targets(job: JobConfig) -> None:
    """Every pattern names a linear layer of the blocks, and the rank fits each layer it names."""
    peft, spec = job.peft, family(job.model.family)
    model = build_model(job.model, device="meta")
    layers = targets(model, ["*"], spec.blocks)
    kinds = ", ".join(sorted({name.rpartition(".")[2] for name in layers}))
    # each pattern a user gives must name a layer; the family's, one of them
    given = peft.target_modules or [spec.lora_targets]
    for pattern in given:
        if not any(matches(name, p) for name in layers for p in _listed(pattern)):
            raise ConfigError(f"peft.target_modules: {pattern} matches no linear layer of "
                              f"model.family={job.model.family}'s blocks (theirs: {kinds}, as "
                              "layers.0.attention.wq)")
    patterns = peft.target_modules or list(spec.lora_targets)
    for name in targets(model, patterns, spec.blocks):
        layer = model.get_submodule(name)
        width = min(layer.in_features, layer.out_features)
        if peft.rank > width:
            raise ConfigError(f"peft.rank={peft.rank} is above the width of {name} "
                              f"({layer.in_features} -> {layer.out_features}): choose at most "
                              f"{width}")


def _listed(pattern: str | tuple[str, ...]) -> tuple[str, ...]:
    return pattern if isinstance(pattern, tuple) else (pattern,)
