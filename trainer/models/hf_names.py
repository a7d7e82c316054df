"""Hugging Face tensor names (and config fields) of the shared building blocks, in transformers'
Llama layout (which Mixtral, Qwen3 and Qwen3-MoE follow): our name -> theirs, for a family's
`HFMapping.names`.

Our attention rotates the two halves of each head ("rotate half") and lays heads out contiguously
in the q/k/v rows, as transformers' Llama does, so q_proj and k_proj map over unchanged.
"""

from __future__ import annotations

from trainer.config.schema import ModelConfig
from trainer.errors import ConfigError

# Our SwiGLU projections -> transformers' names.
SWIGLU = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def edge_names(cfg: ModelConfig) -> dict[str, str]:
    """The embedding, final norm and (untied) head."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight",
             "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    return names


def attention_names(i: int, qk_norm: bool = False) -> dict[str, str]:
    """Layer i's norms and attention (with Qwen3's q/k norms)."""
    names = {
        "attention_norm.weight": "input_layernorm.weight",
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    }
    if qk_norm:
        names |= {f"attention.{norm}.weight": f"self_attn.{norm}.weight"
                  for norm in ("q_norm", "k_norm")}
    return {f"layers.{i}.{a}": f"model.layers.{i}.{b}" for a, b in names.items()}


def swiglu_names(ours: str, theirs: str, projections: dict[str, str] = SWIGLU) -> dict[str, str]:
    """A SwiGLU feed-forward at our module path `ours`, theirs at `theirs`."""
    return {f"{ours}.{w}.weight": f"{theirs}.{hf}.weight" for w, hf in projections.items()}


def expert_names(ours: str, theirs: str, n_experts: int,
                 projections: dict[str, str] = SWIGLU) -> dict[str, list[str]]:
    """Stacked experts at `ours` (GroupedExperts: w1/w2/w3 with a first experts dimension), one
    tensor per expert and projection on disk at `theirs`.E.<projection>.weight, in stacking
    order."""
    return {f"{ours}.{w}": [f"{theirs}.{e}.{hf}.weight" for e in range(n_experts)]
            for w, hf in projections.items()}


def head_dim_fields(hf: dict) -> dict:
    """A config.json's head width (Qwen3's attention), and a refusal of what the attention here does
    not do (sliding windows)."""
    if hf.get("use_sliding_window"):
        raise ConfigError(f"config.json: use_sliding_window={hf['use_sliding_window']} is not "
                          "supported (full attention in every layer)")
    return {"head_dim": hf.get("head_dim")}
