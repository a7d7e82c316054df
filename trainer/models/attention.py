"""Attention kernels, per device and with no knowledge of meshes: softmax(q k^T / sqrt(d)) v of a
block of queries [batch, heads, rows, d] against a block of keys [batch, kv_heads, cols, d] and
values [batch, kv_heads, cols, dv] (grouped-query: heads a multiple of kv_heads; values may be
narrower, as MLA's), causal or not, optionally under a `Mask` (keys by global index, within
documents).

- `attention`: the output, differentiable. The model's full attention and the all-gather
  context-parallel method call it.
- `block_forward` / `block_backward`: the output with its float32 log-sum-exp, and a block's
  gradients from the final output and log-sum-exp of the whole attention (flash attention's rule),
  for ring context parallel, which merges blocks.

Each case gets the fastest exact kernel its device has (`KERNELS`):

| device | attention          | attention + mask | block                 | block + mask     |
|--------|--------------------|------------------|-----------------------|------------------|
| cpu    | SDPA (CPU flash)   | CPU flash + mask | CPU flash             | CPU flash + mask |
| cuda   | SDPA (flash/cuDNN) | FlexAttention,   | flash (bf16/fp16),    | memory-efficient |
|        |                    | block-sparse     | else memory-efficient | + mask           |

"math" (float32 scores) is the reference and the kernel of any other device; the kernels are in
`trainer.models.attention_kernels`. CPU has no FlexAttention backward (torch 2.13), so a CPU mask
goes to the flash kernel as an additive mask, called directly rather than through SDPA, which cannot
pass `causal` with a mask: with it the kernel skips the blocks above the diagonal (full attention
within documents: 0.63 s against 0.89 s forward and backward, at batch 4, 16 heads, seq 2048).
"""

from __future__ import annotations

import math
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.attention_kernels import BACKWARD, FORWARD, Mask, visible

# Per device type and case, the kernel used; a device or case missing here gets "math".
# "narrow attention": values narrower than the keys (MLA's), where CPU's SDPA takes its math path
# (every score kept for backward) and CUDA's its memory-efficient or cuDNN kernel.
KERNELS = {
    "cpu": {"attention": "sdpa", "narrow attention": "cpu_flash", "masked attention": "cpu_flash",
            "block": "cpu_flash", "masked block": "cpu_flash"},
    "cuda": {"attention": "sdpa", "narrow attention": "sdpa", "masked attention": "flex",
             "block": "cuda_flash", "masked block": "efficient"},
}


def kernel(device_type: str, case: str) -> str:
    return KERNELS.get(device_type, {}).get(case, "math")


def attention(q, k, v, causal: bool = True, mask: Mask | None = None) -> torch.Tensor:
    """The attention output [batch, heads, rows, d]. `causal`: query i sees keys 0..i of the block;
    a `mask` restricts further. Every query must see at least one key."""
    case = "attention" if v.shape[-1] == q.shape[-1] else "narrow attention"
    name = kernel(q.device.type, case if mask is None else "masked attention")
    gqa = q.shape[1] != k.shape[1]
    if name == "sdpa":
        seen = None if mask is None else visible(mask, causal, q.shape[2], k.shape[2],
                                                 q.device)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=seen,
                                              is_causal=causal and mask is None, enable_gqa=gqa)
    if name == "flex":
        return _flex(q, k, v, causal, mask)  # takes values of their own width
    return _Attention.apply(q, k, v, causal, mask, name)


def kv_copies(kv_heads: int, u: int) -> int:
    """How many times grouped-query attention's key/value heads are repeated so that u ranks each
    take whole ones: lcm(kv_heads, u) / kv_heads (1 when u divides them). Each copy sends the keys
    and values again."""
    return math.lcm(kv_heads, u) // kv_heads


def block_forward(q, k, v, causal: bool,
                  mask: Mask | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The output [b, heads, rows, d] and its float32 log-sum-exp [b, heads, rows]. A row that sees
    no key gets output 0 and log-sum-exp -inf: no weight when blocks are merged."""
    name = kernel(q.device.type, "block" if mask is None else "masked block")
    return _forward(name, q, k, v, causal, mask)


def block_backward(dout, q, k, v, out, lse, causal: bool, mask: Mask | None = None):
    """dq, dk, dv of one block, from the final output and log-sum-exp of the attention it is part
    of."""
    name = kernel(q.device.type, "block" if mask is None else "masked block")
    return _backward(name, dout.contiguous(), q, k, v, out, lse, causal, mask)


def _forward(name: str, q, k, v, causal, mask):
    """FORWARD[name]. The fused kernels want values as wide as queries and keys: narrower ones
    (MLA's) are padded with zeros, which adds zero columns to the output, cut off (exact)."""
    width = v.shape[-1]
    if name == "math" or width == q.shape[-1]:
        return FORWARD[name](q, k, v, causal, mask)
    out, lse = FORWARD[name](q, k, _widened(v, q.shape[-1]), causal, mask)
    # The output's own copy, laid out [batch, rows, heads, dv] as the kernels lay theirs out: the
    # padded one is freed, and the output projection's input is a view of it.
    narrow = out.new_empty(out.shape[0], out.shape[2], out.shape[1], width).transpose(1, 2)
    return narrow.copy_(out[..., :width]), lse


def _backward(name: str, dout, q, k, v, out, lse, causal, mask):
    """BACKWARD[name], narrower values padded as in _forward: the zero columns of the output and its
    gradient add nothing to dq and dk, and their part of dv is cut off."""
    width = v.shape[-1]
    if name == "math" or width == q.shape[-1]:
        return BACKWARD[name](dout, q, k, v, out, lse, causal, mask)
    wide = q.shape[-1]
    dq, dk, dv = BACKWARD[name](_widened(dout, wide), q, k, _widened(v, wide), _widened(out, wide),
                                lse, causal, mask)
    return dq, dk, dv[..., :width]


def _widened(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


class _Attention(torch.autograd.Function):
    """A block kernel as a differentiable attention: one block is the whole attention."""

    @staticmethod
    def forward(ctx, q, k, v, causal, mask, name):
        out, lse = _forward(name, q, k, v, causal, mask)
        out = out.to(q.dtype)
        ctx.causal, ctx.mask, ctx.name = causal, mask, name
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = _backward(ctx.name, dout.contiguous(), q, k, v, out, lse, ctx.causal, ctx.mask)
        return *(g.to(x.dtype) for g, x in zip(grads, (q, k, v))), None, None, None


# --- FlexAttention: block-sparse masks -------------------------------------------------------


@cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Uncompiled, FlexAttention is a slow reference that materialises every score.
    return torch.compile(flex_attention, dynamic=False)


def _flex(q, k, v, causal: bool, mask: Mask | None):
    """FlexAttention with a block mask built from `mask` (None: causal or full): blocks no query
    sees are skipped."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def sees(b, h, i, j):
        seen = (j <= i) if causal else (j >= 0)
        return seen if mask is None else seen & mask.sees(b, i, j)

    batch = None if mask is None or mask.starts is None else q.shape[0]
    block_mask = create_block_mask(sees, batch, None, q.shape[2], k.shape[2], device=q.device)
    if q.device.type != "cuda":
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
    return _compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1],
                            kernel_options=_flex_blocks(q))


# Tiles for FlexAttention's kernels when a row of queries is over 512 bytes (fp32 heads over 128
# wide, MLA's 192 among them): Inductor's default tiles then need more shared memory than an
# H100/H200 has (seen: 279 KB asked, 227 KB there). Measured there to match the fp64 reference.
SMALL_FLEX_BLOCKS = {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1,
                     "bwd_BLOCK_M1": 16, "bwd_BLOCK_N1": 32, "bwd_BLOCK_M2": 32, "bwd_BLOCK_N2": 16}


def _flex_blocks(q: torch.Tensor) -> dict | None:
    return SMALL_FLEX_BLOCKS if q.shape[-1] * q.element_size() > 512 else None


class CausalAttention(nn.Module):
    """softmax(q k^T / sqrt(head_dim)) v, each position seeing itself and the ones before.
    q [batch, heads, seq, head_dim]; k and v may have fewer heads (grouped-query attention).
    Its own module so that a parallelism can swap in another kernel for the same function.

    With `within_documents` (data.document_mask) a position sees only the earlier ones of its own
    document: `positions` [batch, seq] then count from each document's start, so the token at
    index i with position p sees indices i-p..i."""

    within_documents = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        return causal_attention(q, k, v, positions if self.within_documents else None)


def causal_attention(q, k, v, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention over a whole sequence; with `positions` [batch, seq] (each token's position
    in its document) within each document."""
    if positions is None:
        return attention(q, k, v, causal=True)
    index = torch.arange(q.shape[2], device=q.device)
    return attention(q, k, v, causal=True, mask=Mask(index, index, index - positions))


def attend_within_documents(model: nn.Module) -> None:
    """Attention of every block stays within each document of a packed sequence."""
    for module in model.modules():
        if isinstance(module, CausalAttention):
            module.within_documents = True
