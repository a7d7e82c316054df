"""Llama's terms for the memory plan: what a block saves for backward in one microbatch, counted from
the shapes tensor by tensor as the code saves them."""

from __future__ import annotations

from trainer.models.spec import FP32, Shapes


def stream_tokens(s: Shapes) -> int:
    """Tokens of the residual stream on a rank: split over the tp ranks under sequence parallel."""
    return s.tokens // s.tp if s.sequence_parallel and s.tp > 1 else s.tokens


def attention_saved(s: Shapes) -> tuple[float, float]:
    """(elements in the compute dtype, fp32 elements) the norms and attention of a block save."""
    t, tp, head = s.tokens, s.tp, s.head_dim
    elements = 2 * stream_tokens(s) * s.dim  # the two norms' inputs (and a float32 scale per token)
    elements += 2 * t * s.dim  # the (gathered) inputs of the q/k/v and the feed-forward projections
    q, kv = t * s.n_heads * head // tp, t * s.n_kv_heads * head // tp
    elements += q + 2 * kv  # q, k, v (after the rotary embedding)
    # Attention's output: the kernels lay it out [batch, seq, heads, head_dim], so the output projection's
    # input is a view of it.
    elements += q
    if s.cp > 1 and s.cp_method == "allgather":
        elements += 2 * kv * s.cp  # the gathered keys and values
    # Attention's log-sum-exp, the rotary cos and sin, the norms' scales.
    return elements, t * s.n_heads // tp + 2 * t * head + 2 * stream_tokens(s)


def activation_bytes(s: Shapes) -> float:
    """Bytes one block saves for backward in one microbatch (no checkpointing)."""
    elements, fp32 = attention_saved(s)
    elements += 3 * s.tokens * s.ffn_dim // s.tp  # gate, up, and the product of up and gate's SiLU
    return elements * s.act_bytes + fp32 * FP32


def attention_kept(s: Shapes, policy: str) -> tuple[float, float]:
    """Under selective checkpointing, (elements, the output projection's products into the stream)
    the block's input and attention keep: the outputs of its matmuls (under `half_mm` the first and
    third, q and v, but not k or the output projection's), its attention and the collectives that
    reduce into the residual stream."""
    t, tp, head = s.tokens, s.tp, s.head_dim
    stream = stream_tokens(s)
    q, kv = t * s.n_heads * head // tp, t * s.n_kv_heads * head // tp
    reduced = stream * s.dim if tp > 1 else 0  # with tensor parallel, the reduced copies
    # The output projections' products, and their reduced copies.
    into_stream = (t * s.dim if policy == "ops" else 0) + reduced
    projections = q + (2 if policy == "ops" else 1) * kv
    return stream * s.dim + projections + q + into_stream, into_stream


def selective_bytes(s: Shapes, policy: str) -> float:
    """Bytes a block under selective checkpointing keeps (the rest is recomputed): of the
    feed-forward, the gate's and up projection's outputs (`half_mm`: the gate's) and the down
    projection's."""
    elements, _ = attention_kept(s, policy)
    elements += (2 if policy == "ops" else 1) * s.tokens * s.ffn_dim // s.tp
    elements += s.tokens * s.dim + (stream_tokens(s) * s.dim if s.tp > 1 else 0)
    return elements * s.act_bytes + s.tokens * s.n_heads // s.tp * FP32  # attention's log-sum-exp
