"""Hugging Face interop: transformers' directories (config.json + safetensors) to and from this
trainer's parameter names and model config. The config fields every decoder shares are read and
written here; each family's own fields and tensor names come from its spec's `hf` mapping.

Rotary embeddings: our attention rotates the two halves of each head ("rotate half"), as
transformers' Llama and Mixtral do, and lays heads out contiguously in the q/k/v projections'
rows, as they do, so q_proj and k_proj map over unchanged. (Meta's original checkpoints pair
adjacent dimensions instead; transformers' conversion permutes their q/k rows once into the
half-split layout, and its directories are what is read here.) The logit tests in
tests/test_hf.py hold both conventions equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from trainer.config.schema import ModelConfig, RopeScaling
from trainer.errors import ConfigError
from trainer.models import model_config, tied_names
from trainer.models.spec import HFMapping, families, family, family_by_hf_type


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


# The config.json keys every decoder this trainer reads has.
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
            "intermediate_size", "rms_norm_eps")


def read_config(path: Path) -> dict:
    """The config.json of the Hugging Face directory `path`: there, JSON, with the keys every
    decoder has."""
    file = path / "config.json"
    if not file.is_file():
        raise ConfigError(f"{path} is not a Hugging Face model directory: it has no config.json")
    try:
        hf = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not JSON ({e})") from None
    missing = [key for key in REQUIRED if key not in hf]
    if missing:
        raise ConfigError(f"{file} lacks {', '.join(missing)}: not the config of a model this "
                          "trainer reads")
    return hf


def config_from_hf(path: Path) -> ModelConfig:
    """Our model config for the Hugging Face model in directory `path`; unsupported features are
    errors."""
    hf = read_config(path)
    spec = family_by_hf_type(hf.get("model_type"))
    if spec is None:
        supported = ", ".join(s.hf.model_type for s in map(family, families()) if s.hf is not None)
        raise ConfigError(f"{path}/config.json: model_type={hf.get('model_type')} is not supported "
                          f"({supported})")
    architectures = hf.get("architectures") or [spec.hf.architecture]
    if spec.hf.architecture not in architectures:
        raise ConfigError(f"{path}/config.json: architectures={architectures} is not supported "
                          f"({spec.hf.architecture} for model_type={spec.hf.model_type})")
    # transformers 5 writes rope_parameters; earlier versions rope_theta and rope_scaling.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    unsupported = {"attention_bias": True, "mlp_bias": True}
    for key, bad in unsupported.items():
        if hf.get(key) == bad:
            raise ConfigError(f"{path}/config.json: {key}={bad} is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{path}/config.json: hidden_act={hf['hidden_act']} is not supported "
                          "(silu)")
    fields = dict(
        family=spec.family, name=path.name, dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        vocab_size=hf["vocab_size"], ffn_dim=hf["intermediate_size"], norm_eps=hf["rms_norm_eps"],
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_scaling=_rope_scaling_from_hf(rope, path),
        max_seq_len=hf.get("max_position_embeddings", 2048),
        tie_embeddings=bool(hf.get("tie_word_embeddings")),
    )
    return model_config(fields | _family_fields(spec, hf, path))


def _family_fields(spec, hf: dict, path: Path) -> dict:
    """The family's own fields (overriding the shared ones it reads otherwise, e.g. an MoE's expert
    width)."""
    try:
        return spec.hf.config_fields(hf)
    except KeyError as e:
        raise ConfigError(f"{path}/config.json lacks {e.args[0]}: not a {spec.family} "
                          "config") from None
    except ConfigError as e:
        raise ConfigError(f"{path}/{e}") from None


# Our RopeScaling fields -> Hugging Face's rope_parameters
# keys, per rope type (without a default: required).
ROPE_KEYS = {
    "llama3": {"factor": "factor", "low_freq_factor": "low_freq_factor",
               "high_freq_factor": "high_freq_factor",
               "original_max_seq_len": "original_max_position_embeddings"},
    "yarn": {"factor": "factor", "original_max_seq_len": "original_max_position_embeddings",
             "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale",
             "mscale_all_dim": "mscale_all_dim"},
}
# What a missing or null YaRN key means to transformers.
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}


def _rope_scaling_from_hf(rope: dict, path: Path) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ROPE_KEYS:
        raise ConfigError(f"{path}/config.json: rope type {kind} is not supported (default, "
                          f"{', '.join(ROPE_KEYS)})")
    if rope.get("attention_factor") is not None or rope.get("truncate", True) is not True:
        raise ConfigError(f"{path}/config.json: rope type {kind} with attention_factor or "
                          "truncate=false is not supported")
    fields = {}
    for ours, theirs in ROPE_KEYS[kind].items():
        value = rope.get(theirs)
        if value is None and ours not in YARN_DEFAULTS:
            raise ConfigError(f"{path}/config.json: rope type {kind} needs {theirs}")
        fields[ours] = YARN_DEFAULTS[ours] if value is None else value
    return RopeScaling(type=kind, **fields)


def _rope_parameters(cfg: ModelConfig) -> dict:
    """Hugging Face's rope_parameters (rope_scaling before transformers 5) for our model config."""
    r = cfg.rope_scaling
    if r is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {"rope_type": r.type, "rope_theta": cfg.rope_theta,
            **{theirs: getattr(r, ours) for ours, theirs in ROPE_KEYS[r.type].items()}}


def hf_mapping(cfg: ModelConfig) -> HFMapping:
    mapping = family(cfg.family).hf
    if mapping is None:
        raise ConfigError(f"model.family={cfg.family} has no Hugging Face mapping")
    return mapping


def hf_config(cfg: ModelConfig):
    """A transformers config object for our model config."""
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, rms_norm_eps=cfg.norm_eps,
        max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters=_rope_parameters(cfg), hidden_act="silu",
    )
    return hf_mapping(cfg).config(cfg, common)


def read_hf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model config and full weights (under our names) of a Hugging Face directory."""
    from safetensors import safe_open

    cfg = config_from_hf(path)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            tensors |= {key: f.get_tensor(key) for key in f.keys()}

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ConfigError(f"{path} has no tensor {name}: not a {cfg.family} checkpoint of this "
                              "shape")
        return tensors[name]

    weights = {ours: take(hf) if isinstance(hf, str) else torch.stack([take(name) for name in hf])
               for ours, hf in hf_sources(cfg).items()}
    for alias, name in tied_names(cfg).items():
        weights[alias] = weights[name]
    return cfg, weights


def hf_sources(cfg: ModelConfig) -> dict[str, str | list[str]]:
    """Our weight name -> the Hugging Face tensor it is, or for a tensor we stack (experts) the list
    of its tensors in stacking order."""
    return dict(hf_mapping(cfg).names(cfg))


def hf_tensors(cfg: ModelConfig) -> list[tuple[str, str, int | None]]:
    """Every tensor of the Hugging Face model, in its order: (its name, our name, and the expert's
    index in our stacked tensor, or None)."""
    entries = []
    for ours, hf in hf_sources(cfg).items():
        entries += ([(hf, ours, None)] if isinstance(hf, str)
                    else [(name, ours, e) for e, name in enumerate(hf)])
    return sorted(entries, key=lambda entry: _layer_order(entry[0]))


def _layer_order(hf_name: str) -> tuple[int, str]:
    """Embedding first, then the layers in number order, then the final norm and head."""
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"]:
        return int(parts[2]), hf_name
    return (-1 if "embed" in hf_name else 1 << 30), hf_name


def write_hf_config(cfg: ModelConfig, out: Path, dtype: torch.dtype) -> None:
    """config.json for our model config, stating the weights' dtype, readable by transformers 4 and
    5."""
    config = hf_config(cfg)
    config.architectures = [hf_mapping(cfg).architecture]
    config.save_pretrained(out)
    path = out / "config.json"
    written = json.loads(path.read_text())
    # transformers 5 reads (and writes) only rope_parameters and dtype; earlier versions read
    # rope_theta, rope_scaling and torch_dtype: write both forms, the same values.
    rope = _rope_parameters(cfg)
    written["rope_theta"] = cfg.rope_theta
    written["rope_scaling"] = (None if cfg.rope_scaling is None
                               else {k: v for k, v in rope.items() if k != "rope_theta"})
    written["dtype"] = written["torch_dtype"] = str(dtype).removeprefix("torch.")
    path.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
