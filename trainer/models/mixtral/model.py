"""Mixtral: Llama's attention with a sparse mixture of experts in place of each feed-forward. Its
keys beyond the shared ones are the MoE layer's (trainer.models.moe_config.MoEConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from trainer.config.schema import ModelConfig
from trainer.models.decoder import Attention, Decoder, check_heads, head_width
from trainer.models.moe import RESIDUAL_OUTPUTS as MOE_OUTPUTS
from trainer.models.moe_config import MoEConfig, check_moe, moe_from_config


@dataclass
class MixtralConfig(MoEConfig, ModelConfig):
    pass


class Mixtral(Decoder):
    residual_outputs = ("attention.wo.weight", *(f"feed_forward.{name}" for name in MOE_OUTPUTS))

    def make_attention(self, cfg: MixtralConfig, layer: int) -> nn.Module:
        return Attention(cfg, head_width(cfg))

    def make_feed_forward(self, cfg: MixtralConfig, layer: int) -> nn.Module:
        return moe_from_config(cfg)


def check(cfg: MixtralConfig) -> None:
    check_heads(cfg)
    check_moe(cfg)
