"""Mixtral: Llama with each block's feed-forward replaced by a sparse mixture of experts."""

from __future__ import annotations

from torch import nn

from trainer.models.llama.model import Llama
from trainer.models.moe import MoE


class Mixtral(Llama):
    def make_feed_forward(self, cfg) -> nn.Module:
        # The auxiliary losses are averaged over the layers, so their coefficients do not grow with depth.
        return MoE(cfg.dim, cfg.ffn_dim, cfg.n_experts, cfg.top_k, cfg.aux_loss_coef / cfg.n_layers,
                   cfg.z_loss_coef / cfg.n_layers, cfg.capacity_factor)
