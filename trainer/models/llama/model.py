"""Llama (Llama 2 and 3 shapes): RMSNorm, rotary embeddings, grouped-query attention, SwiGLU. Llama
has no keys beyond the ones every family shares (trainer.config.schema.ModelConfig)."""

from __future__ import annotations

from torch import nn

from trainer.config.schema import ModelConfig
from trainer.models.decoder import Attention, Decoder, check_heads, head_width
from trainer.models.layers import FeedForward


class Llama(Decoder):
    def make_attention(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return Attention(cfg, head_width(cfg))

    def make_feed_forward(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return FeedForward(cfg.dim, cfg.ffn_dim)


def check(cfg: ModelConfig) -> None:
    check_heads(cfg)
