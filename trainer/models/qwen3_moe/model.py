"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms, heads of their own
width) with a mixture of many small experts in every block (128 experts, top 8, the top-k weights
renormalised). Its keys: model.head_dim and the MoE layer's
(trainer.models.moe_config.MoEConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from trainer.config.schema import ModelConfig
from trainer.models.decoder import Attention, Decoder, HeadDimConfig, check_heads, head_width
from trainer.models.moe import RESIDUAL_OUTPUTS as MOE_OUTPUTS
from trainer.models.moe_config import MoEConfig, check_moe, moe_from_config


@dataclass
class Qwen3MoeConfig(MoEConfig, HeadDimConfig, ModelConfig):
    pass


class Qwen3Moe(Decoder):
    residual_outputs = ("attention.wo.weight", *(f"feed_forward.{name}" for name in MOE_OUTPUTS))

    def make_attention(self, cfg: Qwen3MoeConfig, layer: int) -> nn.Module:
        return Attention(cfg, head_width(cfg), qk_norm=True)

    def make_feed_forward(self, cfg: Qwen3MoeConfig, layer: int) -> nn.Module:
        return moe_from_config(cfg)


def check(cfg: Qwen3MoeConfig) -> None:
    check_heads(cfg)
    check_moe(cfg)
