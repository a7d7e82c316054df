"""Mixtral's Hugging Face mapping: transformers' MixtralForCausalLM names and config."""

from __future__ import annotations

from trainer.models.hf_names import attention_names, edge_names, expert_names
from trainer.models.mixtral.model import MixtralConfig
from trainer.models.moe_config import check_hf_routing
from trainer.models.spec import HFMapping


def names(cfg: MixtralConfig) -> dict[str, str | list[str]]:
    """Experts are stored one tensor per expert (block_sparse_moe.experts.E.w1/w2/w3, the layout on
    disk of every transformers version); ours are stacked along a first experts dimension."""
    sources: dict[str, str | list[str]] = edge_names(cfg)
    for i in range(cfg.n_layers):
        moe = f"model.layers.{i}.block_sparse_moe"
        sources |= attention_names(i)
        sources[f"layers.{i}.feed_forward.router.weight"] = f"{moe}.gate.weight"
        sources |= expert_names(f"layers.{i}.feed_forward.experts", f"{moe}.experts", cfg.n_experts,
                                {w: w for w in ("w1", "w2", "w3")})
    return sources


def config(cfg: MixtralConfig, common: dict):
    from transformers import MixtralConfig as HFMixtralConfig

    check_hf_routing(cfg, "Mixtral")
    return HFMixtralConfig(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
                           router_aux_loss_coef=cfg.aux_loss_coef, **common)


HF = HFMapping(
    model_type="mixtral", architecture="MixtralForCausalLM",
    config_fields=lambda hf: {"n_experts": hf["num_local_experts"],
                              "top_k": hf["num_experts_per_tok"],
                              "aux_loss_coef": hf.get("router_aux_loss_coef", 0.0)},
    config=config, names=names,
)
