"""Llama's Hugging Face mapping: transformers' LlamaForCausalLM names and config."""

from __future__ import annotations

from trainer.config.schema import ModelConfig
from trainer.errors import ConfigError
from trainer.models.hf_names import attention_names, edge_names, swiglu_names
from trainer.models.spec import HFMapping


def names(cfg: ModelConfig) -> dict[str, str]:
    sources = edge_names(cfg)
    for i in range(cfg.n_layers):
        sources |= attention_names(i) | swiglu_names(f"layers.{i}.feed_forward",
                                                     f"model.layers.{i}.mlp")
    return sources


def config_fields(hf: dict) -> dict:
    """Nothing of Llama's own; heads of another width than hidden_size / heads are refused."""
    width = hf.get("head_dim")
    if width is not None and width * hf["num_attention_heads"] != hf["hidden_size"]:
        raise ConfigError(f"config.json: head_dim={width} is not supported (hidden_size / "
                          "num_attention_heads)")
    return {}


def config(cfg: ModelConfig, common: dict):
    from transformers import LlamaConfig

    return LlamaConfig(head_dim=cfg.dim // cfg.n_heads, attention_bias=False, mlp_bias=False,
                       **common)


HF = HFMapping(model_type="llama", architecture="LlamaForCausalLM", config_fields=config_fields,
               config=config, names=names)
