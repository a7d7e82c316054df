"""Qwen3 (dense, 0.6B to 32B): Llama's blocks with an RMSNorm on each head's queries and keys before
the rotary embedding, and heads of a width of their own (its key: model.head_dim)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from trainer.config.schema import ModelConfig
from trainer.models.decoder import Attention, Decoder, HeadDimConfig, check_heads, head_width
from trainer.models.layers import FeedForward


@dataclass
class Qwen3Config(HeadDimConfig, ModelConfig):
    pass


class Qwen3(Decoder):
    def make_attention(self, cfg: Qwen3Config, layer: int) -> nn.Module:
        return Attention(cfg, head_width(cfg), qk_norm=True)

    def make_feed_forward(self, cfg: Qwen3Config, layer: int) -> nn.Module:
        return FeedForward(cfg.dim, cfg.ffn_dim)


def check(cfg: Qwen3Config) -> None:
    check_heads(cfg)
