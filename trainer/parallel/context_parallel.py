"""Context parallel: the sequence is split over the cp ranks, and attention, the one place where
positions meet, is computed across them with public torch.distributed calls (so it runs on gloo
as well as NCCL).

Load balancing: the sequence is cut into 2*cp chunks and cp rank r holds chunks r and 2*cp-1-r.
Under a causal mask an early chunk attends to little and a late one to much, so each rank gets
one of each and the same work. Every rank's inputs, labels and RoPE positions are sharded this
way (`shard_sequence`); positions stay the global ones.

Two attention methods (`parallel.cp_method`), both exact:
- allgather: all-gather K and V, attend with the local queries under the global causal mask.
  Simple, uses the fused SDPA kernel, but holds the whole sequence's K and V.
- ring: K/V blocks travel around the ring while each rank attends to the block it holds; the
  partial outputs merge by their log-sum-exp. Backward passes the blocks around again with their
  dK/dV. K/V memory per rank stays O(seq/cp).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

METHODS = ("ring", "allgather")


def shard_sequence(x: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of `x` on its sequence dimension: chunk cp_rank and chunk 2*cp-1-cp_rank."""
    if cp == 1:
        return x
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]], dim=dim)


def shard_batch(inputs: torch.Tensor, labels: torch.Tensor, cp_rank: int, cp: int):
    """A batch of whole sequences -> this rank's (inputs, labels, positions) [batch, seq/cp]."""
    positions = torch.arange(inputs.shape[1]).expand(inputs.shape)
    return tuple(shard_sequence(x, cp_rank, cp) for x in (inputs, labels, positions))


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, method: str) -> None:
    """Every block's attention kernel becomes the context-parallel one."""
    for block in model.layers.values():
        block.attention.sdpa = ContextParallelAttention(cp_mesh, method)


class ContextParallelAttention(nn.Module):
    """Causal attention over the whole sequence for the local queries, keys and values
    [batch, heads, 2*chunk, head_dim], held in the load-balanced layout. Grouped-query attention:
    q may have a multiple of k's and v's heads."""

    def __init__(self, cp_mesh: DeviceMesh, method: str):
        super().__init__()
        self.group = cp_mesh.get_group()
        self.method = method

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.method == "ring":
            return _RingAttention.apply(q, k, v, self.group)
        return _allgather_attention(q, k, v, self.group)

    def extra_repr(self) -> str:
        return f"method={self.method}, cp={dist.get_world_size(self.group)}"


def _global_positions(seq: int, cp_rank: int, cp: int, device) -> torch.Tensor:
    """The global positions of a rank's local sequence of length `seq`."""
    return shard_sequence(torch.arange(seq * cp, device=device)[None], cp_rank, cp)[0]


# --- allgather -------------------------------------------------------------------------------


def _allgather_attention(q, k, v, group) -> torch.Tensor:
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    seq = q.shape[2]
    # [cp, 2, batch, kv_heads, seq, head_dim]: every rank's K and V, in one collective.
    kv = _AllGather.apply(torch.stack([k, v]), group)
    # Back to global order: the first chunks of ranks 0..cp-1, then the second ones in reverse.
    half = seq // 2
    kv = torch.cat([*kv[..., :half, :].unbind(0), *kv[..., half:, :].flip(0).unbind(0)], dim=-2)
    positions = _global_positions(seq, rank, cp, q.device)
    mask = positions[:, None] >= torch.arange(seq * cp, device=q.device)[None, :]
    return nn.functional.scaled_dot_product_attention(
        q, kv[0], kv[1], attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
    )


class _AllGather(torch.autograd.Function):
    """All-gather along a new first dimension; backward reduce-scatters the gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        # The collectives take the ranks' tensors concatenated on the first dimension (gloo
        # accepts no other form).
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out.view(-1, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_single(out, grad.flatten(0, 1).contiguous(), group=ctx.group)
        return out, None


# --- ring ------------------------------------------------------------------------------------


class _RingAttention(torch.autograd.Function):
    """At ring step i this rank holds the K/V block of rank (rank - i) % cp. With the load-balanced
    layout each step's work is one of three shapes (see `_block_rows_cols`), none of them wasted
    on fully masked pairs. Scores are computed in fp32."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        groups = q.shape[1] // k.shape[1]
        qg = _group_heads(q, groups)
        kv = torch.stack([k, v])
        out, lse = None, None
        for step in range(cp):
            pending = _pass_on(kv, group) if step < cp - 1 else None
            rows, cols, mask = _block_rows_cols(rank, (rank - step) % cp, q.shape[2], q.device)
            block_out, block_lse = _attend(qg[..., rows, :], kv[0][:, :, None, cols], kv[1][:, :, None, cols], mask)
            if out is None:
                out, lse = block_out, block_lse
            else:
                _merge(out, lse, block_out, block_lse, rows)
            if pending is not None:
                kv = pending()
        ctx.group = group
        ctx.save_for_backward(q, k, v, out, lse)
        return _ungroup_heads(out).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        groups = q.shape[1] // k.shape[1]
        qg, dout = _group_heads(q, groups), _group_heads(grad_out, groups).float()
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(qg, dtype=torch.float32)
        kv = torch.stack([k, v])
        # The gradient of the block this rank holds travels with it, so that after the last step
        # each block's dK/dV, summed over every rank's queries, arrives back at its owner.
        dkv = torch.zeros_like(kv, dtype=torch.float32)
        for step in range(cp):
            pending = _pass_on(kv, group) if step < cp - 1 else None
            rows, cols, mask = _block_rows_cols(rank, (rank - step) % cp, q.shape[2], q.device)
            block_dq, block_dk, block_dv = _attend_backward(
                qg[..., rows, :], kv[0][:, :, None, cols], kv[1][:, :, None, cols], dout[..., rows, :],
                lse[..., rows], delta[..., rows], mask,
            )
            dq[..., rows, :] += block_dq
            dkv[0][:, :, cols] += block_dk
            dkv[1][:, :, cols] += block_dv
            dkv = _pass_on(dkv, group)()
            if pending is not None:
                kv = pending()
        return _ungroup_heads(dq).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def _block_rows_cols(rank: int, source: int, seq: int, device):
    """Which local query rows attend to which columns of `source`'s K/V block, and the mask.

    Rank r holds chunks (r, 2cp-1-r). Its own block is causal within. A block from an earlier
    rank s < r: every query sees chunk s, none sees the late chunk 2cp-1-s. A block from a later
    rank s > r: the early query chunk r sees none of it, the late one sees all of it.
    """
    half = seq // 2
    if source == rank:
        local = torch.arange(seq, device=device)
        # Local order is global order within this rank (the early chunk, then the late one).
        return slice(None), slice(None), local[:, None] >= local[None, :]
    if source < rank:
        return slice(None), slice(0, half), None
    return slice(half, None), slice(None), None


def _attend(q, k, v, mask):
    """q [b, kv_heads, groups, rows, d], k/v [b, kv_heads, 1, cols, d] -> fp32 out, log-sum-exp."""
    scores = q.float() @ k.float().transpose(-1, -2) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = scores.logsumexp(-1)
    return (scores - lse[..., None]).exp() @ v.float(), lse


def _attend_backward(q, k, v, dout, lse, delta, mask):
    """The flash-attention backward of one block from the final log-sum-exp and delta = rowsum(dout*out)."""
    scale = q.shape[-1] ** -0.5
    q, k, v = q.float(), k.float(), v.float()
    scores = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = (scores - lse[..., None]).exp()
    dv = (probs.transpose(-1, -2) @ dout).sum(2)
    dscores = probs * (dout @ v.transpose(-1, -2) - delta[..., None])
    dq = dscores @ k * scale
    dk = (dscores.transpose(-1, -2) @ q).sum(2) * scale
    return dq, dk, dv


def _merge(out, lse, block_out, block_lse, rows) -> None:
    """Folds a block's partial softmax output into the running one, for the given query rows."""
    old_lse = lse[..., rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    out[..., rows, :] = (out[..., rows, :] * (old_lse - new_lse).exp()[..., None]
                         + block_out * (block_lse - new_lse).exp()[..., None])
    lse[..., rows] = new_lse


def _pass_on(x: torch.Tensor, group):
    """Sends `x` to the next rank of the ring and receives the previous rank's; returns a
    function that waits and gives the received tensor."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    x = x.contiguous()
    received = torch.empty_like(x)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, x, group=group, group_peer=(rank + 1) % cp),
        dist.P2POp(dist.irecv, received, group=group, group_peer=(rank - 1) % cp),
    ])

    def wait() -> torch.Tensor:
        for work in works:
            work.wait()
        return received

    return wait


def _group_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, heads, s, d] -> [b, kv_heads, groups, s, d]: query head h uses K/V head h // groups."""
    b, h, s, d = x.shape
    return x.view(b, h // groups, groups, s, d)


def _ungroup_heads(x: torch.Tensor) -> torch.Tensor:
    b, kv_heads, groups, s, d = x.shape
    return x.reshape(b, kv_heads * groups, s, d)
