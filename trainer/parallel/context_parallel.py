"""Context parallel: the sequence is split over the cp ranks, and attention, the one place where
positions meet, is computed across them with public torch.distributed calls (so it runs on gloo
as well as NCCL).

Load balancing: the sequence is cut into 2*cp chunks and cp rank r holds chunks r and 2*cp-1-r.
Under a causal mask an early chunk attends to little and a late one to much, so each rank gets
one of each and the same work. Every rank's inputs, labels and RoPE positions are sharded this
way (`shard_sequence`); positions stay the global ones (or, with data.document_mask, each token's
position in its document, from which both methods also mask the keys before a query's document).

Three attention methods (`parallel.cp_method`), all exact:
- ulysses: an all-to-all gives each rank the whole sequence for 1/cp of the heads, attention
  runs there unsplit, and another brings the output back (trainer/parallel/ulysses.py). A fixed
  transfer per layer whatever the sequence; the heads must split over the ranks.
- allgather: all-gather K and V; each local query chunk attends to the keys up to its end under
  the global causal mask. Simple, but holds the whole sequence's K and V.
- ring: K/V blocks travel around the ring while each rank attends to the block it holds; the
  partial outputs merge by their log-sum-exp. Backward passes the blocks around again with their
  dK/dV. K/V memory per rank stays O(seq/cp).

The hybrid (`parallel.cp_ulysses` = u < cp): Ulysses within groups of u neighbouring cp ranks,
ring (or all-gather) across the cp/u groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from trainer.models.attention import (
    CausalAttention,
    Mask,
    attention,
    block_backward,
    block_forward,
    causal_attention,
    kv_copies,
)
from trainer.parallel.ulysses import gather_positions, to_heads, to_sequence

METHODS = ("ring", "allgather", "ulysses")


def shard_sequence(x: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of `x` on its sequence dimension: chunk cp_rank and chunk
    2*cp-1-cp_rank."""
    if cp == 1:
        return x
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]], dim=dim)


def shard_batch(inputs: torch.Tensor, labels: torch.Tensor, cp_rank: int, cp: int,
                positions: torch.Tensor | None = None):
    """A batch of whole sequences -> this rank's (inputs, labels, positions) [batch, seq/cp].
    positions default to 0..seq-1."""
    if positions is None:
        positions = torch.arange(inputs.shape[1]).expand(inputs.shape)
    return tuple(shard_sequence(x, cp_rank, cp) for x in (inputs, labels, positions))


def apply_cp(model: nn.Module, ring: DeviceMesh | None, ulysses: DeviceMesh | None,
             method: str) -> None:
    """Every attention kernel module (CausalAttention, whatever family holds it) becomes the
    context-parallel one: Ulysses over `ulysses` (None: none), then `method` (ring or allgather)
    over `ring` (None: none)."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, CausalAttention):
                setattr(parent, name, ContextParallelAttention(ring, ulysses, method,
                                                               child.within_documents))


class ContextParallelAttention(nn.Module):
    """Causal attention over the whole sequence for the local queries, keys and values
    [batch, heads, 2*chunk, head_dim] (values may be narrower), held in the load-balanced layout.
    Grouped-query attention: q may have a multiple of k's and v's heads. With `within_documents` the
    local `positions` count from each query's document start (data.document_mask) and keys before it
    are masked.

    With a Ulysses group, an all-to-all first gives each of its ranks the group's sequence for its
    share of the heads (key/value heads repeated when the group outnumbers them); the ring (or
    all-gather) then spans the groups, or, with no ring, attention is an ordinary causal one."""

    def __init__(self, ring: DeviceMesh | None, ulysses: DeviceMesh | None, method: str,
                 within_documents: bool = False):
        super().__init__()
        self.group = None if ring is None else ring.get_group()
        self.ulysses = None if ulysses is None else ulysses.get_group()
        self.method = method
        self.within_documents = within_documents

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        positions = positions if self.within_documents else None
        if self.ulysses is None:
            return self._attend(q, k, v, positions)
        copies = kv_copies(k.shape[1], dist.get_world_size(self.ulysses))
        if copies > 1:
            k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
        q, k, v = to_heads([q, k, v], self.ulysses)
        if positions is not None:
            positions = gather_positions(positions, self.ulysses)
        return to_sequence(self._attend(q, k, v, positions), self.ulysses)

    def _attend(self, q, k, v, positions: torch.Tensor | None) -> torch.Tensor:
        """Attention over the ring's ranks (the whole sequence here when there is no ring)."""
        if self.group is None:
            return causal_attention(q, k, v, positions)
        starts = None
        if positions is not None:
            rank, cp = dist.get_rank(self.group), dist.get_world_size(self.group)
            # The global index at which each local query's document starts [batch, seq].
            starts = _global_positions(q.shape[2], rank, cp, q.device) - positions
        # Keys and values travel together: values narrower than the keys (MLA's) are padded with
        # zeros to their width, which adds zero columns to the output, cut off (exact).
        width = v.shape[-1]
        v = F.pad(v, (0, k.shape[-1] - width)) if width != k.shape[-1] else v
        if self.method == "ring":
            return _RingAttention.apply(q, k, v, self.group, starts)[..., :width]
        return _allgather_attention(q, k, v, self.group, starts)[..., :width]

    def extra_repr(self) -> str:
        ring = 1 if self.group is None else dist.get_world_size(self.group)
        ulysses = 1 if self.ulysses is None else dist.get_world_size(self.ulysses)
        return f"method={self.method}, ring={ring}, ulysses={ulysses}"


def _global_positions(seq: int, cp_rank: int, cp: int, device) -> torch.Tensor:
    """The global positions of a rank's local sequence of length `seq`."""
    return shard_sequence(torch.arange(seq * cp, device=device)[None], cp_rank, cp)[0]


# --- allgather -------------------------------------------------------------------------------


def _allgather_attention(q, k, v, group, starts: torch.Tensor | None) -> torch.Tensor:
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    seq = q.shape[2]
    # [cp, 2, batch, kv_heads, seq, head_dim]: every rank's K and V, in one collective.
    kv = _AllGather.apply(torch.stack([k, v]), group)
    # Back to global order: the first chunks of ranks 0..cp-1, then the second ones in reverse.
    half = seq // 2
    kv = torch.cat([*kv[..., :half, :].unbind(0), *kv[..., half:, :].flip(0).unbind(0)], dim=-2)
    positions, keys = (_global_positions(seq, rank, cp, q.device),
                       torch.arange(seq * cp, device=q.device))
    outs = []
    for chunk, rows in ((rank, slice(0, half)), (2 * cp - 1 - rank, slice(half, seq))):
        # A query chunk sees no key after its own end: attend over that prefix only (half the work
        # of attending over every key under the mask).
        end = (chunk + 1) * half
        mask = Mask(positions[rows], keys[:end], None if starts is None else starts[:, rows])
        outs.append(attention(q[:, :, rows], kv[0][:, :, :end], kv[1][:, :, :end], causal=False,
                              mask=mask))
    return torch.cat(outs, dim=2)


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
    on fully masked pairs. Partial outputs are merged in fp32. With document `starts` each block
    also masks the keys before its queries' documents."""

    @staticmethod
    def forward(ctx, q, k, v, group, starts):
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        kv = torch.stack([k, v])
        out, lse = None, None
        for step in range(cp):
            pending = _pass_on(kv, group) if step < cp - 1 else None
            source = (rank - step) % cp
            rows, cols, causal = _block_rows_cols(rank, source, q.shape[2])
            mask = _block_mask(starts, rank, source, cp, q.shape[2], rows, cols)
            block_out, block_lse = block_forward(q[:, :, rows], kv[0][:, :, cols],
                                                 kv[1][:, :, cols], causal, mask)
            # Copies: merged into in place, while selective
            # checkpointing may keep the kernel's outputs.
            if out is None:
                out, lse = block_out.to(torch.float32, copy=True), block_lse.clone()
            else:
                _merge(out, lse, block_out.float(), block_lse, rows)
            if pending is not None:
                kv = pending()
        out = out.to(q.dtype)
        ctx.group, ctx.starts = group, starts
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack([k, v])
        # The gradient of the block this rank holds travels with it, so that after the last step
        # each block's dK/dV, summed over every rank's queries, arrives back at its owner.
        dkv = torch.zeros_like(kv, dtype=torch.float32)
        for step in range(cp):
            pending = _pass_on(kv, group) if step < cp - 1 else None
            source = (rank - step) % cp
            rows, cols, causal = _block_rows_cols(rank, source, q.shape[2])
            mask = _block_mask(ctx.starts, rank, source, cp, q.shape[2], rows, cols)
            # Each block's gradients follow from the final
            # output and log-sum-exp (flash attention's rule).
            block_dq, block_dk, block_dv = block_backward(
                grad_out[:, :, rows], q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                out[:, :, rows], lse[:, :, rows], causal, mask,
            )
            dq[:, :, rows] += block_dq
            dkv[0][:, :, cols] += block_dk
            dkv[1][:, :, cols] += block_dv
            dkv = _pass_on(dkv, group)()
            if pending is not None:
                kv = pending()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def _block_rows_cols(rank: int, source: int, seq: int) -> tuple[slice, slice, bool]:
    """Which local query rows attend to which columns of `source`'s K/V block, and whether causally.

    Rank r holds chunks (r, 2cp-1-r). Its own block is causal within (local order is global order).
    A block from an earlier rank s < r: every query sees chunk s, none sees the late chunk 2cp-1-s.
    A block from a later rank s > r: the early query chunk r sees none of it, the late one all of
    it.
    """
    half = seq // 2
    if source == rank:
        return slice(None), slice(None), True
    if source < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


def _block_mask(starts, rank: int, source: int, cp: int, seq: int, rows: slice,
                cols: slice) -> Mask | None:
    """Which keys of `source`'s block each query row sees, given the global index where each query's
    document starts (None: no document mask, the block's shape says all)."""
    if starts is None:
        return None
    queries = _global_positions(seq, rank, cp, starts.device)[rows]
    keys = _global_positions(seq, source, cp, starts.device)[cols]
    return Mask(queries, keys, starts[:, rows])


def _merge(out, lse, block_out, block_lse, rows) -> None:
    """Folds a block's partial softmax output into the running one, for the given query rows."""
    old_lse = lse[:, :, rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    out[:, :, rows] = (out[:, :, rows] * (old_lse - new_lse).exp()[..., None]
                       + block_out * (block_lse - new_lse).exp()[..., None])
    lse[:, :, rows] = new_lse


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

