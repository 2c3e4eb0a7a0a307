"""Stages 0-2 in the checkpoint format's terms (`zeroshard.checkpoint.state.ShardedState`).

Rank r owns the r-th slice of every bucket; the pieces of parameters in those slices are what it writes: model
weights from the parameter buffer, fp32 master values and elementwise optimizer state from the group's master
shard. Parameters are replicated, so on load every rank fills every parameter whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zeroshard.checkpoint.format import TensorInfo
from zeroshard.checkpoint.state import ModelPiece, OptimPiece, StatePart
from zeroshard.zero.layout import owned_pieces

if TYPE_CHECKING:
    from zeroshard.zero.flat.strategy import FlatStrategy


class FlatState:
    """`ShardedState` of the stage 0/1/2 flat-buffer optimizer."""

    def __init__(self, strategy: FlatStrategy):
        self.strategy = strategy
        self.rank = strategy.rank

    regather_after_load = False  # parameters are filled whole on every rank
    loads_whole = True

    def peer_tensors(self) -> dict[str, TensorInfo]:
        return {}  # every rank's module holds every tensor

    def full_shapes(self) -> dict[int, tuple[int, ...]]:
        return {}  # the module's own tensors have their full shapes

    @property
    def writes_optim(self) -> bool:
        # Stage 0 shards nothing (shard_count 1): every rank holds everything and rank 0 writes it.
        return self.rank < self.strategy.layout.shard_count

    def sharded_params(self) -> dict[int, str]:
        return {
            id(buffers.params[slot.index]): slot.name
            for buffers in self.strategy.buffers
            for slot in buffers.layout.slots
        }

    def _owned(self) -> list[tuple[int, str, int, int, int, int]]:
        """(group, name, begin, end, offset in the param buffer, offset in the master shard) per piece."""
        rows = []
        for g, buffers in enumerate(self.strategy.buffers):
            layout = buffers.layout
            for piece in owned_pieces(layout, self.strategy.shard_rank):
                slot = layout.slots[piece.slot]
                flat = slot.offset + piece.param_begin
                rows.append((g, slot.name, piece.param_begin, piece.param_end, flat, piece.shard_offset))
        return rows

    def model_pieces_to_save(self) -> list[ModelPiece]:
        if not self.writes_optim:
            return []
        return [
            ModelPiece(name, begin, end, self.strategy.buffers[g].param_flat.narrow(0, flat, end - begin))
            for g, name, begin, end, flat, _ in self._owned()
        ]

    def model_bytes_to_save(self, skip: frozenset[int] = frozenset()) -> int:
        # (`skip`: the trainable parameters are what a flat part shards)
        if not self.writes_optim:
            return 0
        buffers = self.strategy.buffers
        return sum((end - begin) * buffers[g].param_flat.element_size() for g, _, begin, end, _, _ in self._owned())

    def model_targets_to_load(self) -> list[ModelPiece]:
        # Parameters are replicated in stages 0-2: every rank fills every parameter whole.
        return [
            ModelPiece(slot.name, 0, slot.numel, buffers.param_flat.narrow(0, slot.offset, slot.numel))
            for buffers in self.strategy.buffers
            for slot in buffers.layout.slots
        ]

    def optim_pieces(self) -> list[OptimPiece]:
        return [
            OptimPiece(name, begin, end, self.strategy.buffers[g].master, offset, g)
            for g, name, begin, end, _, offset in self._owned()
        ]

    def refresh_master_from_params(self) -> None:
        for g, _, begin, end, flat, offset in self._owned():
            buffers = self.strategy.buffers[g]
            if not buffers.master_aliases_params:
                buffers.master.narrow(0, offset, end - begin).copy_(buffers.param_flat.narrow(0, flat, end - begin))

    def publish_params(self) -> None:
        self.strategy.publish_params()

    def parts(self) -> list[StatePart]:
        return one_resident_part(self, self.strategy)


def one_resident_part(state: Any, strategy: Any) -> list[StatePart]:
    """The whole state of a flat (or split flat) strategy as one part: NVMe offload swaps whole parameter groups
    here, so every group is read in for the block."""
    return [
        StatePart(
            "",
            lambda changes: strategy.optimizer_state_resident(),
            state.model_pieces_to_save,
            state.model_targets_to_load,
            state.optim_pieces,
            state.refresh_master_from_params,
            None,
        )
    ]
