"""The matrices of a sharded flat tensor, made whole one rank each for Muon ([Note: Muon on flat shards]).

A flat optimizer tensor of stages 1-2 holds, on each rank, pieces of many parameters (zero/layout.py). Muon's
orthogonalisation needs each matrix whole, once. `ShardedMatrices` assigns every matrix an owner (largest
Newton-Schulz cost first, to the least loaded rank: every rank computes the same assignment from the same sizes),
sends each piece to its matrix's owner with one all-to-all, lets the owner orthogonalise its matrices, and sends
the pieces back with a second all-to-all. Each rank then holds whole only the matrices it owns, about 1/N of the
group: the transient memory is the size of its shard, and no matrix is orthogonalised twice. Unsharded (stage 0),
every rank holds every matrix and orthogonalises all of them itself, with no communication, as DeepSpeed's
stage 0 does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from zeroshard.comm.collectives import Collectives
from zeroshard.zero.layout import GroupLayout, owned_pieces


@dataclass(frozen=True)
class Piece:
    """Elements [begin, end) of matrix `matrix` (flattened), at `offset` in their rank's flat tensor."""

    matrix: int
    begin: int
    end: int
    offset: int

    @property
    def numel(self) -> int:
        return self.end - self.begin


class ShardedMatrices:
    """Where the matrices of one flat tensor lie on every rank, and the exchange that makes each whole once."""

    def __init__(
        self,
        shapes: Sequence[torch.Size],
        pieces: Sequence[Sequence[Piece]],
        comm: Collectives | None,
        device: torch.device,
    ):
        """`pieces[r]`: rank r's pieces in its flat tensor (one rank, every piece whole, when `comm` is None)."""
        self.shapes = list(shapes)
        self.pieces = [list(p) for p in pieces]
        self.comm = comm
        self.device = device
        self.rank = comm.rank if comm is not None else 0
        self.owners = _balanced_owners(self.shapes, len(self.pieces))

    @classmethod
    def of_group(
        cls,
        layout: GroupLayout,
        shapes: Sequence[torch.Size],
        shard_count: int,
        comm: Collectives,
        device: torch.device,
    ) -> ShardedMatrices:
        """A flat group of stages 0-2: slot i is matrix i, of shape `shapes[i]`; stage 0 (one shard) is local."""
        pieces = [
            [Piece(p.slot, p.param_begin, p.param_end, p.shard_offset) for p in owned_pieces(layout, r)]
            for r in range(shard_count)
        ]
        return cls(shapes, pieces, comm if shard_count > 1 else None, device)

    def apply(self, flat: torch.Tensor, orthogonalize: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`flat` with each matrix replaced by `orthogonalize(matrix)`; elements of no matrix (padding) are 0."""
        out = torch.zeros_like(flat)
        if self.comm is None:
            for piece in self.pieces[0]:
                matrix = flat.narrow(0, piece.offset, piece.numel).view(self.shapes[piece.matrix])
                out.narrow(0, piece.offset, piece.numel).copy_(orthogonalize(matrix).reshape(-1))
            return out
        source = flat.to(self.device)
        whole = self._gather_owned(source)
        done = {m: orthogonalize(matrix.view(self.shapes[m])).reshape(-1) for m, matrix in whole.items()}
        self._scatter_back(done, out)
        return out

    # -- the two exchanges -------------------------------------------------------------------------------
    def _mine(self, rank: int, owner: int) -> list[Piece]:
        """Rank `rank`'s pieces of the matrices `owner` orthogonalises, in its flat order."""
        return [p for p in self.pieces[rank] if self.owners[p.matrix] == owner]

    def _gather_owned(self, flat: torch.Tensor) -> dict[int, torch.Tensor]:
        assert self.comm is not None
        world = len(self.pieces)
        sends = [self._mine(self.rank, dest) for dest in range(world)]
        receives = [self._mine(src, self.rank) for src in range(world)]
        payload = [flat.narrow(0, p.offset, p.numel) for pieces in sends for p in pieces]
        send = torch.cat(payload) if payload else flat.new_empty(0)
        recv = flat.new_empty(sum(p.numel for pieces in receives for p in pieces))
        self.comm.all_to_all_uneven(
            recv, send, [_total(r) for r in receives], [_total(s) for s in sends], label="muon: matrices to owners"
        )
        whole = {m: flat.new_empty(self.shapes[m].numel()) for m, owner in enumerate(self.owners) if owner == self.rank}
        at = 0
        for pieces in receives:
            for p in pieces:
                whole[p.matrix].narrow(0, p.begin, p.numel).copy_(recv.narrow(0, at, p.numel))
                at += p.numel
        return whole

    def _scatter_back(self, done: dict[int, torch.Tensor], out: torch.Tensor) -> None:
        assert self.comm is not None
        world = len(self.pieces)
        sends = [self._mine(dest, self.rank) for dest in range(world)]
        receives = [self._mine(self.rank, src) for src in range(world)]
        payload = [done[p.matrix].narrow(0, p.begin, p.numel) for pieces in sends for p in pieces]
        empty = torch.empty(0, dtype=out.dtype, device=self.device)
        send = torch.cat(payload) if payload else empty
        recv = torch.empty(sum(p.numel for pieces in receives for p in pieces), dtype=out.dtype, device=self.device)
        self.comm.all_to_all_uneven(
            recv, send, [_total(r) for r in receives], [_total(s) for s in sends], label="muon: updates to holders"
        )
        at = 0
        for pieces in receives:
            for p in pieces:
                out.narrow(0, p.offset, p.numel).copy_(recv.narrow(0, at, p.numel))
                at += p.numel


def _total(pieces: list[Piece]) -> int:
    return sum(p.numel for p in pieces)


def _balanced_owners(shapes: Sequence[torch.Size], world: int) -> list[int]:
    """An owner per matrix: by Newton-Schulz cost (elements x the smaller side), largest first, to the least loaded
    rank (ties: the lower rank, then the earlier matrix), the same on every rank."""
    load = [0] * world
    owners = [0] * len(shapes)
    costs = [shape.numel() * min(shape[-2], shape[-1]) for shape in shapes]
    for m in sorted(range(len(shapes)), key=lambda i: (-costs[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[m] = rank
        load[rank] += costs[m]
    return owners


class FlatMatrixPlan:
    """Stages 0-2: one flat master per optimizer group, slot i of the group's layout its matrix i
    ([Note: Muon on flat shards] in optim/muon.py). The strategy steps one group at a time, the same on every rank, so
    a group whose master is not being stepped has nothing to exchange on any rank."""

    def __init__(
        self,
        groups: dict[int, tuple[torch.Tensor, list[torch.Size], GroupLayout]],
        shard_count: int,
        comm: Collectives,
        device: torch.device,
    ):
        self.masters: dict[int, tuple[torch.Tensor, ShardedMatrices]] = {}
        for g, (master, shapes, layout) in groups.items():
            pieces = [
                [Piece(p.slot, p.param_begin, p.param_end, p.shard_offset) for p in owned_pieces(layout, r)]
                for r in range(shard_count)
            ]
            self.masters[g] = (master, ShardedMatrices(shapes, pieces, comm if shard_count > 1 else None, device))

    def orthogonalized(
        self, group: int, blended: dict[int, torch.Tensor], orthogonalize: Callable[[torch.Tensor], torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        master, matrices = self.masters[group]
        if id(master) not in blended:
            return {}
        return {id(master): matrices.apply(blended[id(master)], orthogonalize)}
