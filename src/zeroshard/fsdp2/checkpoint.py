"""The fsdp2 backend in the checkpoint format's terms (`zeroshard.checkpoint.state.ShardedState`).

Each rank holds rows of every parameter, i.e. one element range per parameter ([Note: fsdp2 shards are element
ranges]); those ranges are its model pieces and, for trainable parameters, its optimizer pieces at offset 0 of the
optimizer's tensor. The module's sharded parameters are the fp32 masters themselves, so the model pieces are
written in fp32 (a loader reads them in any dtype) and loading fills the masters directly. The files are the
zero backend's, so a run moves between the backends and between world sizes.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

from zeroshard.checkpoint.format import TensorInfo
from zeroshard.checkpoint.state import ModelPiece, OptimPiece, StatePart

if TYPE_CHECKING:
    from zeroshard.fsdp2.strategy import Fsdp2Strategy


class Fsdp2State:
    regather_after_load = True  # a unit gathered before the load holds old values: it is released
    loads_whole = False  # each rank fills its own shards

    def __init__(self, strategy: Fsdp2Strategy):
        self.strategy = strategy

    @property
    def writes_optim(self) -> bool:
        return True  # every rank owns distinct rows

    @property
    def frozen_ids(self) -> frozenset[int]:
        """What `exclude_frozen_parameters` leaves out although sharded here: the parameters without optimizer state
        (frozen when the engine was built), as the zero backend's stage 3 (zero/stage3/checkpoint.py). A load keeps the
        module's values."""
        return frozenset(id(sp.param) for sp in self.strategy.params if not sp.trainable and not sp.param.requires_grad)

    def sharded_params(self) -> dict[int, str]:
        return {id(sp.param): sp.name for sp in self.strategy.params}

    def model_pieces_to_save(self) -> list[ModelPiece]:
        return [
            ModelPiece(sp.name, sp.begin, sp.end, sp.master.view(-1)) for sp in self.strategy.params if sp.numel > 0
        ]

    def model_bytes_to_save(self, skip: frozenset[int] = frozenset()) -> int:
        return sum(sp.numel * sp.master.element_size() for sp in self.strategy.params if id(sp.param) not in skip)

    def model_targets_to_load(self) -> list[ModelPiece]:
        return self.model_pieces_to_save()

    def optim_pieces(self) -> list[OptimPiece]:
        return [
            OptimPiece(sp.name, sp.begin, sp.end, sp.master, 0, sp.group)
            for sp in self.strategy.params
            if sp.trainable and sp.numel > 0
        ]

    def refresh_master_from_params(self) -> None:
        return None  # the module's sharded parameters are the masters

    def publish_params(self) -> None:
        self.strategy._publish()

    def peer_tensors(self) -> dict[str, TensorInfo]:
        return {}  # every rank's module holds every tensor

    def full_shapes(self) -> dict[int, tuple[int, ...]]:
        return {id(sp.param): sp.full_shape for sp in self.strategy.params}

    def parts(self) -> list[StatePart]:
        return [
            StatePart(
                "",
                lambda changes: nullcontext(),
                self.model_pieces_to_save,
                self.model_targets_to_load,
                self.optim_pieces,
                self.refresh_master_from_params,
                None,
            )
        ]
