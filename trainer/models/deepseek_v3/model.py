"""DeepSeek-V3 (and Kimi K2, its shape at 1T parameters; DeepSeek-V2-Lite's): multi-head latent
attention (MLA), the first `n_dense_layers` blocks with a SwiGLU feed-forward, the others with an
MoE layer (sigmoid scores, expert groups, shared experts, the aux-loss-free bias, routed scaling:
the MoE layer's keys). Plain PyTorch.

MLA: queries come from the input through a low-rank projection with its norm (`q_lora_rank`; null:
one plain projection, as DeepSeek-V2-Lite's); keys and values from one compressed latent
(`kv_lora_rank`) with its norm, up-projected per head. Each query and key head is
`qk_nope_head_dim` wide without position and `qk_rope_head_dim` wide with the rotary embedding; the
rotary part of the key is one per token, shared by every head; value heads are `v_head_dim` wide.
With YaRN rotary scaling the softmax scale is multiplied by YaRN's mscale squared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trainer.config.schema import ModelConfig, shape
from trainer.errors import ConfigError
from trainer.models.attention import CausalAttention
from trainer.models.decoder import (
    Decoder,
    apply_rope,
    rope_attention_factor,
    rope_cos_sin,
    rope_frequencies,
    yarn_mscale,
)
from trainer.models.layers import FeedForward, RMSNorm
from trainer.models.moe import RESIDUAL_OUTPUTS as MOE_OUTPUTS
from trainer.models.moe_config import MoEConfig, check_moe, moe_from_config

# The latent norms' epsilon: DeepSeek's (and transformers') whatever the model's norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass
class DeepseekV3Config(MoEConfig, ModelConfig):
    """DeepSeek-V3's keys: MLA's ranks and head widths, the dense blocks, and the MoE layer's
    (ffn_dim is an expert's width, as in every MoE family; dense_ffn_dim the dense blocks'
    feed-forward)."""

    q_lora_rank: int | None = shape(1536)  # null: the queries through one plain projection
    kv_lora_rank: int = shape(512)
    qk_nope_head_dim: int = shape(128)
    qk_rope_head_dim: int = shape(64)
    v_head_dim: int = shape(128)
    # the first blocks, with a SwiGLU feed-forward (first_k_dense_replace)
    n_dense_layers: int = shape(3)
    dense_ffn_dim: int = shape(18432)
    # The rotary pairs of the query and key weights are
    # (2i, 2i + 1), as DeepSeek's checkpoints lay them out.
    rope_interleave: bool = shape(True)

    def moe_layers(self) -> list[int]:
        return list(range(self.n_dense_layers, self.n_layers))


class RotaryKey(nn.Module):
    """The rotary part of the key, one per token, turned and shared by every head: under tensor
    parallel each rank's heads use it, and its gradient is their sum (the plan's SumGradients)."""

    def __init__(self, interleaved: bool):
        super().__init__()
        self.interleaved = interleaved

    def forward(self, k_rope: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """k_rope [batch, seq, width] -> [batch, seq, 1, width]."""
        return apply_rope(k_rope[:, :, None], cos, sin, self.interleaved)


class LatentAttention(nn.Module):
    """Multi-head latent attention (see the module's docstring)."""

    def __init__(self, cfg: DeepseekV3Config):
        super().__init__()
        heads, self.nope, self.rope, self.v = (cfg.n_heads, cfg.qk_nope_head_dim,
                                               cfg.qk_rope_head_dim, cfg.v_head_dim)
        qk = self.nope + self.rope
        if cfg.q_lora_rank is None:
            self.wq = nn.Linear(cfg.dim, heads * qk, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        else:
            self.wq = None
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(cfg.q_lora_rank, heads * qk, bias=False)
        self.kv_lora_rank = cfg.kv_lora_rank
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, heads * (self.nope + self.v), bias=False)
        self.wo = nn.Linear(heads * self.v, cfg.dim, bias=False)
        self.rope_key = RotaryKey(cfg.rope_interleave)
        self.interleaved = cfg.rope_interleave
        self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        # The kernels scale scores by 1/sqrt(query width): the queries are multiplied by what makes
        # that the scale wanted (1 unless YaRN's mscale_all_dim applies).
        scaling = cfg.rope_scaling
        mscale = yarn_mscale(scaling.factor, scaling.mscale_all_dim) if (
            scaling is not None and scaling.type == "yarn" and scaling.mscale_all_dim) else 1.0
        self.query_scale = mscale * mscale
        self.sdpa = CausalAttention()

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_norm(self.wq_a(x)))
        # Shapes from the projections, not x: under tensor parallel each rank holds its share of
        # the heads.
        batch, seq = q.shape[:2]
        q = q.view(batch, seq, -1, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(batch, seq, -1, self.nope + self.v)
        # The values a copy of their own: attention keeps them for backward, and a view would keep
        # the keys' part of the up projection with them.
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:].contiguous()
        freqs = rope_frequencies(self.rope, self.rope_theta, self.rope_scaling, x.device)
        cos, sin = rope_cos_sin(positions, freqs, rope_attention_factor(self.rope_scaling))
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin, self.interleaved)], dim=-1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        k = torch.cat([k_nope, self.rope_key(k_rope, cos, sin).expand(-1, -1, k_nope.shape[2], -1)],
                      dim=-1)
        out = self.sdpa(*(t.transpose(1, 2) for t in (q, k, v)), positions)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class DeepseekV3(Decoder):
    residual_outputs = ("attention.wo.weight", "feed_forward.w2.weight",
                        *(f"feed_forward.{name}" for name in MOE_OUTPUTS))

    def make_attention(self, cfg: DeepseekV3Config, layer: int) -> nn.Module:
        return LatentAttention(cfg)

    def make_feed_forward(self, cfg: DeepseekV3Config, layer: int) -> nn.Module:
        if layer < cfg.n_dense_layers:
            return FeedForward(cfg.dim, cfg.dense_ffn_dim)
        return moe_from_config(cfg)


def block_kind(cfg: DeepseekV3Config, layer: int) -> str:
    return "dense" if layer < cfg.n_dense_layers else "moe"


def check(cfg: DeepseekV3Config) -> None:
    check_moe(cfg)
    if cfg.n_kv_heads != cfg.n_heads:
        raise ConfigError(f"model.n_kv_heads={cfg.n_kv_heads} must equal "
                          f"model.n_heads={cfg.n_heads}: in latent attention every head has keys "
                          "and values of its own")
    for key in ("kv_lora_rank", "q_lora_rank"):
        rank = getattr(cfg, key)
        if rank is not None and not 1 <= rank <= cfg.dim:
            null = ", or null (a plain query projection)" if key == "q_lora_rank" else ""
            raise ConfigError(f"model.{key}={rank} must be between 1 and model.dim={cfg.dim}{null}")
    for key in ("qk_nope_head_dim", "v_head_dim", "qk_rope_head_dim", "dense_ffn_dim"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"model.{key}={getattr(cfg, key)} must be >= 1")
    if cfg.qk_rope_head_dim % 2:
        raise ConfigError(f"model.qk_rope_head_dim={cfg.qk_rope_head_dim} must be even: the rotary "
                          "embedding turns pairs of dimensions")
    if not 0 <= cfg.n_dense_layers < cfg.n_layers:
        raise ConfigError(f"model.n_dense_layers={cfg.n_dense_layers} must be between 0 and "
                          f"model.n_layers - 1={cfg.n_layers - 1} (at least one block with "
                          "experts)")

