"""The rules of the peft section: LoRA's keys, the layers its patterns name, and what it does not
combine with."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import torch
from omegaconf import OmegaConf

from trainer.checkpoint.folders import (
    ADAPTER_CONFIG,
    MANIFEST,
    CheckpointError,
    adapter_layers,
    check_same_method,
    checkpoint_steps,
)
from trainer.checkpoint.metadata import SafeReader
from trainer.config.schema import JobConfig, PeftConfig
from trainer.errors import ConfigError
from trainer.models import build_model, family
from trainer.models.lora import matches, targets
from trainer.models.nf4 import misfit
from trainer.parallel.dims import ParallelDims

METHODS = ("lora",)
BASE_DTYPES = ("nf4",)


def check_peft(job: JobConfig) -> dict[str, torch.Size]:
    """peft.* alone, then against the model (its linear layers) and the other sections; returns
    the weight shapes of the layers that take adapters (none without peft.method)."""
    peft = job.peft
    if peft.method is None:
        changed = [f.name for f in dataclasses.fields(PeftConfig)
                   if getattr(peft, f.name) != getattr(PeftConfig(), f.name)]
        if changed:
            raise ConfigError(f"peft.{changed[0]}={getattr(peft, changed[0])} is set but "
                              "peft.method is not: add peft.method=lora (null: every weight "
                              "trains)")
        return {}
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
    return check_targets(job)


def check_qlora(job: JobConfig, dims: ParallelDims, shapes: dict[str, torch.Size]) -> None:
    """QLoRA's 4-bit base is sharded by FSDP alone (by rows, whole 4-bit blocks to each rank);
    `shapes`: the adapted layers' weights (check_peft's)."""
    if job.peft.base_dtype != "nf4":
        return
    if dims.tp_enabled:
        raise ConfigError(f"peft.base_dtype=nf4 does not combine with parallel.tp={dims.tp}: the "
                          "4-bit base splits by rows under FSDP (with pp, cp, ep and HSDP), not "
                          "by tensor parallel's columns; use parallel.tp=1 or peft.base_dtype=null")
    shards = dims.dp_shard * dims.cp
    for name, shape in shapes.items():
        why = misfit(shape, shards)
        if why is not None:
            raise ConfigError(f"peft.base_dtype=nf4 cannot hold {name} in 4 bits over "
                              f"dp_shard*cp={shards} ranks: {why}")


def check_peft_checkpoints(job: JobConfig) -> None:
    """The checkpoints a run starts from against its method: a LoRA checkpoint resumes only as
    LoRA and a full one only as a full fine-tune; a LoRA checkpoint as checkpoint.initial holds the
    adapters this run trains (rank, alpha, layers)."""
    cfg, adapted = job.checkpoint, job.peft.method is not None
    if cfg.resume not in ("auto", "none"):
        resumed = _a_step(Path(cfg.resume))
        check_same_method(resumed, adapted)
        if adapted:
            _check_same_adapters(resumed, job.peft)
    initial = _a_step(Path(cfg.initial)) if cfg.initial else None
    if initial is None or not (initial / ADAPTER_CONFIG).is_file():
        return
    if not adapted:
        raise CheckpointError(f"checkpoint.initial={cfg.initial} holds LoRA adapters: train on "
                              "from them with peft.method=lora, or merge them into their base "
                              "first (scripts/convert_hf.py --merge)")
    layers, recorded = sorted(check_targets(job)), OmegaConf.load(initial / ADAPTER_CONFIG)
    saved = adapter_layers(k.removeprefix("model.") for k in
                           SafeReader(initial).read_metadata().state_dict_metadata
                           if k.startswith("model."))
    peft = job.peft
    if saved != layers or (peft.rank, peft.alpha) != (recorded.rank, recorded.alpha):
        raise CheckpointError(
            f"checkpoint.initial={initial} holds rank-{recorded.rank}, alpha-{recorded.alpha:g} "
            f"adapters on {len(saved)} layers ({_kinds(saved)}); this model's are rank "
            f"{peft.rank}, alpha {peft.alpha:g} on {len(layers)} ({_kinds(layers)}): set "
            "peft.rank, peft.alpha and peft.target_modules to its")


def _check_same_adapters(path: Path, peft: PeftConfig) -> None:
    """A LoRA checkpoint resumes only with the adapters' shape it trained with."""
    recorded = OmegaConf.to_container(OmegaConf.load(path / ADAPTER_CONFIG))
    if not isinstance(recorded, dict):
        raise CheckpointError(f"{path / ADAPTER_CONFIG} is not an adapter config this trainer "
                              "wrote")
    changed = [f"peft.{key}={recorded.get(key)} -> {getattr(peft, key)}"
               for key in ("rank", "target_modules") if recorded.get(key) != getattr(peft, key)]
    if changed:
        raise CheckpointError(f"checkpoint.resume={path} holds adapters of another shape "
                              f"({', '.join(changed)}): resume it with the peft keys it trained "
                              "with")


def _a_step(path: Path) -> Path:
    """`path` when it is a checkpoint; for a run's folder, its newest step (the method of a run's
    checkpoints is one)."""
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = checkpoint_steps(folder)
    return path if (path / MANIFEST).is_file() or not steps else steps[-1][1]


def check_targets(job: JobConfig) -> dict[str, torch.Size]:
    """Every pattern names a linear layer of the blocks, and the rank fits each layer it names;
    returns the weight shapes of the layers the patterns name."""
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
    shapes = {name: model.get_submodule(name).weight.shape
              for name in targets(model, patterns, spec.blocks)}
    for name, (out_features, in_features) in shapes.items():
        if peft.rank > min(in_features, out_features):
            raise ConfigError(f"peft.rank={peft.rank} is above the width of {name} "
                              f"({in_features} -> {out_features}): choose at most "
                              f"{min(in_features, out_features)}")
    return shapes


def _listed(pattern: str | tuple[str, ...]) -> tuple[str, ...]:
    return pattern if isinstance(pattern, tuple) else (pattern,)


def _kinds(layers) -> str:
    return ", ".join(sorted({name.rpartition(".")[2] for name in layers}))
