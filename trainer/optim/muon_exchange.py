"""Where each of Muon's matrices is orthogonalised, and how its pieces get there and back.

Muon orthogonalises each weight matrix's update whole; FSDP and tensor parallel leave each rank a
piece of it. The matrices whose pieces lie on several ranks of a process group (the ranks across
which a parameter is sharded, with the same coordinate on its replicated dimensions) are dealt out
over that group's ranks, balanced by their Newton-Schulz FLOPs; every rank sends each owner its
pieces of the owner's matrices in one all-to-all per group, the owners orthogonalise, and a second
all-to-all returns each rank its pieces of the results. A matrix one rank holds whole (an expert
under expert parallel, every matrix on one process) is orthogonalised there and never moves.
Replicas (HSDP's, or a pipeline stage's data-parallel copies) each do their own group's share:
sharing it with other replicas would send every result over the links HSDP keeps for the gradient
all-reduce alone. A parameter with a leading dimension (stacked experts) is one matrix per index.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

Box = tuple[tuple[int, ...], tuple[int, ...]]  # a rank's piece of a parameter: (offset, shape)
# Elements of whole matrices a rank gathers at most in one round of the exchange (256 MiB in fp32).
ROUND_ELEMENTS = 2**26


def my_box(p: torch.Tensor) -> Box:
    """This rank's piece of `p` as an offset and a shape in the whole parameter. DTensor has no
    public way to say where a shard sits; DCP's planner uses this function for the same purpose."""
    if not isinstance(p, DTensor):
        return (0,) * p.ndim, tuple(p.shape)
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(offset), tuple(shape)


def sharing_ranks(p: torch.Tensor) -> tuple[int, ...]:
    """The global ranks holding pieces of `p` that together make it whole, this rank among them (in
    mesh order): its mesh's ranks along the dimensions it is sharded on, at this rank's coordinate
    on the others. One rank: `p` is whole here."""
    if not isinstance(p, DTensor):
        return (dist.get_rank() if dist.is_initialized() else 0,)
    mesh, coordinate = p.device_mesh, p.device_mesh.get_coordinate()
    # Not is_shard(): FSDP over tensor parallel places
    # a _StridedShard, which is no Shard in torch 2.13.
    index = tuple(c if placement.is_replicate() else slice(None)
                  for placement, c in zip(p.placements, coordinate))
    return tuple(mesh.mesh[index].flatten().tolist())


def ns_flops(rows: int, cols: int, steps: int) -> float:
    """FLOPs of `steps` Newton-Schulz iterations on one rows x cols matrix (on the wide side: m <=
    n, per step X X^T, then a m x m product, then the m x n update)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4.0 * m * m * n + 2.0 * m**3)


@dataclass(frozen=True)
class Unit:
    """One matrix: parameter `param` at leading index `index` (() for a 2-D parameter)."""

    param: int
    index: tuple[int, ...]


def units_of(params: list[torch.Tensor]) -> list[Unit]:
    """The matrices of `params`: one per index of their leading dimensions."""
    return [Unit(i, index) for i, p in enumerate(params)
            for index in itertools.product(*map(range, p.shape[:-2]))]


def _piece(box: Box, unit: Unit) -> tuple[tuple[int, ...], slice, slice] | None:
    """Where `box` holds part of `unit`: the local leading index and the matrix rows and columns
    (None: none of it)."""
    offset, shape = box
    lead = len(unit.index)
    local = tuple(i - o for i, o in zip(unit.index, offset[:lead]))
    if any(not 0 <= i < s for i, s in zip(local, shape[:lead])) or shape[-1] == 0 or shape[-2] == 0:
        return None
    rows, cols = (slice(offset[-2], offset[-2] + shape[-2]),
                  slice(offset[-1], offset[-1] + shape[-1]))
    return local, rows, cols


class GroupExchange:
    """The matrices of the parameters `params`, all sharded over the ranks of `group`: who
    orthogonalises which, and the two all-to-alls. Built on every rank of the group (it gathers the
    ranks' pieces once, which is a collective)."""

    def __init__(self, params: list[torch.Tensor], group, steps: int):
        self.group, self.n, self.me = group, dist.get_world_size(group), dist.get_rank(group)
        self.shapes = [tuple(p.shape[-2:]) for p in params]
        boxes: list = [None] * self.n
        dist.all_gather_object(boxes, [my_box(p) for p in params], group=group)
        # [param][rank]
        self.boxes = [[boxes[r][i] for r in range(self.n)] for i in range(len(params))]
        self.offsets = [b[self.me][0] for b in self.boxes]
        units = units_of(params)
        holders = {u: [r for r in range(self.n) if _piece(self.boxes[u.param][r], u) is not None]
                   for u in units}
        load = [0.0] * self.n
        self.local: list[Unit] = []  # the matrices this rank holds whole
        shared: list[Unit] = []
        for u in units:
            if len(holders[u]) == 1:
                load[holders[u][0]] += ns_flops(*self.shapes[u.param], steps)
                if holders[u][0] == self.me:
                    self.local.append(u)
            else:
                shared.append(u)
        # Largest first, each to the least loaded rank: every rank computes the same deal.
        owned: list[list[Unit]] = [[] for _ in range(self.n)]
        for u in sorted(shared, key=lambda u: -ns_flops(*self.shapes[u.param], steps)):
            owner = min(range(self.n), key=lambda r: (load[r], r))
            load[owner] += ns_flops(*self.shapes[u.param], steps)
            owned[owner].append(u)
        self.owned = owned
        # In rounds of at most ROUND_ELEMENTS gathered on any rank (or one matrix), so that what is
        # gathered at once stays bounded however many matrices a rank owns.
        held = [sum(math.prod(self.shapes[u.param]) for u in mine) for mine in owned]
        n_rounds = max(1, -(-max(held) // ROUND_ELEMENTS))
        self.rounds = [Round(self, [_share(mine, self.shapes, k, n_rounds) for mine in owned])
                       for k in range(n_rounds)]

    def matrices_here(self) -> int:
        return len(self.local) + len(self.owned[self.me])

    def _size(self, rank: int, unit: Unit) -> int:
        piece = _piece(self.boxes[unit.param][rank], unit)
        return (0 if piece is None
                else (piece[1].stop - piece[1].start) * (piece[2].stop - piece[2].start))

    def elements_moved(self) -> int:
        """Elements this rank sends to other ranks per step, each way (the results come back
        alike)."""
        return sum(self._size(self.me, u) for r, mine in enumerate(self.owned) if r != self.me
                   for u in mine)

    def orthogonalize(self, updates: list[torch.Tensor],
                      apply: Callable[[torch.Tensor], torch.Tensor],
                      results: list[torch.Tensor]) -> None:
        """Writes apply(whole matrix) into `results` (local pieces, like `updates`; they may be the
        same tensors) for every matrix of the group: this rank's whole ones here, the shared ones on
        their owners, round by round."""
        orthogonalize_here(self.local, self.offsets, updates, apply, results)
        for one in self.rounds:
            if any(one.owned):
                self._round(one, updates, apply, results)

    def _round(self, one: Round, updates, apply, results) -> None:
        sample = updates[0]
        send = [_at(updates, u, self.offsets).reshape(-1) for u in one.sent_units]
        received = sample.new_empty(sum(one.received))
        dist.all_to_all_single(received, _cat(send, sample), one.received, one.sent,
                               group=self.group)
        del send
        whole = [sample.new_zeros(self.shapes[u.param]) for u in one.owned[self.me]]
        for (_, k, rows, cols), chunk in zip(one.pieces, received.split(one.piece_sizes)):
            whole[k][rows, cols].copy_(chunk.view(rows.stop - rows.start, cols.stop - cols.start))
        del received  # at most four copies of the round's matrices at once (the plan's count)
        done = batched(apply, whole)
        del whole
        back = [done[k][rows, cols].reshape(-1) for _, k, rows, cols in one.pieces]
        returned = sample.new_empty(sum(one.sent))
        dist.all_to_all_single(returned, _cat(back, sample), one.sent, one.received,
                               group=self.group)
        for u, chunk in zip(one.sent_units, returned.split(one.sent_sizes)):
            piece = _at(results, u, self.offsets)
            piece.copy_(chunk.view_as(piece))


class Round:
    """One round of a group's exchange: the matrices each rank owns in it, and what this rank sends
    and receives, in the order the all-to-alls carry them (computed once, at start-up)."""

    def __init__(self, exchange: GroupExchange, owned: list[list[Unit]]):
        me, ranks = exchange.me, range(exchange.n)
        self.owned = owned
        # Out: this rank's pieces of every owner's matrices, by owner (the results come back alike).
        self.sent_units = [u for r in ranks for u in owned[r] if exchange._size(me, u)]
        self.sent_sizes = [exchange._size(me, u) for u in self.sent_units]
        self.sent = [sum(exchange._size(me, u) for u in owned[r]) for r in ranks]
        # In: every rank's pieces of this rank's matrices, by source (the results go back alike):
        # the matrix (its index among this rank's) and the rows and columns of each.
        self.pieces = [(r, k, piece[1], piece[2]) for r in ranks for k, u in enumerate(owned[me])
                       if (piece := _piece(exchange.boxes[u.param][r], u)) is not None]
        self.piece_sizes = [(rows.stop - rows.start) * (cols.stop - cols.start)
                            for _, _, rows, cols in self.pieces]
        self.received = [sum(exchange._size(r, u) for u in owned[me]) for r in ranks]


def _share(units: list[Unit], shapes: list[tuple[int, int]], k: int, n_rounds: int) -> list[Unit]:
    """Round k's part of one rank's `units`: those whose running total of elements starts in the
    k-th of `n_rounds` equal spans (every rank computes everyone's)."""
    total, start, part = sum(math.prod(shapes[u.param]) for u in units), 0, []
    for u in units:
        if k * total <= start * n_rounds < (k + 1) * total:
            part.append(u)
        start += math.prod(shapes[u.param])
    return part


def _at(tensors: list[torch.Tensor], unit: Unit, offsets: list[tuple[int, ...]]) -> torch.Tensor:
    """The local piece of `unit` in `tensors` (this rank's pieces of the parameters, which start at
    `offsets` in the whole ones)."""
    local = tuple(i - o for i, o in zip(unit.index, offsets[unit.param]))
    return tensors[unit.param][local] if local else tensors[unit.param]


def orthogonalize_here(units: list[Unit], offsets, updates: list[torch.Tensor], apply,
                       results: list[torch.Tensor]) -> None:
    for unit, out in zip(units, batched(apply, [_at(updates, unit, offsets) for unit in units])):
        _at(results, unit, offsets).copy_(out)


def _cat(pieces: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat(pieces) if pieces else like.new_empty(0)


def batched(apply: Callable[[torch.Tensor], torch.Tensor],
            matrices: list[torch.Tensor]) -> list[torch.Tensor]:
    """apply() over `matrices`, those of one shape stacked into batches of at most ROUND_ELEMENTS
    (or one matrix); in their order."""
    out: list = [None] * len(matrices)
    by_shape: dict[tuple, list[int]] = {}
    for k, m in enumerate(matrices):
        by_shape.setdefault(tuple(m.shape), []).append(k)
    for shape, ks in by_shape.items():
        per_batch = max(1, ROUND_ELEMENTS // math.prod(shape))
        for start in range(0, len(ks), per_batch):
            batch = ks[start:start + per_batch]
            for k, result in zip(batch, apply(torch.stack([matrices[k] for k in batch]))):
                out[k] = result
    return out


class MatrixExchange:
    """Every Muon matrix of this rank, by the group of ranks that share it."""

    def __init__(self, params: list[torch.Tensor], steps: int,
                 group_of: Callable[[tuple[int, ...]], object]):
        by_ranks: dict[tuple[int, ...], list[int]] = {}
        for k, p in enumerate(params):
            by_ranks.setdefault(sharing_ranks(p), []).append(k)
        # In one order on every rank (sorted by the ranks),
        # so no two groups' set-up collectives cross.
        self.parts = []
        for ranks in sorted(by_ranks):
            ks = by_ranks[ranks]
            group = group_of(ranks) if len(ranks) > 1 else None
            # each rank would orthogonalise its piece: a wrong update
            if len(ranks) > 1 and group is None:
                raise RuntimeError(f"Muon: no process group spans ranks {list(ranks)}, which share "
                                   "parameters")
            exchange = GroupExchange([params[k] for k in ks], group, steps) if group is not None \
                else LocalMatrices([params[k] for k in ks])
            self.parts.append((ks, exchange))

    def orthogonalize(self, updates: list[torch.Tensor], apply,
                      results: list[torch.Tensor]) -> None:
        for ks, exchange in self.parts:
            exchange.orthogonalize([updates[k] for k in ks], apply, [results[k] for k in ks])

    def elements_moved(self) -> int:
        return sum(exchange.elements_moved() for _, exchange in self.parts)

    def matrices_here(self) -> int:
        """How many matrices this rank orthogonalises."""
        return sum(exchange.matrices_here() for _, exchange in self.parts)


class LocalMatrices:
    """Parameters this rank holds whole: every matrix orthogonalised here."""

    def __init__(self, params: list[torch.Tensor]):
        self.units = units_of(params)
        self.offsets = [(0,) * p.ndim for p in params]

    def orthogonalize(self, updates, apply, results) -> None:
        orthogonalize_here(self.units, self.offsets, updates, apply, results)

    def elements_moved(self) -> int:
        return 0

    def matrices_here(self) -> int:
        return len(self.units)
