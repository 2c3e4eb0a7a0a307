"""The matrices of a sharded flat tensor, made whole one rank each for Muon ([Note: Muon on flat shards]).

A flat optimizer tensor of stages 1-2 holds, on each rank, pieces of many parameters (zero/layout.py). Muon's
orthogonalisation needs each matrix whole, once. `ShardedMatrices` assigns every matrix an owner (largest
Newton-Schulz cost first, to the least loaded rank: every rank computes the same assignment from the same sizes),
sends each piece to its matrix's owner with one all-to-all, lets the owner orthogonalise its matrices, and sends
the pieces back with a second all-to-all, a batch of matrices at a time ([Note: Muon's exchange in batches]). A
rank holds whole only the matrices it owns, about 1/N of the group, and no matrix is orthogonalised twice.
Unsharded (stage 0), every rank holds every matrix and orthogonalises all of them itself, with no communication,
as DeepSpeed's stage 0 does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from zeroshard.comm.collectives import Collectives
from zeroshard.utils.chunks import greedy_chunks
from zeroshard.zero.layout import GroupLayout, owned_pieces

BATCH_NUMEL = 1 << 24  # elements of matrices per exchange: [Note: Muon's exchange in batches]


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
    """Where the matrices of one flat tensor lie on every rank, and the exchange that makes each whole once.

    [Note: Muon's exchange in batches]
    Matrices travel in batches of consecutive matrices of at most `BATCH_NUMEL` elements (a larger matrix alone), the
    same batches on every rank, and the result is written over the input. Every batch's pieces are sent to the owners
    first, then each rank orthogonalises all of its matrices, then every batch goes back: a rank that owns a large
    matrix (a 124M GPT's tied 38.6M-element embedding) does not make the others wait at each batch's exchange (that
    GPT at stage 1 on 2 ranks: 12.5 s a step one batch at a time, 9.3 s so, DeepSpeed's Muon 10.3 s). A step holds,
    besides the flat tensor, the matrices this rank owns (each input replaced by its result), one batch's send and
    receive buffers and the Newton-Schulz temporaries of one matrix: not a second flat tensor, nor inputs and results
    at once.
    """

    def __init__(
        self,
        shapes: Sequence[torch.Size],
        pieces: Sequence[Sequence[Piece]],
        comm: Collectives | None,
        device: torch.device,
    ):
        """`pieces[r]`: rank r's pieces in its flat tensor (one rank, every piece whole, when `comm` is None)."""
        self.shapes = list(shapes)
        self.pieces = [sorted(p, key=lambda piece: piece.offset) for p in pieces]
        self.comm = comm
        self.device = device
        self.rank = comm.rank if comm is not None else 0
        world = len(self.pieces)
        self.owners = _balanced_owners(self.shapes, world)
        self.batches = [set(b) for b in greedy_chunks([s.numel() for s in self.shapes], BATCH_NUMEL, close="before")]
        # per batch: this rank's pieces for each owner, and each rank's pieces of the matrices this rank owns
        self._sends = [[self._of(self.rank, batch, dest) for dest in range(world)] for batch in self.batches]
        self._receives = [[self._of(src, batch, self.rank) for src in range(world)] for batch in self.batches]

    def _of(self, rank: int, batch: set[int], owner: int) -> list[Piece]:
        """Rank `rank`'s pieces of the matrices of `batch` that `owner` orthogonalises, in its flat order."""
        return [p for p in self.pieces[rank] if p.matrix in batch and self.owners[p.matrix] == owner]

    def apply(self, flat: torch.Tensor, orthogonalize: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`flat` with each matrix replaced by `orthogonalize(matrix)`, in place; elements of no matrix (padding)
        become 0. Newton-Schulz runs on `device` (a host master's matrices are copied there and back)."""
        _zero_gaps(flat, self.pieces[self.rank])
        if self.comm is None:
            for piece in self.pieces[0]:
                view = flat.narrow(0, piece.offset, piece.numel)
                view.copy_(orthogonalize(view.to(self.device).view(self.shapes[piece.matrix])).reshape(-1))
            return flat
        whole: dict[int, torch.Tensor] = {}
        for k in range(len(self.batches)):  # every exchange first: no rank waits on another's Newton-Schulz
            whole.update(self._gather_owned(flat, k))
        for m in list(whole):  # each input freed as its result replaces it
            whole[m] = orthogonalize(whole[m].view(self.shapes[m])).reshape(-1)
        for k in range(len(self.batches)):
            self._scatter_back(whole, flat, k)
        return flat

    # -- the two exchanges -------------------------------------------------------------------------------
    def _gather_owned(self, flat: torch.Tensor, k: int) -> dict[int, torch.Tensor]:
        assert self.comm is not None
        sends, receives = self._sends[k], self._receives[k]
        payload = [flat.narrow(0, p.offset, p.numel) for pieces in sends for p in pieces]
        send = torch.cat(payload).to(self.device) if payload else torch.empty(0, dtype=flat.dtype, device=self.device)
        recv = torch.empty(sum(_total(r) for r in receives), dtype=flat.dtype, device=self.device)
        self.comm.all_to_all_uneven(
            recv, send, [_total(r) for r in receives], [_total(s) for s in sends], label="muon: matrices to owners"
        )
        del send
        owned = {p.matrix for pieces in receives for p in pieces}
        whole = {m: recv.new_empty(self.shapes[m].numel()) for m in sorted(owned)}
        at = 0
        for pieces in receives:
            for p in pieces:
                whole[p.matrix].narrow(0, p.begin, p.numel).copy_(recv.narrow(0, at, p.numel))
                at += p.numel
        return whole

    def _scatter_back(self, done: dict[int, torch.Tensor], flat: torch.Tensor, k: int) -> None:
        assert self.comm is not None
        back, mine = self._receives[k], self._sends[k]  # the first exchange's pieces, the other way
        payload = [done[p.matrix].narrow(0, p.begin, p.numel) for pieces in back for p in pieces]
        send = torch.cat(payload) if payload else torch.empty(0, dtype=flat.dtype, device=self.device)
        for m in {p.matrix for pieces in back for p in pieces}:
            del done[m]  # sent: freed before the next batch
        recv = torch.empty(sum(_total(s) for s in mine), dtype=flat.dtype, device=self.device)
        self.comm.all_to_all_uneven(
            recv, send, [_total(s) for s in mine], [_total(r) for r in back], label="muon: updates to holders"
        )
        at = 0
        for pieces in mine:
            for p in pieces:
                flat.narrow(0, p.offset, p.numel).copy_(recv.narrow(0, at, p.numel))
                at += p.numel


def _zero_gaps(flat: torch.Tensor, pieces: Sequence[Piece]) -> None:
    """Zero the elements of `flat` no piece covers (`pieces` sorted by offset)."""
    at = 0
    for p in pieces:
        if p.offset > at:
            flat.narrow(0, at, p.offset - at).zero_()
        at = max(at, p.offset + p.numel)
    if flat.numel() > at:
        flat.narrow(0, at, flat.numel() - at).zero_()


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
