"""Llama's FLOPs and memory terms: the shared decoder's, grouped-query attention and a SwiGLU
feed-forward in every block."""

from trainer.models.costs import DecoderCosts

COSTS = DecoderCosts()
