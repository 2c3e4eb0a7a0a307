"""Stage 3 in the checkpoint format's terms (`zeroshard.checkpoint.state.ShardedState`).

Each rank owns one range of each section of every unit's flat buffer ([Note: frozen parameters at stage 3]
in unit.py); the pieces of parameters that fall in those ranges are what it saves and loads: compute-dtype
values from the unit's shard, fp32 master values and elementwise optimizer state from the optimizer's
per-(unit, group) master pieces. The files are the same as for stages 0-2, so checkpoints move between
stage 3 and the others and between world sizes.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from zeroshard.checkpoint.format import TensorInfo
from zeroshard.checkpoint.state import ModelPiece, OptimPiece, StatePart
from zeroshard.zero.stage3.unit import ShardedUnit

if TYPE_CHECKING:
    from zeroshard.zero.stage3.strategy import Stage3Strategy


@dataclass(frozen=True)
class OwnedRange:
    unit: ShardedUnit
    name: str
    begin: int  # element range of the flattened parameter
    end: int
    shard_offset: int  # where it starts in the unit's shard
    group: int
    param: int  # id of the parameter


_HOST = torch.device("cpu")


class Stage3State:
    regather_after_load = True  # loads fill shards; the persistent unit's gathered copy must be refreshed
    loads_whole = False

    def __init__(self, strategy: Stage3Strategy):
        self.strategy = strategy
        # whole-shard copies a load fills for units with a packed tail, quantized again by `refresh_master_from_params`
        # ([Note: quantized frozen weights] in packed.py)
        self._loading: dict[int, torch.Tensor] = {}

    @property
    def writes_optim(self) -> bool:
        return True  # every rank owns distinct ranges

    @property
    def frozen_ids(self) -> frozenset[int]:
        """What `exclude_frozen_parameters` leaves out although sharded here: the parameters frozen when the engine
        was built (DeepSpeed's stage 3 then writes none either; a PEFT checkpoint was the whole base model). One
        frozen later keeps its optimizer state, so its weights are written with it. A load keeps the module's values."""
        units = self.strategy.units
        return frozenset(
            id(p) for u in units for i, p in enumerate(u.params) if i not in u.trainable_set and not p.requires_grad
        )

    def _owned(self, units: Collection[int] | None = None) -> list[OwnedRange]:
        rows = []
        for unit in self.strategy.units:
            if units is not None and unit.index not in units:
                continue
            for slot in unit.layout.slots:
                parts = unit.layout.owned_parts(unit.shard_rank, slot.offset, slot.offset + slot.numel)
                for b, e, at in parts:
                    ident = id(unit.params[slot.index])
                    rows.append(OwnedRange(unit, slot.name, b - slot.offset, e - slot.offset, at, slot.group, ident))
        return rows

    def sharded_params(self) -> dict[int, str]:
        return {id(u.params[s.index]): s.name for u in self.strategy.units for s in u.layout.slots}

    def model_pieces_to_save(self, units: Collection[int] | None = None) -> list[ModelPiece]:
        return self._model_pieces(units, {})

    def _model_pieces(self, units: Collection[int] | None, values: dict[int, torch.Tensor]) -> list[ModelPiece]:
        """Pieces of the units' shards, as `values` (by unit index) holds them, filled in from `shard_values()`."""
        out = []
        for o in self._owned(units):
            shard = values.get(o.unit.index)
            if shard is None:  # a packed unit's values are made in host memory (the device may have no room)
                shard = values[o.unit.index] = o.unit.shard_values(_HOST)
            out.append(ModelPiece(o.name, o.begin, o.end, shard.narrow(0, o.shard_offset, o.end - o.begin)))
        return out

    def model_bytes_to_save(self, skip: frozenset[int] = frozenset()) -> int:
        return sum((o.end - o.begin) * o.unit.shard.element_size() for o in self._owned() if o.param not in skip)

    def model_targets_to_load(self, units: Collection[int] | None = None) -> list[ModelPiece]:
        wanted = [u for u in self.strategy.units if u.tail is not None and (units is None or u.index in units)]
        self._loading.update({u.index: u.shard_values(_HOST) for u in wanted})
        return self._model_pieces(units, dict(self._loading))

    def optim_pieces(self, units: Collection[int] | None = None) -> list[OptimPiece]:
        starts = {}  # (unit, group) -> (optimizer tensor, its offset in the unit's shard)
        for group, pieces in enumerate(self.strategy.built.pieces):
            for piece in pieces:
                starts[(piece.unit.index, group)] = (piece.master, piece.offset)
        out = []
        for o in self._owned(units):
            key = (o.unit.index, o.group)
            if key not in starts:  # frozen parameters have no optimizer piece
                continue
            master, piece_start = starts[key]
            out.append(OptimPiece(o.name, o.begin, o.end, master, o.shard_offset - piece_start, o.group))
        return out

    def refresh_master_from_params(self, units: Collection[int] | None = None) -> None:
        for unit in self.strategy.units:
            if unit.index in self._loading and (units is None or unit.index in units):
                unit.load_values(self._loading.pop(unit.index))
        for unit in self.strategy.units:
            if units is None or unit.index in units:
                unit.master_from_shard()

    def peer_tensors(self) -> dict[str, TensorInfo]:
        return {}  # every rank's module holds every tensor

    def full_shapes(self) -> dict[int, tuple[int, ...]]:
        return {
            id(u.params[s.index]): tuple(u.views[s.index].shape) for u in self.strategy.units for s in u.layout.slots
        }

    def publish_params(self) -> None:
        """Compute shards := masters, and gathered units (the persistent one) re-gathered (collective)."""
        strategy = self.strategy
        for sub_group in strategy.built.sub_groups:  # with NVMe offload, one sub-group in memory at a time
            with strategy.stepper.resident(sub_group):
                for unit in sub_group.units:
                    unit.publish()
                    unit.wait_published()
                    unit.settle_shard()
        strategy.refresh_gathered()

    def parts(self) -> list[StatePart]:
        """One part unless state leaves memory between steps (NVMe); then one per sub-group ([Note: state parts])."""
        strategy = self.strategy
        stepper = strategy.stepper
        sub_groups = strategy.built.sub_groups
        swaps = stepper.store.leaves_memory or stepper.param_store.leaves_memory
        if not swaps or len(sub_groups) < 2:
            return [
                StatePart(
                    "",
                    stepper.all_resident,
                    self.model_pieces_to_save,
                    self.model_targets_to_load,
                    self.optim_pieces,
                    self.refresh_master_from_params,
                    None,
                )
            ]
        parts = []
        for k, sub_group in enumerate(sub_groups):
            members = frozenset(u.index for u in sub_group.units)
            pieces = strategy.built.pieces
            params = {id(piece.master) for group in pieces for piece in group if piece.unit.index in members}
            if k == 0:  # empty stand-ins of groups this rank owns nothing of
                params |= {id(p) for p in strategy.built.placeholders}
            parts.append(
                StatePart(
                    f".part{k:05d}",
                    partial(stepper.resident, sub_group),
                    partial(self.model_pieces_to_save, members),
                    partial(self.model_targets_to_load, members),
                    partial(self.optim_pieces, members),
                    partial(self.refresh_master_from_params, members),
                    params,
                )
            )
        return parts
