"""The Llama family (Llama 2 and 3 shapes): the model, its tensor-parallel plan, its Hugging Face
mapping and FLOP count, registered as `model.family=llama`."""

from __future__ import annotations

from trainer.config import ModelConfig
from trainer.config import head_dim as model_head_dim
from trainer.errors import ConfigError
from trainer.models.llama import memory
from trainer.models.llama.hf import HF
from trainer.models.llama.model import Llama
from trainer.models.llama.parallelize import tp_plan
from trainer.models.spec import ModelSpec, register_family


def attention_flops(cfg: ModelConfig, seq_len: int) -> tuple[int, int]:
    """(weights that multiply per layer in attention, FLOPs per token of its score and value products)."""
    head_dim = model_head_dim(cfg)
    weights = cfg.dim * head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    return weights, 12 * cfg.n_heads * head_dim * seq_len


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 per weight that multiplies (all but the embedding lookup) plus
    attention's score and value products (12 * layers * heads * head_dim * seq_len; causal masking not discounted)."""
    attention, scores = attention_flops(cfg, seq_len)
    matmul_weights = cfg.n_layers * (attention + 3 * cfg.dim * cfg.ffn_dim) + cfg.dim * cfg.vocab_size
    return 6 * matmul_weights + cfg.n_layers * scores


def check(cfg: ModelConfig) -> None:
    if cfg.n_experts:
        raise ConfigError(f"model.n_experts={cfg.n_experts} needs model.family=mixtral: a Llama block has one "
                          f"feed-forward")


# Module paths: the units a pipeline stage and FSDP take.
UNITS = dict(embedding="tok_embeddings", blocks="layers", head=("norm", "output"))
SPEC = register_family(ModelSpec(family="llama", model=Llama, **UNITS, tp_plan=tp_plan,
                                 flops_per_token=flops_per_token,
                                 activation_bytes=memory.activation_bytes, selective_bytes=memory.selective_bytes,
                                 check=check, hf=HF))
