"""Qwen3: Llama's blocks with an RMSNorm on each head's queries and keys before the rotary embedding,
and a head dimension of its own (model.head_dim, not dim / n_heads)."""

from __future__ import annotations

from torch import nn

from trainer.models.llama.model import Attention, Llama


class Qwen3(Llama):
    def make_attention(self, cfg) -> nn.Module:
        return Attention(cfg, qk_norm=True)
