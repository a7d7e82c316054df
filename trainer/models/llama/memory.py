"""Llama's terms for the memory plan: what a block saves for backward in one microbatch, counted from
the shapes tensor by tensor as the code saves them."""

from __future__ import annotations

from trainer.models.spec import FP32, Shapes


def stream_tokens(s: Shapes) -> int:
    """Tokens of the residual stream on a rank: split over the tp ranks under sequence parallel."""
    return s.tokens // s.tp if s.sequence_parallel and s.tp > 1 else s.tokens


def attention_saved(s: Shapes) -> tuple[float, float]:
    """(elements in the compute dtype, fp32 elements) the norms and attention of a block save."""
    t, tp, head = s.tokens, s.tp, s.dim // s.n_heads
    elements = 2 * stream_tokens(s) * s.dim  # the two norms' inputs
    elements += 2 * t * s.dim  # the (gathered) inputs of the q/k/v and the feed-forward projections
    kv = t * s.n_kv_heads * head // tp
    elements += t * s.dim // tp + 2 * kv  # q, k, v (after the rotary embedding)
    elements += 2 * t * s.dim // tp  # attention's output and its copy into the output projection
    if s.cp > 1 and s.cp_method == "allgather":
        elements += 2 * kv * s.cp  # the gathered keys and values
    return elements, t * s.n_heads // tp + 2 * t * head  # attention's log-sum-exp; the rotary cos and sin


def activation_bytes(s: Shapes) -> float:
    """Bytes one block saves for backward in one microbatch (no checkpointing)."""
    elements, fp32 = attention_saved(s)
    elements += 4 * s.tokens * s.ffn_dim // s.tp  # gate, its SiLU, up, and their product
    return elements * s.act_bytes + fp32 * FP32


def attention_kept(s: Shapes) -> tuple[float, float]:
    """Under selective checkpointing, (elements, the output projection's products into the stream)
    the block's input and attention keep: the outputs of its matmuls, its attention and the
    collectives that reduce into the residual stream."""
    t, tp, head = s.tokens, s.tp, s.dim // s.n_heads
    stream = stream_tokens(s)
    kv = t * s.n_kv_heads * head // tp
    # The output projections' products, and with tensor parallel their reduced copies.
    into_stream = t * s.dim + (stream * s.dim if tp > 1 else 0)
    return stream * s.dim + t * s.dim // tp + 2 * kv + t * s.dim // tp + into_stream, into_stream


def selective_bytes(s: Shapes) -> float:
    """Bytes a block under selective checkpointing keeps (the rest is recomputed)."""
    elements, into_stream = attention_kept(s)
    elements += 2 * s.tokens * s.ffn_dim // s.tp + into_stream
    return elements * s.act_bytes + s.tokens * s.n_heads // s.tp * FP32  # attention's log-sum-exp
