"""Qwen3-MoE's Hugging Face mapping: transformers' Qwen3MoeForCausalLM names and config.
transformers' Qwen3-MoE has none of the MoE layer's DeepSeek-V3 routing options: a model using one
has no Hugging Face form."""

from __future__ import annotations

from trainer.errors import ConfigError
from trainer.models.decoder import head_width
from trainer.models.hf_names import attention_names, edge_names, expert_names, head_dim_fields
from trainer.models.moe_config import check_hf_routing
from trainer.models.qwen3_moe.model import Qwen3MoeConfig
from trainer.models.spec import HFMapping


def names(cfg: Qwen3MoeConfig) -> dict[str, str | list[str]]:
    """Experts one tensor per expert and projection on disk
    (mlp.experts.E.gate_proj/up_proj/down_proj); ours stacked along a first experts dimension."""
    sources: dict[str, str | list[str]] = edge_names(cfg)
    for i in range(cfg.n_layers):
        mlp = f"model.layers.{i}.mlp"
        sources |= attention_names(i, qk_norm=True)
        sources[f"layers.{i}.feed_forward.router.weight"] = f"{mlp}.gate.weight"
        sources |= expert_names(f"layers.{i}.feed_forward.experts", f"{mlp}.experts", cfg.n_experts)
    return sources


def config_fields(hf: dict) -> dict:
    """Every layer sparse, softmax routing; the expert width is moe_intermediate_size."""
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise ConfigError("config.json: dense layers between the sparse ones (decoder_sparse_step, "
                          "mlp_only_layers) are not supported")
    experts = hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]
    return {**head_dim_fields(hf), "n_experts": experts, "top_k": hf["num_experts_per_tok"],
            "ffn_dim": hf["moe_intermediate_size"],
            "route_norm": bool(hf.get("norm_topk_prob", False)),
            "aux_loss_coef": hf.get("router_aux_loss_coef", 0.0)}


def config(cfg: Qwen3MoeConfig, common: dict):
    from transformers import Qwen3MoeConfig as HFQwen3MoeConfig

    check_hf_routing(cfg, "Qwen3-MoE")
    return HFQwen3MoeConfig(head_dim=head_width(cfg), num_experts=cfg.n_experts,
                            num_experts_per_tok=cfg.top_k, moe_intermediate_size=cfg.ffn_dim,
                            norm_topk_prob=cfg.route_norm, decoder_sparse_step=1,
                            mlp_only_layers=[], router_aux_loss_coef=cfg.aux_loss_coef,
                            attention_bias=False, use_sliding_window=False, **common)


HF = HFMapping(model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM",
               config_fields=config_fields, config=config, names=names)
