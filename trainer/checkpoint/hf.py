"""Hugging Face interop: transformers' Llama and Mixtral directories (config.json + safetensors)
to and from this trainer's parameter names and model config.

Rotary embeddings: our attention rotates the two halves of each head ("rotate half"), as
transformers' Llama and Mixtral do, and lays heads out contiguously in the q/k/v projections'
rows, as they do, so q_proj and k_proj map over unchanged. (Meta's original checkpoints pair
adjacent dimensions instead; transformers' conversion permutes their q/k rows once into the
half-split layout, and its directories are what is read here.) The logit tests in
tests/test_hf.py hold both conventions equal. Mixtral's experts are stored one tensor per expert
(block_sparse_moe.experts.E.w1/w2/w3, the layout on disk of every transformers version); ours are
stacked along a first experts dimension.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from trainer.config import ModelConfig, RopeScaling
from trainer.errors import ConfigError


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def config_from_hf(path: Path) -> ModelConfig:
    """Our model config for the Hugging Face model in directory `path`; unsupported features are errors."""
    hf = json.loads((path / "config.json").read_text())
    family = {"llama": "llama", "mixtral": "mixtral"}.get(hf.get("model_type"))
    if family is None:
        raise ConfigError(f"{path}/config.json: model_type={hf.get('model_type')} is not supported (llama, mixtral)")
    # transformers 5 writes rope_parameters; earlier versions rope_theta and rope_scaling.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    unsupported = {"attention_bias": True, "mlp_bias": True}
    for key, bad in unsupported.items():
        if hf.get(key) == bad:
            raise ConfigError(f"{path}/config.json: {key}={bad} is not supported")
    if head_dim * hf["num_attention_heads"] != hf["hidden_size"] or hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{path}/config.json: head_dim * heads must equal hidden_size, with silu activations")
    cfg = ModelConfig(
        family=family, name=path.name, dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"], n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        vocab_size=hf["vocab_size"], ffn_dim=hf["intermediate_size"], norm_eps=hf["rms_norm_eps"],
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_scaling=_rope_scaling_from_hf(rope, path), max_seq_len=hf.get("max_position_embeddings", 2048),
        tie_embeddings=bool(hf.get("tie_word_embeddings")),
    )
    if family == "mixtral":
        cfg.n_experts, cfg.top_k = hf["num_local_experts"], hf["num_experts_per_tok"]
        cfg.aux_loss_coef = hf.get("router_aux_loss_coef", 0.0)
    return cfg


def _rope_scaling_from_hf(rope: dict, path: Path) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ConfigError(f"{path}/config.json: rope type {kind} is not supported (default, llama3)")
    try:
        return RopeScaling(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                           high_freq_factor=float(rope["high_freq_factor"]),
                           original_max_seq_len=int(rope["original_max_position_embeddings"]))
    except KeyError as e:
        raise ConfigError(f"{path}/config.json: rope type llama3 needs {e.args[0]}") from None


def _rope_parameters(cfg: ModelConfig) -> dict:
    """Hugging Face's rope_parameters (rope_scaling before transformers 5) for our model config."""
    r = cfg.rope_scaling
    if r is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": r.factor,
            "low_freq_factor": r.low_freq_factor, "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_max_seq_len}


def hf_config(cfg: ModelConfig):
    """A transformers config object for our model config."""
    from transformers import LlamaConfig, MixtralConfig

    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        rms_norm_eps=cfg.norm_eps, max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters=_rope_parameters(cfg), hidden_act="silu",
    )
    if cfg.family == "mixtral":
        return MixtralConfig(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
                             router_aux_loss_coef=cfg.aux_loss_coef, **common)
    return LlamaConfig(head_dim=cfg.dim // cfg.n_heads, attention_bias=False, mlp_bias=False, **common)


def _layer_names(i: int, moe: bool) -> dict[str, str]:
    """Our name -> Hugging Face name, for the tensors of layer i other than the experts."""
    ours, hf = f"layers.{i}.", f"model.layers.{i}."
    names = {
        "attention_norm.weight": "input_layernorm.weight",
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    }
    if moe:
        names["feed_forward.router.weight"] = "block_sparse_moe.gate.weight"
    else:
        names |= {"feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
                  "feed_forward.w2.weight": "mlp.down_proj.weight"}
    return {ours + a: hf + b for a, b in names.items()}


def _names(cfg: ModelConfig) -> dict[str, str]:
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    for i in range(cfg.n_layers):
        names |= _layer_names(i, cfg.n_experts > 0)
    return names


def _expert_names(cfg: ModelConfig, i: int, w: str) -> list[str]:
    return [f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight" for e in range(cfg.n_experts)]


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
            raise ConfigError(f"{path} has no tensor {name}: not a {cfg.family} checkpoint of this shape")
        return tensors[name]

    weights = {ours: take(hf) if isinstance(hf, str) else torch.stack([take(name) for name in hf])
               for ours, hf in hf_sources(cfg).items()}
    if cfg.tie_embeddings:
        weights["output.weight"] = weights["tok_embeddings.weight"]
    return cfg, weights


def hf_sources(cfg: ModelConfig) -> dict[str, str | list[str]]:
    """Our weight name -> the Hugging Face tensor it is, or for our stacked experts the list of
    per-expert tensors in expert order."""
    sources: dict[str, str | list[str]] = dict(_names(cfg))
    for i in range(cfg.n_layers) if cfg.n_experts else ():
        for w in ("w1", "w2", "w3"):
            sources[f"layers.{i}.feed_forward.experts.{w}"] = _expert_names(cfg, i, w)
    return sources


def hf_tensors(cfg: ModelConfig) -> list[tuple[str, str, int | None]]:
    """Every tensor of the Hugging Face model, in its order: (its name, our name, and the expert's
    index in our stacked tensor, or None)."""
    entries = []
    for ours, hf in hf_sources(cfg).items():
        entries += [(hf, ours, None)] if isinstance(hf, str) else [(name, ours, e) for e, name in enumerate(hf)]
    return sorted(entries, key=lambda entry: _layer_order(entry[0]))


def _layer_order(hf_name: str) -> tuple[int, str]:
    """Embedding first, then the layers in number order, then the final norm and head."""
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"]:
        return int(parts[2]), hf_name
    return (-1 if "embed" in hf_name else 1 << 30), hf_name


def write_hf_config(cfg: ModelConfig, out: Path, dtype: torch.dtype) -> None:
    """config.json for our model config, stating the weights' dtype, readable by transformers 4 and 5."""
    config = hf_config(cfg)
    config.architectures = ["MixtralForCausalLM" if cfg.family == "mixtral" else "LlamaForCausalLM"]
    config.save_pretrained(out)
    path = out / "config.json"
    written = json.loads(path.read_text())
    # transformers 5 reads (and writes) only rope_parameters and dtype; earlier versions read
    # rope_theta, rope_scaling and torch_dtype: write both forms, the same values.
    rope = _rope_parameters(cfg)
    written["rope_theta"] = cfg.rope_theta
    written["rope_scaling"] = None if cfg.rope_scaling is None else {k: v for k, v in rope.items() if k != "rope_theta"}
    written["dtype"] = written["torch_dtype"] = str(dtype).removeprefix("torch.")
    path.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
