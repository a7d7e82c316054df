"""DeepSeek-V3's Hugging Face mapping: transformers' DeepseekV3ForCausalLM names and config (Kimi
K2's checkpoints are this architecture too). The aux-loss-free bias is the router's
e_score_correction_bias."""

from __future__ import annotations

from trainer.errors import ConfigError
from trainer.models.deepseek_v3.model import DeepseekV3Config
from trainer.models.hf_names import edge_names, expert_names, swiglu_names
from trainer.models.moe_config import check_hf_routing
from trainer.models.spec import HFMapping

# Our MLA projections and norms -> transformers' (self_attn.<name>).
ATTENTION = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
             "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj",
             "wo": "o_proj"}


def names(cfg: DeepseekV3Config) -> dict[str, str | list[str]]:
    sources: dict[str, str | list[str]] = edge_names(cfg)
    query = ("wq",) if cfg.q_lora_rank is None else ("wq_a", "q_norm", "wq_b")
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        sources[f"{ours}.attention_norm.weight"] = f"{theirs}.input_layernorm.weight"
        sources[f"{ours}.ffn_norm.weight"] = f"{theirs}.post_attention_layernorm.weight"
        for name in (*query, "wkv_a", "kv_norm", "wkv_b", "wo"):
            theirs_name = f"{theirs}.self_attn.{ATTENTION[name]}.weight"
            sources[f"{ours}.attention.{name}.weight"] = theirs_name
        ffn, mlp = f"{ours}.feed_forward", f"{theirs}.mlp"
        if i < cfg.n_dense_layers:
            sources |= swiglu_names(ffn, mlp)
            continue
        sources[f"{ffn}.router.weight"] = f"{mlp}.gate.weight"
        if cfg.expert_bias:
            sources[f"{ffn}.expert_bias"] = f"{mlp}.gate.e_score_correction_bias"
        sources |= expert_names(f"{ffn}.experts", f"{mlp}.experts", cfg.n_experts)
        if cfg.n_shared_experts:
            sources |= swiglu_names(f"{ffn}.shared", f"{mlp}.shared_experts")
    return sources


def config_fields(hf: dict) -> dict:
    """MLA's ranks and widths, the dense blocks, DeepSeek-V3's routing (sigmoid scores, groups, the
    bias)."""
    if (hf.get("scoring_func", "sigmoid") != "sigmoid"
        or hf.get("topk_method", "noaux_tc") != "noaux_tc"):
        raise ConfigError(f"config.json: scoring_func={hf.get('scoring_func')}, "
                          f"topk_method={hf.get('topk_method')} is not supported (sigmoid, "
                          "noaux_tc: DeepSeek-V3's routing)")
    return {
        "q_lora_rank": hf.get("q_lora_rank"), "kv_lora_rank": hf["kv_lora_rank"],
        "qk_nope_head_dim": hf["qk_nope_head_dim"], "qk_rope_head_dim": hf["qk_rope_head_dim"],
        "v_head_dim": hf["v_head_dim"], "rope_interleave": bool(hf.get("rope_interleave", True)),
        "n_dense_layers": hf.get("first_k_dense_replace") or 0,
        "dense_ffn_dim": hf["intermediate_size"], "ffn_dim": hf["moe_intermediate_size"],
        "n_experts": hf["n_routed_experts"], "top_k": hf["num_experts_per_tok"],
        "n_shared_experts": hf.get("n_shared_experts") or 0,
        "n_expert_groups": hf.get("n_group") or 1, "top_groups": hf.get("topk_group") or 1,
        "route_score": "sigmoid", "route_norm": bool(hf.get("norm_topk_prob")),
        "route_scale": float(hf.get("routed_scaling_factor", 1.0)), "expert_bias": True,
    }


# The routing transformers' DeepSeek-V3 computes.
HF_ROUTING = {"route_score": "sigmoid", "capacity_factor": None}


def config(cfg: DeepseekV3Config, common: dict):
    from transformers import DeepseekV3Config as HFDeepseekV3Config

    check_hf_routing(cfg, "DeepSeek-V3", HF_ROUTING)
    return HFDeepseekV3Config(
        **{**common, "intermediate_size": cfg.dense_ffn_dim}, moe_intermediate_size=cfg.ffn_dim,
        n_routed_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
        n_shared_experts=cfg.n_shared_experts, n_group=cfg.n_expert_groups,
        topk_group=cfg.top_groups, norm_topk_prob=cfg.route_norm,
        routed_scaling_factor=cfg.route_scale, first_k_dense_replace=cfg.n_dense_layers,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, rope_interleave=cfg.rope_interleave, attention_bias=False,
        num_nextn_predict_layers=0)


HF = HFMapping(model_type="deepseek_v3", architecture="DeepseekV3ForCausalLM",
               config_fields=config_fields, config=config, names=names)
