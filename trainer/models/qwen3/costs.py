"""Qwen3's FLOPs and memory terms: the shared decoder's, with q/k norms."""

from trainer.models.costs import DecoderCosts

COSTS = DecoderCosts(qk_norm=True)
