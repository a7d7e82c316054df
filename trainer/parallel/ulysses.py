"""Ulysses context parallel: an all-to-all turns each rank's slice of the sequence for every head
into its group's whole sequence for a share of the heads, attention runs there, and the inverse
all-to-all brings the output back to the slices.

The ranks of a Ulysses group are neighbours in the cp dimension (cp rank = ring rank * u + i, for
a group of u), so with the load-balanced layout (cp rank r holds chunks r and 2*cp-1-r of 2*cp)
the group holds chunk q and chunk 2R-1-q of 2R (R = cp / u, q its ring rank): its members' first
halves in order, then their second halves in reverse order. That is the layout the ring expects
of a rank of a ring of R, so the hybrid (Ulysses inside, the ring across groups) needs nothing
else; with R = 1 the group holds the whole sequence in order.

Every all-to-all sends each rank the same amount: 1/u of q, k, v (one collective for the three)
and of the output, whatever the sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def to_heads(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """[batch, heads, 2*chunk, dim] on each rank of `group` (its heads divisible by the group's
    size u) -> [batch, heads/u, 2*u*chunk, dim]: the group's sequence for this rank's share of the
    heads (the u-th part in order)."""
    u = dist.get_world_size(group)
    # [u (destination), batch, heads/u, 2*chunk, dim], flattened per destination: the three
    # tensors travel in one all-to-all.
    parts = [t.unflatten(1, (u, -1)).transpose(0, 1).reshape(u, -1) for t in tensors]
    received = _AllToAll.apply(torch.cat(parts, dim=1), group)
    out = []
    for t, part in zip(tensors, received.split([p.shape[1] for p in parts], dim=1)):
        b, h, s, d = t.shape
        # [u (source), batch, heads/u, 2, chunk, dim]
        x = part.view(u, b, h // u, 2, s // 2, d)
        first, second = x[:, :, :, 0], x[:, :, :, 1].flip(0)
        out.append(torch.cat([_along_sequence(first, 3), _along_sequence(second, 3)], dim=2))
    return out


def to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of to_heads for one tensor: [batch, heads/u, 2*u*chunk, dim] ->
    [batch, heads, 2*chunk, dim]."""
    u = dist.get_world_size(group)
    b, h, s, d = x.shape
    first, second = x.unflatten(2, (2, u, -1)).unbind(2)
    # [u (destination), batch, heads/u, 2, chunk, dim]
    sent = torch.stack([first, second.flip(2)], dim=3).permute(2, 0, 1, 3, 4, 5)
    received = _AllToAll.apply(sent.reshape(u, -1), group).view(u, b, h, 2, s // (2 * u), d)
    # sources in order are the heads' shares in order
    return received.permute(1, 0, 2, 3, 4, 5).reshape(b, u * h, s // u, d)


def gather_positions(positions: torch.Tensor, group) -> torch.Tensor:
    """Each token's position [batch, 2*chunk] -> those of the group's sequence, in to_heads'
    order (no gradient)."""
    u = dist.get_world_size(group)
    # (gloo takes the ranks' tensors concatenated on the first dimension only)
    out = positions.new_empty((u * positions.shape[0], positions.shape[1]))
    dist.all_gather_single(out, positions.contiguous(), group=group)
    first, second = out.view(u, *positions.shape).unflatten(2, (2, -1)).unbind(2)
    return torch.cat([_along_sequence(first, 2), _along_sequence(second.flip(0), 2)], dim=1)


def _along_sequence(x: torch.Tensor, seq_dim: int) -> torch.Tensor:
    """The u chunks of x [u, ...] one after another on its sequence dimension `seq_dim` (counted
    with the u): [u, batch, heads, chunk, dim] -> [batch, heads, u*chunk, dim]."""
    return x.movedim(0, seq_dim - 1).flatten(seq_dim - 1, seq_dim)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over equal parts of the first dimension; its own inverse, so backward
    sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _AllToAll.apply(grad, ctx.group), None


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """all_to_all_single by the functional collective (private in torch 2.13), not
    dist.all_to_all_single: its op returns a new tensor, which selective activation checkpointing
    keeps (the in-place c10d op would run again in the recomputed forward)."""
    return funcol.wait_tensor(funcol.all_to_all_single(x, None, None, group))
