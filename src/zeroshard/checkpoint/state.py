"""What a ZeRO strategy holds on one rank, in the terms of the checkpoint format: pieces of tensors.

[Note: strategy adapters]
The save and load code never looks at buckets, shard offsets or padding. A strategy describes its
sharded tensors through the `ShardedState` protocol: which module parameters it owns the storage of,
the model-weight pieces this rank writes, the ranges this rank must fill on load, and the pieces of the
optimizer's parameters (with the offset of each piece inside the optimizer's tensor, so elementwise
optimizer state is a slice at the same offset). `Strategy.checkpoint_state()` returns one: `FlatState`
(zero/flat/checkpoint.py) for stages 0-2, `Stage3State` (zero/stage3/checkpoint.py) over stage 3's per-unit
partitions; the files they write and read are the same (see [Note: checkpoint format]).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from zeroshard.checkpoint.format import TensorInfo


@dataclass(frozen=True)
class ModelPiece:
    """Elements [begin, end) of the module tensor `name`; `values` is a 1-D view of them."""

    name: str
    begin: int
    end: int
    values: torch.Tensor


@dataclass(frozen=True)
class OptimPiece:
    """Elements [begin, end) of parameter `name`, held at `param[offset : offset + end - begin]`.

    `param` is the tensor the optimizer steps (a flat fp32 master shard); its elementwise optimizer
    state holds the same piece at the same offset.
    """

    name: str
    begin: int
    end: int
    param: torch.Tensor
    offset: int
    group: int

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view(-1).narrow(0, self.offset, self.end - self.begin)


@dataclass(frozen=True)
class StatePart:
    """[Note: state parts] A slice of a rank's state that save and load handle while it is in memory.

    Strategies whose state lives on NVMe between steps split it (stage 3: one part per optimizer sub-group),
    so a checkpoint never needs the rank's whole state in memory; each part writes its own files (`suffix`).
    Everything else is one part, suffix "", whose `hold` is a no-op unless the state is swapped.
    `hold(changes)` keeps the part in memory for the block; `changes` says whether the block modifies it
    (a load: written back after) or only reads it (a save: freed without writing).
    """

    suffix: str
    hold: Callable[[bool], AbstractContextManager[None]]
    model_pieces: Callable[[], list[ModelPiece]]  # to save
    model_targets: Callable[[], list[ModelPiece]]  # to fill on load
    optim_pieces: Callable[[], list[OptimPiece]]
    refresh_master: Callable[[], None]  # master weights := module weights, for this part
    optimizer_params: set[int] | None  # ids of the optimizer's parameters this part restores (None: all)
    # the pieces this rank writes, where they are fewer than those it restores (None: `optim_pieces`): a rank
    # holding a copy that a peer writes ([Note: tensor-parallel checkpoints] in tp/checkpoint.py)
    optim_pieces_to_save: Callable[[], list[OptimPiece]] | None = None


class ShardedState(Protocol):
    """See [Note: strategy adapters]."""

    def sharded_params(self) -> dict[int, str]:
        """id(parameter) -> state_dict name, for the parameters whose storage the strategy manages."""
        ...

    def model_pieces_to_save(self) -> list[ModelPiece]:
        """Pieces of sharded parameters that this rank writes (every element written by exactly one rank)."""
        ...

    def model_bytes_to_save(self, skip: frozenset[int] = frozenset()) -> int:
        """Bytes of `model_pieces_to_save`, read from shapes only (the shards may be on NVMe); without those of the
        parameters `skip` names by id (what `exclude_frozen_parameters` leaves out: `frozen_ids`)."""
        ...

    def model_targets_to_load(self) -> list[ModelPiece]:
        """Ranges of sharded parameters this rank fills from the checkpoint's model weights."""
        ...

    def optim_pieces(self) -> list[OptimPiece]:
        """This rank's pieces of the optimizer's parameters (for saving: only when `writes_optim`)."""
        ...

    @property
    def writes_optim(self) -> bool:
        """Whether this rank writes its optimizer pieces (false where another rank holds a copy)."""
        ...

    def refresh_master_from_params(self) -> None:
        """Master weights := the module's (compute-dtype) weights, for the pieces this rank owns."""
        ...

    def publish_params(self) -> None:
        """Module weights := master weights (collective: every rank calls it)."""
        ...

    def parts(self) -> list[StatePart]:
        """The state in the slices save and load handle one at a time (see [Note: state parts])."""
        ...

    @property
    def loads_whole(self) -> bool:
        """Whether every rank fills every module weight whole on load (stages 0-2: parameters are replicated), not
        only the ranges it saved ([Note: node-local checkpoints] keeps one whole copy per node then)."""
        ...

    @property
    def regather_after_load(self) -> bool:
        """Whether a load (which fills shards) must re-gather copies made from them (stage 3's persistent unit)."""
        ...

    def full_shapes(self) -> dict[int, tuple[int, ...]]:
        """Full shapes of sharded parameters by id, where the module holds placeholders (stage 3); else empty."""
        ...

    def peer_tensors(self) -> dict[str, TensorInfo]:
        """Trainable tensors other ranks hold and this rank's module does not (MoE experts of other
        expert-parallel ranks, [Note: expert checkpoints] in moe/checkpoint.py): named in the checkpoint, never
        expected in this rank's module. Empty for data-parallel strategies."""
        ...
