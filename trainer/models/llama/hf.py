"""Llama's Hugging Face mapping: transformers' LlamaForCausalLM names and config.

Our attention rotates the two halves of each head ("rotate half") and lays heads out contiguously
in the q/k/v rows, as transformers' Llama does, so q_proj and k_proj map over unchanged.
"""

from __future__ import annotations

from trainer.config import ModelConfig
from trainer.config import head_dim as model_head_dim
from trainer.models.spec import HFMapping


def attention_names(i: int) -> dict[str, str]:
    """Our name -> Hugging Face name for layer i's norms and attention (shared with Mixtral)."""
    names = {
        "attention_norm.weight": "input_layernorm.weight",
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    }
    return {f"layers.{i}.{a}": f"model.layers.{i}.{b}" for a, b in names.items()}


def edge_names(cfg: ModelConfig) -> dict[str, str]:
    """The embedding, final norm and (untied) head."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    return names


def names(cfg: ModelConfig) -> dict[str, str]:
    sources = edge_names(cfg)
    for i in range(cfg.n_layers):
        sources |= attention_names(i)
        mlp = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
        sources |= {f"layers.{i}.feed_forward.{w}.weight": f"model.layers.{i}.mlp.{hf}.weight" for w, hf in mlp.items()}
    return sources


def config(cfg: ModelConfig, common: dict):
    from transformers import LlamaConfig

    return LlamaConfig(head_dim=model_head_dim(cfg), attention_bias=False, mlp_bias=False, **common)


HF = HFMapping(model_type="llama", architecture="LlamaForCausalLM", config_fields=lambda hf: {}, config=config,
               names=names)
