"""The block kernels behind `trainer.models.attention`, one pair per name in `FORWARD` / `BACKWARD`:
forward (q, k, v, causal, mask) -> (output, float32 log-sum-exp) and backward -> (dq, dk, dv) from
the final output and log-sum-exp. "math" is the float32 reference; the fused ones wrap torch's
per-kernel ops. Which kernel a device and case get is chosen in `trainer.models.attention`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Mask:
    """Query i sees key j when keys[j] <= queries[i] and, within documents, keys[j] >= starts[b, i]:
    `queries` [rows] and `keys` [cols] are global indices in the sequence, `starts` [batch, rows]
    the index at which each query's document starts (None: no documents, causal by index)."""

    queries: torch.Tensor
    keys: torch.Tensor
    starts: torch.Tensor | None = None

    def dense(self) -> torch.Tensor:
        """[batch (or 1), rows, cols] booleans: whether each query sees each key."""
        seen = self.keys[None, None, :] <= self.queries[None, :, None]
        return seen if self.starts is None else seen & (self.keys[None, None, :]
                                                        >= self.starts[:, :, None])

    def sees(self, b, i, j) -> torch.Tensor:
        """The same for index tensors (FlexAttention's mask function)."""
        seen = self.keys[j] <= self.queries[i]
        return seen if self.starts is None else seen & (self.keys[j] >= self.starts[b, i])


def visible(mask: Mask | None, causal: bool, rows: int, cols: int, device) -> torch.Tensor | None:
    """[batch (or 1), rows, cols]: the mask with the block's causal triangle (None if neither)."""
    if mask is None and not causal:
        return None
    seen = mask.dense() if mask is not None else torch.ones(1, rows, cols, dtype=torch.bool,
                                                            device=device)
    if causal:
        seen = seen & torch.ones(rows, cols, dtype=torch.bool, device=device).tril()
    return seen


# --- math: the reference ---------------------------------------------------------------------


def _group_heads(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, heads, ...] -> [b, kv_heads, groups, ...]: query head h uses K/V head h // groups."""
    return x.unflatten(1, (kv_heads, -1))


def _scores(qg, k, causal: bool, mask: Mask | None) -> torch.Tensor:
    """Scaled float32 scores of grouped queries [b, kv_heads, groups, rows, d] against k [b,
    kv_heads, cols, d]."""
    scores = qg.float() @ k.float()[:, :, None].transpose(-1, -2) * qg.shape[-1] ** -0.5
    seen = visible(mask, causal, *scores.shape[-2:], scores.device)
    return scores if seen is None else scores.masked_fill(~seen[:, None, None], float("-inf"))


def _math_forward(q, k, v, causal, mask):
    scores = _scores(_group_heads(q, k.shape[1]), k, causal, mask)
    lse = scores.logsumexp(-1)
    out = (scores - lse.nan_to_num(neginf=0.0)[..., None]).exp() @ v.float()[:, :, None]
    return out.flatten(1, 2), lse.flatten(1, 2)


def _math_backward(dout, q, k, v, out, lse, causal, mask):
    qg, dout, out, lse = (_group_heads(x, k.shape[1]).float() for x in (q, dout, out, lse))
    k32, v32 = k.float(), v.float()
    probs = (_scores(qg, k32, causal, mask) - lse[..., None]).exp()
    dv = (probs.transpose(-1, -2) @ dout).sum(2)
    delta = (dout * out).sum(-1, keepdim=True)
    dscores = probs * (dout @ v32[:, :, None].transpose(-1, -2) - delta) * q.shape[-1] ** -0.5
    return (dscores @ k32[:, :, None]).flatten(1, 2), (dscores.transpose(-1, -2) @ qg).sum(2), dv


# --- fused kernels ---------------------------------------------------------------------------
# The fused kernels return the log-sum-exp that merging blocks needs, and take a final one in
# backward, only through torch's private per-kernel ops (the public scaled_dot_product_attention
# hides both); they are called here and nowhere else.


def _additive(seen: torch.Tensor, dtype: torch.dtype, cols_multiple: int = 1) -> torch.Tensor:
    """Booleans [b, rows, cols] as a kernel's additive mask [b, 1, rows, cols]: 0 seen, -inf not.
    Its rows are allocated `cols_multiple`-aligned (the memory-efficient kernel wants 16)."""
    cols = seen.shape[-1]
    padded = math.ceil(cols / cols_multiple) * cols_multiple
    bias = torch.zeros(*seen.shape[:-1], padded, dtype=dtype, device=seen.device)[..., :cols]
    return bias.masked_fill_(~seen, float("-inf"))[:, None]


def _blind_rows_to_zero(out, lse, seen: torch.Tensor | None):
    """A row that sees no key: output 0 and log-sum-exp -inf (the kernels leave it finite or
    NaN)."""
    if seen is None:
        return out, lse
    blind = ~seen.any(-1)[:, None]
    return out.masked_fill(blind[..., None], 0.0), lse.masked_fill(blind, float("-inf"))


def _cpu_flash_forward(q, k, v, causal, mask):
    # Takes grouped-query K/V as they are; with a mask, `causal` still skips the upper triangle.
    seen = None if mask is None else mask.dense()
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=None if seen is None else _additive(seen, q.dtype))
    return _blind_rows_to_zero(out, lse, seen)


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, mask):
    bias = None if mask is None else _additive(mask.dense(), q.dtype)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias)


def _flash_takes(q, mask) -> bool:
    # CUDA's flash kernel has no float32 form and takes
    # no mask: those go to the memory-efficient one.
    return q.dtype in (torch.float16, torch.bfloat16) and mask is None


def _cuda_flash_forward(q, k, v, causal, mask):
    if not _flash_takes(q, mask):
        return _efficient_forward(q, k, v, causal, mask)
    # Grouped-query K/V as they are.
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
    return out, lse


def _cuda_flash_backward(dout, q, k, v, out, lse, causal, mask):
    if not _flash_takes(q, mask):
        return _efficient_backward(dout, q, k, v, out, lse, causal, mask)
    # No dropout: the random-number state the kernel takes is never read.
    rng = (torch.zeros(2, dtype=torch.uint64, device=q.device),
           torch.zeros((), dtype=torch.uint64, device=q.device))
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out.to(q.dtype), lse, None, None, q.shape[2], k.shape[2], 0.0, causal,
        *rng)[:3]


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _efficient_forward(q, k, v, causal, mask):
    # The memory-efficient kernel takes an additive mask but no grouped-query K/V: heads repeated.
    seen = None if mask is None else mask.dense()
    bias = None if seen is None else _additive(seen, q.dtype, 16).expand(-1, q.shape[1], -1, -1)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1]), bias, True, 0.0, causal)
    # Its log-sum-exp comes padded to a multiple of 32 rows.
    return _blind_rows_to_zero(out, lse[..., :q.shape[2]], seen)


def _efficient_backward(dout, q, k, v, out, lse, causal, mask):
    heads, rows = q.shape[1], q.shape[2]
    bias = None if mask is None else _additive(mask.dense(), q.dtype, 16).expand(-1, heads, -1, -1)
    padded = rows if torch.version.hip else math.ceil(rows / 32) * 32  # as the forward returns it
    lse = F.pad(lse, (0, padded - rows)).contiguous()
    seed = torch.zeros((), dtype=torch.long, device=q.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, _repeat_kv(k, heads), _repeat_kv(v, heads), bias, _rows_major(out.to(q.dtype)),
        lse, seed, seed, 0.0, [True, True, True, False], causal)
    return dq, _group_heads(dk, k.shape[1]).sum(2), _group_heads(dv, k.shape[1]).sum(2)


def _rows_major(out: torch.Tensor) -> torch.Tensor:
    """[b, heads, rows, d] laid out [b, rows, heads, d] in memory, as the memory-efficient kernel's
    forward writes it: its half-precision backward reads the output with that row stride whatever
    the strides it is given (a [b, heads, rows, d]-contiguous one gave gradients 100% off on an
    H200)."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


FORWARD = {"math": _math_forward, "cpu_flash": _cpu_flash_forward,
           "cuda_flash": _cuda_flash_forward, "efficient": _efficient_forward}
BACKWARD = {"math": _math_backward, "cpu_flash": _cpu_flash_backward,
            "cuda_flash": _cuda_flash_backward, "efficient": _efficient_backward}
