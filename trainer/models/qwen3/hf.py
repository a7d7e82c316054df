"""Qwen3's Hugging Face mapping: transformers' Qwen3ForCausalLM names and config."""

from __future__ import annotations

from trainer.models.decoder import head_width
from trainer.models.hf_names import attention_names, edge_names, head_dim_fields, swiglu_names
from trainer.models.qwen3.model import Qwen3Config
from trainer.models.spec import HFMapping


def names(cfg: Qwen3Config) -> dict[str, str]:
    sources = edge_names(cfg)
    for i in range(cfg.n_layers):
        sources |= (attention_names(i, qk_norm=True)
                    | swiglu_names(f"layers.{i}.feed_forward", f"model.layers.{i}.mlp"))
    return sources


def config(cfg: Qwen3Config, common: dict):
    from transformers import Qwen3Config as HFQwen3Config

    return HFQwen3Config(head_dim=head_width(cfg), attention_bias=False, use_sliding_window=False,
                         **common)


HF = HFMapping(model_type="qwen3", architecture="Qwen3ForCausalLM", config_fields=head_dim_fields,
               config=config, names=names)
