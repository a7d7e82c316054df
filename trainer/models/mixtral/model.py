"""Mixtral: Llama with each block's feed-forward replaced by a sparse mixture of experts."""

from __future__ import annotations

from torch import nn

from trainer.models.llama.model import Llama
from trainer.models.moe import moe_from_config


class Mixtral(Llama):
    def make_feed_forward(self, cfg) -> nn.Module:
        return moe_from_config(cfg)
