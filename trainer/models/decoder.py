"""The decoder's building blocks that families share: rotary embeddings (with Llama 3.1's scaling),
grouped-query attention (with Qwen3's optional q/k norms), the pre-norm block, and `Decoder`, the
frame of a model (embedding, blocks, final norm, output head). Plain PyTorch.

Rotary embeddings use the half-split ("rotate half") layout of Hugging Face's Llama so that its
weights load without permutation. Blocks live in a ModuleDict keyed by their index, so a model
that keeps only some of them (a pipeline stage) keeps the parameter names of the whole model; such
a model may also have no embedding (it takes hidden states) or no norm and output (it returns them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from trainer.config.schema import ModelConfig, shape
from trainer.errors import ConfigError
from trainer.models.attention import CausalAttention
from trainer.models.head import LMHead
from trainer.models.layers import RMSNorm
from trainer.models.moe import MoE


@dataclass
class HeadDimConfig:
    """The key of a family whose attention heads have a width of their own (Qwen3), not dim /
    n_heads."""

    head_dim: int | None = shape(None)  # null: dim / n_heads

    def __post_init__(self):
        # Resolved, so that a checkpoint saved with null compares equal to one saved with the width.
        if self.head_dim is None and self.dim % self.n_heads == 0:
            self.head_dim = self.dim // self.n_heads


def head_width(cfg: ModelConfig) -> int:
    """The width of one attention head: the family's head_dim, else dim / n_heads."""
    return (cfg.head_dim if isinstance(cfg, HeadDimConfig) else None) or cfg.dim // cfg.n_heads


def check_heads(cfg: ModelConfig) -> None:
    """The rules of grouped-query attention's keys (ConfigError)."""
    own = cfg.head_dim if isinstance(cfg, HeadDimConfig) else None
    if own is not None and own < 1:
        raise ConfigError(f"model.head_dim={own} must be >= 1, or null (dim / n_heads)")
    if own is None and cfg.dim % cfg.n_heads:
        hint = " (or set model.head_dim)" if isinstance(cfg, HeadDimConfig) else ""
        raise ConfigError(f"model.n_heads={cfg.n_heads} must divide model.dim={cfg.dim} (the heads "
                          f"split it){hint}")
    if head_width(cfg) % 2:
        key = (f"model.head_dim={own}" if own is not None
               else f"model.dim={cfg.dim} / model.n_heads={cfg.n_heads}")
        raise ConfigError(f"{key} (a head's width: {head_width(cfg)}) must be even: the rotary "
                          "embedding turns pairs of dimensions")
    if cfg.n_heads % cfg.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads={cfg.n_kv_heads} must divide "
                          f"model.n_heads={cfg.n_heads} (each key/value head serves a group of "
                          "query heads)")


def rope_frequencies(head_dim: int, theta: float, scaling=None, device=None) -> torch.Tensor:
    """The rotary angular frequencies [head_dim / 2], scaled as `scaling` (a `RopeScaling`) says."""
    even = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
    freqs = 1.0 / (theta ** (even / head_dim))
    if scaling is None:
        return freqs
    if scaling.type == "yarn":
        return _yarn(freqs, head_dim, theta, scaling)
    # Llama 3.1: where each wavelength lies between the high- and the low-frequency bound: 1 at or
    # below the first (kept), 0 at or above the second (divided by the factor).
    wavelengths_per_context = scaling.original_max_seq_len * freqs / (2 * math.pi)
    kept = ((wavelengths_per_context - scaling.low_freq_factor)
            / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0.0, 1.0)
    return kept * freqs + (1 - kept) * freqs / scaling.factor


def _yarn(freqs: torch.Tensor, head_dim: int, theta: float, scaling) -> torch.Tensor:
    """YaRN: frequencies kept above the dimension that turns beta_fast times over the original
    context, divided by the factor below the one that turns beta_slow times, a linear ramp
    between."""
    def dimension(turns: float) -> float:  # the (fractional) dimension turning `turns` times
        wavelengths = scaling.original_max_seq_len / (turns * 2 * math.pi)
        return head_dim * math.log(wavelengths) / (2 * math.log(theta))

    low = max(math.floor(dimension(scaling.beta_fast)), 0)
    high = min(math.ceil(dimension(scaling.beta_slow)), head_dim - 1)
    high = high + 0.001 if low == high else high
    pairs = torch.arange(head_dim // 2, dtype=torch.float32, device=freqs.device)
    ramp = ((pairs - low) / (high - low)).clamp(0, 1)
    return freqs / scaling.factor * ramp + freqs * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a context `factor` times the original one."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor, 1 otherwise."""
    if scaling is None or scaling.type != "yarn":
        return 1.0
    if scaling.mscale and scaling.mscale_all_dim:
        return (yarn_mscale(scaling.factor, scaling.mscale)
                / yarn_mscale(scaling.factor, scaling.mscale_all_dim))
    return yarn_mscale(scaling.factor)


def rope_cos_sin(positions: torch.Tensor, freqs: torch.Tensor,
                 factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [batch, seq] -> cos, sin [batch, seq, head_dim], times `factor`
    (rope_attention_factor)."""
    angles = positions[..., None].float() * freqs
    angles = torch.cat([angles, angles], dim=-1)
    if factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * factor, angles.sin() * factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool = False) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim]; cos, sin: [batch, seq, head_dim] (both halves alike).

    Each pair (x[i], x[i + head_dim/2]) turns by its angle, as a complex product in float32 (fewer,
    cheaper kernels than cat, neg and four products; no bf16 rounding of cos and sin). Backward
    turns the gradient back by the same angle, so nothing but cos and sin is saved. `interleaved`
    (DeepSeek's weights): the pairs are (x[2i], x[2i + 1]), and the result is laid out as the
    half-split one (a permutation queries and keys share, so their products are the same)."""
    return _Rotate.apply(x, cos, sin, interleaved)


class _Rotate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, interleaved):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _turn(x, cos, sin, interleaved)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        grad = _turn(grad, cos, -sin, False)
        # back to the input's layout: the halves' elements at even and odd places
        if ctx.interleaved:
            grad = grad.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)
        return grad, None, None, None


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    half = x.shape[-1] // 2
    first, second = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    pairs = torch.complex(first.float(), second.float())
    turn = torch.complex(cos[:, :, None, :half], sin[:, :, None, :half])
    return torch.view_as_real(pairs * turn).transpose(-1, -2).flatten(-2).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings, heads `head_dim` wide. `qk_norm` (Qwen3):
    each head's queries and keys pass an RMSNorm over the head dimension (one weight shared by the
    heads) before the rotation."""

    def __init__(self, cfg: ModelConfig, head_dim: int, qk_norm: bool = False):
        super().__init__()
        dim, n_heads, n_kv_heads = cfg.dim, cfg.n_heads, cfg.n_kv_heads
        self.head_dim = head_dim
        self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=cfg.norm_eps)
            self.k_norm = RMSNorm(head_dim, eps=cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.sdpa = CausalAttention()

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # Shapes from the projections, not x: under tensor parallel each rank holds its share of
        # the heads, and under sequence parallel x may be a slice that the projections gather.
        batch, seq = q.shape[:2]
        q = q.view(batch, seq, -1, self.head_dim)
        k = k.view(batch, seq, -1, self.head_dim)
        v = v.view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        freqs = rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling, x.device)
        cos, sin = rope_cos_sin(positions, freqs, rope_attention_factor(self.rope_scaling))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.sdpa(*(t.transpose(1, 2) for t in (q, k, v)), positions)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, norm_eps: float, attention: nn.Module, feed_forward: nn.Module):
        super().__init__()
        self.attention_norm = RMSNorm(dim, eps=norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(dim, eps=norm_eps)
        self.feed_forward = feed_forward

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), positions)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    """The frame of a decoder: embedding, blocks (TransformerBlock), final norm, output head (an
    LMHead). A family's model subclasses it, saying what block `layer` holds (`make_attention`,
    `make_feed_forward`) and which parameters write into the residual stream (`residual_outputs`:
    name endings, scaled down with depth at initialisation)."""

    residual_outputs: tuple[str, ...] = ("attention.wo.weight", "feed_forward.w2.weight")

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.n_layers = cfg.n_layers
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({
            str(i): TransformerBlock(cfg.dim, cfg.norm_eps, self.make_attention(cfg, i),
                                     self.make_feed_forward(cfg, i))
            for i in range(cfg.n_layers)
        })
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = LMHead(cfg.dim, cfg.vocab_size)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def make_attention(self, cfg: ModelConfig, layer: int) -> nn.Module:
        raise NotImplementedError

    def make_feed_forward(self, cfg: ModelConfig, layer: int) -> nn.Module:
        raise NotImplementedError

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [batch, seq] -> logits [batch, seq, vocab], or with labels [batch, seq] their mean
        cross-entropy (LMHead); hidden states in, out, for a pipeline stage without the head.

        positions [batch, seq]: each token's position for the rotary embedding, 0..seq-1 if None.
        """
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[:2])
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, positions)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h, labels) if self.output is not None else h

    def init_std(self, name: str) -> float | None:
        """The std of the normal a parameter starts from; None for ones (the norm weights).

        Projections that write into the residual stream are scaled down with depth (GPT-2).
        """
        if name.endswith("norm.weight"):
            return None
        if name.endswith(self.residual_outputs):
            return 0.02 / math.sqrt(2 * self.n_layers)
        return 0.02


def moe_block_regions(block: TransformerBlock) -> list[nn.Module]:
    """A block with an MoE layer, in the parts selective checkpointing takes each on its own when
    the experts are an FSDP unit of their own: attention, the experts, the shared experts (a block
    without one: the whole block)."""
    moe = block.feed_forward
    if not isinstance(moe, MoE):
        return [block]
    return [block.attention, moe.experts, *([moe.shared] if moe.shared is not None else [])]
