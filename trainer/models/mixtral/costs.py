"""Mixtral's FLOPs and memory terms: the shared decoder's, grouped-query attention and an MoE layer
in every block."""

from trainer.models.costs import DecoderCosts

COSTS = DecoderCosts()
