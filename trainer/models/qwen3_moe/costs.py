"""Qwen3-MoE's FLOPs and memory terms: the shared decoder's, with q/k norms and an MoE layer in
every block."""

from trainer.models.costs import DecoderCosts

COSTS = DecoderCosts(qk_norm=True)
