"""The Qwen3 dense family (Qwen3-0.6B to 32B), registered as `model.family=qwen3`: Llama with q/k norms
and its own head dimension; optionally tied embeddings."""

from __future__ import annotations

from torch.distributed.tensor.parallel import SequenceParallel

from trainer.config import ModelConfig
from trainer.config import head_dim as model_head_dim
from trainer.errors import ConfigError
from trainer.models.llama import UNITS, flops_per_token
from trainer.models.llama import memory as llama_memory
from trainer.models.llama.hf import attention_names
from trainer.models.llama.hf import names as llama_names
from trainer.models.llama.parallelize import tp_plan as llama_tp_plan
from trainer.models.qwen3.model import Qwen3
from trainer.models.spec import FP32, HFMapping, ModelSpec, Shapes, register_family


def qk_norm_plan() -> dict:
    """Under tensor parallel each rank holds its share of the heads: the q/k norms take their input as
    split on the heads dimension (2 of [batch, seq, heads, head_dim]), so their replicated weight's
    gradient is summed over the tp ranks."""
    return {f"layers.*.attention.{norm}": SequenceParallel(sequence_dim=2, use_local_output=True)
            for norm in ("q_norm", "k_norm")}


def tp_plan(sequence_parallel: bool, loss_parallel: bool) -> dict:
    return {**llama_tp_plan(sequence_parallel, loss_parallel), **qk_norm_plan()}


def qk_norm_bytes(s: Shapes) -> float:
    """What the q/k norms save: their inputs (q and k before the norm) and a float32 scale per head and token."""
    rows = s.tokens * (s.n_heads + s.n_kv_heads) // s.tp
    return rows * s.head_dim * s.act_bytes + rows * FP32


def activation_bytes(s: Shapes) -> float:
    return llama_memory.activation_bytes(s) + qk_norm_bytes(s)


def check(cfg: ModelConfig) -> None:
    if cfg.n_experts:
        raise ConfigError(f"model.n_experts={cfg.n_experts} needs model.family=qwen3_moe: a Qwen3 block has one "
                          f"feed-forward")


def attention_hf_names(i: int) -> dict[str, str]:
    """Llama's names for layer i's norms and attention, and the q/k norms (shared with Qwen3-MoE)."""
    return attention_names(i) | {f"layers.{i}.attention.{norm}.weight": f"model.layers.{i}.self_attn.{norm}.weight"
                                 for norm in ("q_norm", "k_norm")}


def hf_names(cfg: ModelConfig) -> dict[str, str]:
    """Llama's names, and each layer's q/k norms."""
    sources = llama_names(cfg)
    for i in range(cfg.n_layers):
        sources |= attention_hf_names(i)
    return sources


def hf_fields(hf: dict) -> dict:
    """The head dimension, and a refusal of what Qwen3's attention here does not do (sliding windows)."""
    if hf.get("use_sliding_window"):
        raise ConfigError(f"config.json: use_sliding_window={hf['use_sliding_window']} is not supported "
                          f"(full attention in every layer)")
    return {"head_dim": hf.get("head_dim")}


def hf_config(cfg: ModelConfig, common: dict):
    from transformers import Qwen3Config

    return Qwen3Config(head_dim=model_head_dim(cfg), attention_bias=False, use_sliding_window=False, **common)


HF = HFMapping(model_type="qwen3", architecture="Qwen3ForCausalLM", config_fields=hf_fields, config=hf_config,
               names=hf_names)

SPEC = register_family(ModelSpec(family="qwen3", model=Qwen3, **UNITS, tp_plan=tp_plan,
                                 flops_per_token=flops_per_token, activation_bytes=activation_bytes,
                                 selective_bytes=llama_memory.selective_bytes, check=check, hf=HF))
