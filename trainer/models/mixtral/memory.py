"""Mixtral's terms for the memory plan: Llama's attention, and the router and dropless experts in place
of the feed-forward (each token's top_k copies, the expert load assumed even unless given), and the
shared experts, a tensor-parallel feed-forward on every token."""

from __future__ import annotations

from trainer.models.llama.memory import attention_kept, attention_saved, stream_tokens
from trainer.models.spec import FP32, Shapes


def slots(s: Shapes) -> float:
    """(token, expert) pairs a rank's experts run: each tp rank routes its own slice of the sequence."""
    return s.tokens * s.top_k // (s.tp if s.sequence_parallel and s.tp > 1 else 1)


def shared_elements(s: Shapes, kept: int) -> float:
    """The shared experts' saved elements: `kept` of their gate, up and SiLU-product outputs, and
    their input gathered over the tp ranks (its own copy only under tensor parallel)."""
    if not s.n_shared_experts:
        return 0
    return kept * s.tokens * s.n_shared_experts * s.ffn_dim // s.tp + (s.tokens * s.dim if s.tp > 1 else 0)


def activation_bytes(s: Shapes) -> float:
    elements, fp32 = attention_saved(s)
    elements += slots(s) * s.expert_load * (2 * s.dim + 3 * s.ffn_dim) + shared_elements(s, 3)
    fp32 += stream_tokens(s) * s.n_experts * 3 + slots(s) * 2  # router logits and probabilities, routing weights
    return elements * s.act_bytes + fp32 * FP32


def selective_bytes(s: Shapes, policy: str) -> float:
    """The router's logits (its matmul is the block's fifth: kept by both policies); each token's
    top_k copies through the experts' three grouped matmuls."""
    elements, _ = attention_kept(s, policy)
    elements += stream_tokens(s) * s.n_experts + slots(s) * s.expert_load * (2 * s.ffn_dim + s.dim)
    elements += shared_elements(s, 2 if policy == "ops" else 1)
    return elements * s.act_bytes + s.tokens * s.n_heads // s.tp * FP32
