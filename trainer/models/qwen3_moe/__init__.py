"""The Qwen3-MoE family (Qwen3-30B-A3B, Qwen3-235B-A22B), registered as `model.family=qwen3_moe`:
Qwen3's attention (q/k norms, its own head dimension) with a mixture of many small experts in every
block (128 experts, top 8, the top-k weights renormalised), expert parallel as for Mixtral. The MoE
layer's DeepSeek-V3 routing options apply here as to any MoE family; transformers' Qwen3-MoE has
none of them, so a model using one has no Hugging Face form."""

from __future__ import annotations

from torch import nn

from trainer.config import ModelConfig
from trainer.config import head_dim as model_head_dim
from trainer.errors import ConfigError
from trainer.models import mixtral
from trainer.models.llama import UNITS
from trainer.models.llama.hf import edge_names
from trainer.models.moe import moe_from_config
from trainer.models.qwen3 import attention_hf_names, hf_fields, qk_norm_bytes, qk_norm_plan
from trainer.models.qwen3.model import Qwen3
from trainer.models.routing import check_hf_routing
from trainer.models.spec import HFMapping, ModelSpec, Shapes, register_family


class Qwen3Moe(Qwen3):
    def make_feed_forward(self, cfg) -> nn.Module:
        return moe_from_config(cfg)


def tp_plan(sequence_parallel: bool, loss_parallel: bool) -> dict:
    return {**mixtral.tp_plan(sequence_parallel, loss_parallel), **qk_norm_plan()}


def activation_bytes(s: Shapes) -> float:
    return mixtral.memory.activation_bytes(s) + qk_norm_bytes(s)


def hf_names(cfg: ModelConfig) -> dict[str, str | list[str]]:
    """Experts one tensor per expert and projection on disk (mlp.experts.E.gate_proj/up_proj/down_proj);
    ours stacked along a first experts dimension."""
    sources: dict[str, str | list[str]] = edge_names(cfg)
    for i in range(cfg.n_layers):
        sources |= attention_hf_names(i)
        mlp = f"model.layers.{i}.mlp"
        sources[f"layers.{i}.feed_forward.router.weight"] = f"{mlp}.gate.weight"
        for w, hf in {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.items():
            sources[f"layers.{i}.feed_forward.experts.{w}"] = [f"{mlp}.experts.{e}.{hf}.weight"
                                                               for e in range(cfg.n_experts)]
    return sources


def moe_hf_fields(hf: dict) -> dict:
    """Every layer sparse, softmax routing; the expert width is moe_intermediate_size."""
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise ConfigError("config.json: dense layers between the sparse ones (decoder_sparse_step, mlp_only_layers) "
                          "are not supported")
    experts = hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]
    return {**hf_fields(hf), "n_experts": experts, "top_k": hf["num_experts_per_tok"],
            "ffn_dim": hf["moe_intermediate_size"], "route_norm": bool(hf.get("norm_topk_prob", False)),
            "aux_loss_coef": hf.get("router_aux_loss_coef", 0.0)}


def hf_config(cfg: ModelConfig, common: dict):
    from transformers import Qwen3MoeConfig

    check_hf_routing(cfg, "Qwen3-MoE")
    return Qwen3MoeConfig(head_dim=model_head_dim(cfg), num_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
                          moe_intermediate_size=cfg.ffn_dim, norm_topk_prob=cfg.route_norm, decoder_sparse_step=1,
                          mlp_only_layers=[], router_aux_loss_coef=cfg.aux_loss_coef, attention_bias=False,
                          use_sliding_window=False, **common)


HF = HFMapping(model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", config_fields=moe_hf_fields,
               config=hf_config, names=hf_names)

SPEC = register_family(ModelSpec(family="qwen3_moe", model=Qwen3Moe, **UNITS, tp_plan=tp_plan,
                                 flops_per_token=mixtral.flops_per_token, activation_bytes=activation_bytes,
                                 selective_bytes=mixtral.memory.selective_bytes, check=mixtral.check, hf=HF,
                                 checkpoint_regions=mixtral.checkpoint_regions))
