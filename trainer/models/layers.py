"""RMSNorm and the SwiGLU product with their own backward, so that they save less for it.

Written as plain operators, an RMSNorm saves its input upcast to float32 and the normalized input
(two float32 tensors the size of the residual stream, 8 bytes an element under bf16), and
`silu(gate) * up` saves the SiLU's output beside gate and up. Here the norm saves its input as
it came and one float32 scale per token, and the product saves gate and up only; backward
recomputes the rest (elementwise work). Forward computes exactly what torch's `nn.RMSNorm` and
`F.silu(gate) * up` compute. FeedForward is the SwiGLU block built from that product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm (same parameter, same forward), saving its input and a scale per token."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:  # no affine weight: nothing of ours to save
            return super().forward(x)
        eps = torch.finfo(torch.float32).eps if self.eps is None else self.eps
        return _RMSNorm.apply(x, self.weight, eps)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in the dtype the norm computes in: float32, or float64 for float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        wide = _wide(x)
        scale = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, scale)
        return (wide * scale * weight).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, scale = ctx.saved_tensors
        normed = _wide(x) * scale
        grad = _wide(grad)
        grad_normed = grad * weight
        # d normed_i / d x_j = scale * (delta_ij - normed_i * normed_j / n)
        grad_x = scale * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        grad_weight = (grad * normed).sum(tuple(range(grad.ndim - 1)))
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, saving gate and up only."""
    return _SwiGLU.apply(gate, up)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        # The plain operators' backward, with the SiLU recomputed: silu_backward is the SiLU's own
        # derivative kernel (one pass, computed in float32 for bf16 as torch's autograd does).
        return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)


class FeedForward(nn.Module):
    """The SwiGLU feed-forward: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))
