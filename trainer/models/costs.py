"""What the plan asks a family about its blocks (`Costs`): FLOPs per token, and the bytes a block
saves for backward on one rank, counted from the model config and the rank's shapes tensor by
tensor as the code saves them. The terms of the shared building blocks (grouped-query attention,
the SwiGLU feed-forward, the MoE layer, q/k norms) are here for the families to add up."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.schema import ModelConfig
from trainer.models.attention import kv_copies
from trainer.models.decoder import head_width
from trainer.models.moe_config import MoEConfig

# Bytes of an fp32 element.
FP32 = 4


@dataclass
class Shapes:
    """What one rank's blocks see in one microbatch under a layout."""

    model: ModelConfig
    tokens: int  # tokens of the microbatch on this rank (batch x seq / cp)
    tp: int
    cp: int
    sequence_parallel: bool
    loss_parallel: bool
    cp_method: str
    act_bytes: int  # bytes per element of activations (the compute dtype)
    cp_ulysses: int = 1  # of cp, the ranks of a Ulysses group (cp_ring = cp / cp_ulysses)
    expert_load: float = 1.0  # the slots this rank's experts take, over an even share
    # tokens per chunk of the output head and loss (None: all at once)
    loss_chunk: int | None = None
    # Expert parallel: the experts an FSDP unit of their own, and under selective checkpointing a
    # region of their own (the spec's checkpoint_regions),
    # so what flows between the regions is kept.
    experts_apart: bool = False

    @property
    def cp_ring(self) -> int:
        return self.cp // self.cp_ulysses

    def kv_copies(self, kv_heads: int) -> int:
        """How many times Ulysses repeats each of a rank's `kv_heads` key/value heads (its
        group's ranks take whole ones); 1 without Ulysses."""
        return kv_copies(kv_heads // self.tp, self.cp_ulysses) if self.cp_ulysses > 1 else 1

    @property
    def stream_tokens(self) -> int:
        """Tokens of the residual stream on a rank: split over the tp ranks under sequence
        parallel."""
        return self.tokens // self.tp if self.sequence_parallel and self.tp > 1 else self.tokens


@dataclass(frozen=True)
class Flops:
    """Training FLOPs per token (forward and backward), by where they are spent."""

    blocks: float  # the blocks' matmuls with weights: 6 per weight that multiplies a token
    attention: float  # the blocks' score and value products (causal masking not discounted)
    head: float  # the output projection
    float8: float = 0.0  # of `blocks`, what runs in the linear layers float8 converts

    @property
    def total(self) -> float:
        return self.blocks + self.attention + self.head


class Costs:
    """A family's cost terms; `layer` is a block's index (blocks of one model may differ)."""

    def flops(self, cfg: ModelConfig, seq_len: int) -> Flops:
        raise NotImplementedError

    def float8_params(self, cfg: ModelConfig) -> float:
        """The share of a block's parameters in the linear layers float8 converts."""
        return 1.0

    def activation_bytes(self, s: Shapes, layer: int) -> float:
        """Bytes block `layer` saves for backward in one microbatch (no checkpointing)."""
        raise NotImplementedError

    def selective_bytes(self, s: Shapes, layer: int, policy: str) -> float:
        """Bytes it keeps under selective checkpointing (`policy`: half_mm | ops)."""
        raise NotImplementedError

    def context_bytes(self, s: Shapes) -> float:
        """What ring context parallel passes between ranks per block and microbatch: the keys and
        values a ring rank holds (under the hybrid, its Ulysses group's sequence for its heads)."""
        return 0.0

    def ulysses_bytes(self, s: Shapes) -> float:
        """What Ulysses' all-to-alls send from a rank per block forward and microbatch: q, k and v
        (key/value heads repeated as needed) and the output, all but the rank's own share."""
        return 0.0

    def expert_bytes(self, s: Shapes) -> float:
        """What expert parallel sends per MoE block and microbatch, each way: the tokens' routed
        copies."""
        return 0.0


# Grouped-query attention with rotary embeddings (trainer.models.decoder.Attention).

def gqa_weights(cfg: ModelConfig, head_dim: int) -> int:
    """The weights of one block's q/k/v and output projections."""
    return cfg.dim * head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)


def scores_flops(n_heads: int, qk_dim: int, v_dim: int, seq_len: int) -> float:
    """Training FLOPs per token of one block's score and value products: 2 x 3 x heads x widths x
    seq."""
    return 6 * n_heads * (qk_dim + v_dim) * seq_len


def gqa_saved(s: Shapes, head_dim: int) -> tuple[float, float]:
    """(elements in the compute dtype, fp32 elements) the norms and attention of a block save."""
    m, t, tp = s.model, s.tokens, s.tp
    elements = 2 * s.stream_tokens * m.dim  # the two norms' inputs (and a float32 scale per token)
    elements += 2 * t * m.dim  # the (gathered) inputs of the q/k/v and the feed-forward projections
    q, kv = t * m.n_heads * head_dim // tp, t * m.n_kv_heads * head_dim // tp
    elements += q + 2 * kv  # q, k, v (after the rotary embedding)
    # Attention's output: the kernels lay it out [batch, seq, heads, head_dim], so the output
    # projection's input is a view of it.
    elements += q
    copies = s.kv_copies(m.n_kv_heads)
    if s.cp_ulysses > 1:
        # The output's copy back in sequence slices (the projection's input); keys and values
        # held repeated.
        elements += q + 2 * kv * (copies - 1)
    if s.cp_ring > 1 and s.cp_method == "allgather":
        elements += 2 * kv * copies * s.cp_ring  # the gathered keys and values
    # Attention's log-sum-exp, the rotary cos and sin, the norms' scales.
    return elements, t * m.n_heads // tp + 2 * t * head_dim + 2 * s.stream_tokens


def gqa_kept(s: Shapes, head_dim: int, policy: str) -> float:
    """Elements the block's input and attention keep under selective checkpointing: the outputs of
    its matmuls (under `half_mm` the first and third, q and v, but not k or the output
    projection's), its attention, Ulysses' all-to-alls and the collectives that reduce into the
    residual stream."""
    m, t, tp = s.model, s.tokens, s.tp
    q, kv = t * m.n_heads * head_dim // tp, t * m.n_kv_heads * head_dim // tp
    projections = q + (2 if policy == "ops" else 1) * kv
    ulysses = ulysses_elements(s, m.n_heads, m.n_kv_heads, head_dim, head_dim)
    return s.stream_tokens * m.dim + projections + q + ulysses + into_stream(s, policy)


def into_stream(s: Shapes, policy: str) -> float:
    """Under selective checkpointing, the elements an output projection keeps of its product into
    the residual stream (`ops` only) and, with tensor parallel, of the reduced copy."""
    stream = s.tokens * s.model.dim if policy == "ops" else 0
    return stream + (s.stream_tokens * s.model.dim if s.tp > 1 else 0)


def matmuls_kept(outputs: list[float], policy: str) -> float:
    """Of a block's matmul outputs (elements, in forward order), what selective checkpointing keeps:
    every one (`ops`), or the first, third, ... (`half_mm`)."""
    return sum(outputs) if policy == "ops" else sum(outputs[::2])


def gqa_context_bytes(s: Shapes, head_dim: int) -> float:
    kv = s.model.n_kv_heads
    return 2 * s.tokens * kv * s.kv_copies(kv) * head_dim // s.tp * s.act_bytes


def ulysses_sent(s: Shapes, q_heads: int, kv_heads: int, qk_dim: int, v_dim: int) -> float:
    """Bytes a rank's all-to-alls send per block forward: q and the output (`q_heads`), k and v
    (`kv_heads`, repeated as needed), all but the rank's own 1/u."""
    u = s.cp_ulysses
    return ulysses_elements(s, q_heads, kv_heads, qk_dim, v_dim) * (u - 1) / u * s.act_bytes


def ulysses_elements(s: Shapes, q_heads: int, kv_heads: int, qk_dim: int, v_dim: int) -> float:
    """The elements of a rank's Ulysses all-to-alls per block forward (what each sends and
    receives; selective checkpointing keeps what they receive)."""
    if s.cp_ulysses == 1:
        return 0.0
    kv = kv_heads * s.kv_copies(kv_heads)
    return s.tokens * (q_heads * (qk_dim + v_dim) + kv * (qk_dim + v_dim)) // s.tp


def lse_bytes(s: Shapes) -> float:
    """Attention's log-sum-exp, kept by every checkpointing policy."""
    return s.tokens * s.model.n_heads // s.tp * FP32


def qk_norm_bytes(s: Shapes, head_dim: int) -> float:
    """What q/k norms save: their inputs (q and k before the norm) and a float32 scale per head and
    token."""
    rows = s.tokens * (s.model.n_heads + s.model.n_kv_heads) // s.tp
    return rows * head_dim * s.act_bytes + rows * FP32


# The SwiGLU feed-forward (trainer.models.layers.FeedForward), `width` wide.

def swiglu_saved(s: Shapes, width: int) -> float:
    """Elements saved: gate, up, and the product of up and gate's SiLU."""
    return 3 * s.tokens * width // s.tp


def swiglu_kept(s: Shapes, width: int, policy: str) -> float:
    """Elements kept under selective checkpointing: the gate's and up projection's outputs
    (`half_mm`: the gate's) and the down projection's into the stream."""
    return (2 if policy == "ops" else 1) * s.tokens * width // s.tp + s.tokens * s.model.dim + (
        s.stream_tokens * s.model.dim if s.tp > 1 else 0)


# The MoE layer (trainer.models.moe.MoE): dropless experts, the expert load assumed even unless
# given; shared experts, a tensor-parallel feed-forward on every token.

def moe_slots(s: Shapes, top_k: int) -> float:
    """(token, expert) pairs a rank's experts run: each tp rank routes its own slice of the
    sequence."""
    return s.stream_tokens * top_k


def shared_elements(s: Shapes, width: int, kept: int) -> float:
    """Shared experts `width` wide in all: `kept` of their gate, up and SiLU-product outputs, and
    their input gathered over the tp ranks (its own copy only under tensor parallel)."""
    if not width:
        return 0
    return kept * s.tokens * width // s.tp + (s.tokens * s.model.dim if s.tp > 1 else 0)


def moe_saved(s: Shapes, n_experts: int, top_k: int, width: int,
              shared_width: int) -> tuple[float, float]:
    """(elements in the compute dtype, fp32 elements): each slot's input, its expert's output and
    that output weighted (which the sum back into tokens keeps), and its three expert activations;
    the router's logits and probabilities and the routing weights."""
    slots = moe_slots(s, top_k)
    elements = (slots * s.expert_load * (3 * s.model.dim + 3 * width)
                + shared_elements(s, shared_width, 3))
    return elements, s.stream_tokens * n_experts * 3 + slots * 2


def moe_kept(s: Shapes, n_experts: int, top_k: int, width: int, shared_width: int,
             policy: str) -> float:
    """Elements kept under selective checkpointing: the router's logits (its matmul is the block's
    fifth: kept by both policies); each token's top_k copies through the experts' three grouped
    matmuls, and with the experts a region of their own, what flows around it (each slot's input,
    its expert's output and that output weighted)."""
    per_slot = 2 * width + s.model.dim + (3 * s.model.dim if s.experts_apart else 0)
    elements = s.stream_tokens * n_experts + moe_slots(s, top_k) * s.expert_load * per_slot
    return elements + shared_elements(s, shared_width, 2 if policy == "ops" else 1)


class DecoderCosts(Costs):
    """The shared decoder's (trainer.models.decoder): grouped-query attention (with q/k norms if
    `qk_norm`), and a SwiGLU feed-forward or, for a config with MoE keys, an MoE layer in every
    block."""

    def __init__(self, qk_norm: bool = False):
        self.qk_norm = qk_norm

    def flops(self, cfg: ModelConfig, seq_len: int) -> Flops:
        """6 per weight that multiplies a token (an MoE: its top_k routed experts, the shared ones
        and the router) and attention's products."""
        head = head_width(cfg)
        attention, ffn = gqa_weights(cfg, head), 3 * cfg.dim * cfg.ffn_dim
        dense = attention + (ffn * cfg.n_shared_experts if isinstance(cfg, MoEConfig) else ffn)
        routed = ffn * cfg.top_k + cfg.dim * cfg.n_experts if isinstance(cfg, MoEConfig) else 0
        return Flops(blocks=6 * cfg.n_layers * (dense + routed),
                     attention=cfg.n_layers * scores_flops(cfg.n_heads, head, head, seq_len),
                     head=6 * cfg.dim * cfg.vocab_size, float8=6 * cfg.n_layers * dense)

    def float8_params(self, cfg: ModelConfig) -> float:
        """All a dense block's; of an MoE block, attention and the shared experts (plain linear
        layers), not the experts' grouped GEMMs or the router."""
        if not isinstance(cfg, MoEConfig):
            return 1.0
        ffn = 3 * cfg.dim * cfg.ffn_dim
        dense = gqa_weights(cfg, head_width(cfg)) + cfg.n_shared_experts * ffn
        return dense / (dense + cfg.n_experts * ffn + cfg.dim * cfg.n_experts)

    def activation_bytes(self, s: Shapes, layer: int) -> float:
        m, head = s.model, head_width(s.model)
        elements, fp32 = gqa_saved(s, head)
        if isinstance(m, MoEConfig):
            moe, moe_fp32 = moe_saved(s, m.n_experts, m.top_k, m.ffn_dim,
                                      m.n_shared_experts * m.ffn_dim)
            elements, fp32 = elements + moe, fp32 + moe_fp32
        else:
            elements += swiglu_saved(s, m.ffn_dim)
        norms = qk_norm_bytes(s, head) if self.qk_norm else 0.0
        return elements * s.act_bytes + fp32 * FP32 + norms

    def selective_bytes(self, s: Shapes, layer: int, policy: str) -> float:
        m, head = s.model, head_width(s.model)
        elements = gqa_kept(s, head, policy)
        if isinstance(m, MoEConfig):
            elements += moe_kept(s, m.n_experts, m.top_k, m.ffn_dim, m.n_shared_experts * m.ffn_dim,
                                 policy)
        else:
            elements += swiglu_kept(s, m.ffn_dim, policy)
        return elements * s.act_bytes + lse_bytes(s)

    def context_bytes(self, s: Shapes) -> float:
        return gqa_context_bytes(s, head_width(s.model))

    def ulysses_bytes(self, s: Shapes) -> float:
        head = head_width(s.model)
        return ulysses_sent(s, s.model.n_heads, s.model.n_kv_heads, head, head)

    def expert_bytes(self, s: Shapes) -> float:
        if not isinstance(s.model, MoEConfig):
            return 0.0
        return s.tokens * s.model.top_k * s.model.dim * s.act_bytes
