"""A LoRA checkpoint out: as a PEFT adapter directory (`adapter_config.json` and
`adapter_model.safetensors` under peft's tensor names) that `peft.PeftModel.from_pretrained` loads
on the transformers model, or folded into its base as a whole Hugging Face model (merged); and a
PEFT adapter directory in, as a LoRA checkpoint of ours to train on (`checkpoint.initial`).

The adapters are small (the checkpoint's own tensors, read whole); a merge holds the base's
weights in host memory, one model in fp32.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from trainer.checkpoint.folders import ADAPTER_CONFIG, CheckpointError, adapter_layers, verify
from trainer.checkpoint.hf import config_from_hf, hf_sources, is_hf_dir
from trainer.checkpoint.hf_export import CachingReader, read_saved, write_hf
from trainer.checkpoint.state import load_weights, save_weights
from trainer.config.schema import ModelConfig
from trainer.models import build_model, materialize
from trainer.models.lora import is_adapter
from trainer.safe_write import check_new_output

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def read_adapters(checkpoint: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The peft keys a LoRA checkpoint trained with (and its base) and its adapters, whole, under
    our names."""
    if not (checkpoint / ADAPTER_CONFIG).is_file():
        raise CheckpointError(f"{checkpoint} holds no LoRA adapters (no {ADAPTER_CONFIG})")
    if (problem := verify(checkpoint)) is not None:
        raise CheckpointError(f"{checkpoint} is not a usable checkpoint: {problem}")
    reader = CachingReader(checkpoint)
    saved = reader.read_metadata().state_dict_metadata
    adapters = {key.removeprefix("model."): read_saved(reader, key.removeprefix("model."), meta)
                for key, meta in saved.items()
                if key.startswith("model.") and is_adapter(key)}
    return OmegaConf.to_container(OmegaConf.load(checkpoint / ADAPTER_CONFIG)), adapters


def peft_name(cfg: ModelConfig, ours: str, sources: dict | None = None) -> str:
    """peft's name of one of our adapters: layers.0.attention.wq.lora_A ->
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight."""
    sources = sources or hf_sources(cfg)
    layer, _, which = ours.rpartition(".")
    return f"base_model.model.{sources[layer + '.weight'].removesuffix('.weight')}.{which}.weight"


def export_peft(checkpoint: Path, cfg: ModelConfig, out: Path,
                dtype: torch.dtype = torch.float32, base: str | None = None) -> int:
    """Writes a LoRA checkpoint's adapters as a PEFT adapter directory `out`; returns how many
    layers take adapters."""
    check_new_output(out)
    peft, adapters = read_adapters(checkpoint)
    sources = hf_sources(cfg)
    tensors = {peft_name(cfg, ours, sources): t.to(dtype).contiguous()
               for ours, t in adapters.items()}
    layers = sorted({name.removesuffix(".lora_A.weight").removesuffix(".lora_B.weight")
                     for name in tensors})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": peft["rank"],
        "lora_alpha": peft["alpha"], "lora_dropout": peft["dropout"], "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True,
        # every layer by its whole name (without peft's base_model.model. prefix)
        "target_modules": [name.removeprefix("base_model.model.") for name in layers],
        "base_model_name_or_path": base or peft.get("base"),
    }
    out.mkdir(parents=True)
    save_file(tensors, out / PEFT_WEIGHTS, metadata={"format": "pt"})
    (out / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return len(layers)


def check_base(given: str | None, recorded: str | None, what: str, force: bool = False) -> None:
    """--base against the base `what` (an adapter) records: another folder of this machine is
    refused (adapters trained on other weights would be applied to these), unless `force`; a base
    recorded that is not here cannot be compared, and is said to be so."""
    if given is None or recorded is None or Path(given).resolve() == Path(recorded).resolve():
        return
    if not Path(recorded).exists():
        print(f"note: {what} records its base as {recorded}, which is not here; --base {given} "
              "is taken as that base", file=sys.stderr)
        return
    said = f"--base {given} is not the base {what} was trained on ({recorded})"
    if not force:
        raise CheckpointError(f"{said}: its adapters would be applied to other weights; give "
                              "that base, or add --force to use this one anyway")
    print(f"warning: {said}; --force: using it anyway", file=sys.stderr)


def export_merged(checkpoint: Path, cfg: ModelConfig, out: Path, base: str | None,
                  dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 5 * 10**9,
                  force: bool = False) -> int:
    """Writes the LoRA checkpoint's base with its adapters folded in (W + alpha / rank * B A, in
    fp32) as a Hugging Face directory `out`; returns the number of shards. A `base` other than the
    one it trained on is refused unless `force` (check_base)."""
    peft, adapters = read_adapters(checkpoint)
    check_base(base, peft.get("base"), str(checkpoint), force)
    base = base or peft.get("base")
    if base is None:
        raise CheckpointError(f"{checkpoint} was trained on the seed's base, not on weights of "
                              "record; name the base with --base PATH")
    model = build_model(cfg, device="meta")
    materialize(model, "cpu")
    load_weights(model, Path(base), key="--base")
    weights = dict(model.state_dict())
    scale = peft["alpha"] / peft["rank"]
    for ours in [name for name in adapters if name.endswith("lora_A")]:
        layer = ours.removesuffix(".lora_A")
        a, b = adapters[ours].float(), adapters[f"{layer}.lora_B"].float()
        weights[f"{layer}.weight"] = weights[f"{layer}.weight"].float() + scale * (b @ a)
    return write_hf(lambda name: list(weights[name].shape), weights.__getitem__, cfg, out, dtype,
                    max_shard_bytes)


def import_peft(adapter_dir: Path, out: Path, base: str | None = None,
                force: bool = False) -> int:
    """Writes the PEFT LoRA adapter in `adapter_dir` as a LoRA checkpoint `out` of ours on its base
    (`base`, default its base_model_name_or_path: a Hugging Face directory); returns how many
    layers take adapters. `checkpoint.initial=out` with the same peft keys trains on from it.
    Adapters that do not fit the base's layers are refused; so is a `base` other than a local one
    it names, unless `force` (check_base)."""
    config = json.loads((adapter_dir / PEFT_CONFIG).read_text())
    unlike = {"peft_type": "LORA", "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "use_dora": False}
    for key, ours in unlike.items():
        if config.get(key, ours) != ours:
            raise CheckpointError(f"{adapter_dir}: {PEFT_CONFIG} has {key}={config[key]}; only "
                                  f"plain LoRA ({key}={ours}) imports")
    check_base(base, config.get("base_model_name_or_path"), str(adapter_dir), force)
    base = base or config.get("base_model_name_or_path")
    if base is None or not is_hf_dir(Path(base)):
        raise CheckpointError(f"{adapter_dir}'s base {base} is not a Hugging Face directory here; "
                              "name it with --base PATH")
    cfg = config_from_hf(Path(base))
    sources = hf_sources(cfg)
    ours_of = {peft_name(cfg, f"{layer.removesuffix('.weight')}.{which}", sources):
               f"{layer.removesuffix('.weight')}.{which}"
               for layer, source in sources.items() if isinstance(source, str)
               for which in ("lora_A", "lora_B")}
    tensors = load_file(adapter_dir / PEFT_WEIGHTS)
    unknown = sorted(set(tensors) - set(ours_of))
    if unknown:
        raise CheckpointError(f"{adapter_dir}: {unknown[0]} is no linear layer of a "
                              f"{cfg.family} model's blocks ({len(unknown)} such)")
    weights = {ours_of[name]: t.float().contiguous() for name, t in tensors.items()}
    layers = adapter_layers(weights)
    _check_fits(weights, layers, cfg, f"{adapter_dir}'s adapters do not fit the base {base}")
    kinds = sorted({layer.rpartition(".")[2] for layer in layers})
    # the layers by their last names where every block has the same ones, else whole
    every = len(layers) == len(kinds) * len({layer.split(".")[1] for layer in layers})
    adapter = {"method": "lora", "rank": config["r"], "alpha": float(config["lora_alpha"]),
               "dropout": float(config.get("lora_dropout", 0.0)),
               "target_modules": kinds if every else layers, "base": str(base)}
    save_weights(cfg, weights, out, adapter=adapter)
    return len(layers)


def _check_fits(weights: dict[str, torch.Tensor], layers: list[str], cfg: ModelConfig,
                said: str) -> None:
    """Each layer's lora_A [rank, in] and lora_B [out, rank] against the layer's weight [out, in]
    in a model of `cfg`."""
    model = build_model(cfg, device="meta")
    for layer in layers:
        out_features, in_features = model.get_submodule(layer).weight.shape
        a, b = weights.get(f"{layer}.lora_A"), weights.get(f"{layer}.lora_B")
        if a is None or b is None:
            raise CheckpointError(f"{said}: {layer} has only one of lora_A and lora_B")
        if (a.shape[1], b.shape[0], a.shape[0]) != (in_features, out_features, b.shape[1]):
            raise CheckpointError(f"{said}: {layer} is {in_features} -> {out_features} there, "
                                  f"the adapter's {a.shape[1]} -> {b.shape[0]} (rank "
                                  f"{a.shape[0]}); name its base with --base PATH")
