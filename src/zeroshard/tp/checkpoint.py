"""Checkpoints of a tensor-parallel model (`TensorParallelStrategy`) in the ordinary checkpoint format.

[Note: tensor-parallel checkpoints]
A tensor-parallel rank's module calls its slice of `...q_proj.weight` by the full tensor's key, and the slices of
the `tp` ranks differ. In the checkpoint each slice is a tensor of its own, `<key>.tp<j>of<tp>` (local shape),
written (sharded over the data-parallel group, as its optimizer state is) by the ranks of tensor-parallel
position `j`; every rank lists the other positions' slices as `peer_tensors`. Parameters every tensor-parallel rank
holds whole keep their key and are written by tensor-parallel rank 0's data-parallel group only (each element
once), and read back by every rank. Within the same `tp` a checkpoint therefore loads into any data-parallel size
and ZeRO stage 0-2 (pieces are ranges of named tensors); into another `tp` (1 included: no tensor_parallel block,
and from a checkpoint saved without one) the slices are concatenated and split at read time ([Note:
tensor-parallel resharding] in tp/reshard.py). Nothing beyond the slice names is recorded (the split dimension
follows from the shapes) except `extra["tensor_parallel_caller_split"]` when the slices are not DTensors (an
mpu's Megatron-marked model, whose slices need not be plain splits: such a checkpoint is not resharded), and
`extra["tensor_parallel_blocks"]` (key: parts) for fused layers whose slices hold a piece of each equal part
([Note: fused sub-parameters] in tp/plan.py).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from zeroshard.checkpoint.format import TensorInfo
from zeroshard.checkpoint.safetensors_io import dtype_name
from zeroshard.checkpoint.state import ModelPiece, OptimPiece, StatePart
from zeroshard.zero.flat.checkpoint import FlatState
from zeroshard.zero.flat.local import local_of

if TYPE_CHECKING:
    from zeroshard.tp.zero import TensorParallelStrategy

_SLICE = re.compile(r"\.tp(\d+)of(\d+)$")


def slice_name(key: str, position: int, tp: int) -> str:
    return f"{key}.tp{position}of{tp}"


def base_of(name: str) -> str:
    """The full tensor's key of a slice name (`name` itself for a whole tensor)."""
    return _SLICE.sub("", name)


def blocks_of(param: object) -> int:
    """The equal parts of a fused parameter whose slices hold a piece of each (`_StridedShard`'s split factor,
    [Note: fused sub-parameters] in tp/plan.py); 1 for a plain split."""
    placements = getattr(param, "placements", ())
    return next((int(p.split_factor) for p in placements if isinstance(p, _StridedShard)), 1)


def tp_size_of(names: list[str]) -> int | list[int]:
    """The tensor-parallel size the slice names among `names` were written with (1: none; a list: several)."""
    sizes = sorted({int(m.group(2)) for m in map(_SLICE.search, names) if m})
    return 1 if not sizes else sizes[0] if len(sizes) == 1 else sizes


class TensorParallelState:
    """`ShardedState` of `TensorParallelStrategy`: both parts' `FlatState`s, slices under per-position names."""

    regather_after_load = False
    loads_whole = True

    def __init__(self, strategy: TensorParallelStrategy):
        self.strategy = strategy
        self.sharded, self.replicated = FlatState(strategy.sharded), FlatState(strategy.replicated)
        tp, position = strategy.tp_comm.world_size, strategy.tp_comm.rank
        self.first = position == 0
        self.renamed: dict[str, str] = {}
        self.peers: dict[str, TensorInfo] = {}
        self.shapes: dict[int, tuple[int, ...]] = {}
        params = {id(p): p for p in strategy.sharded.tracked_params()}
        # Megatron-marked tensors of an mpu's model: their layout (fused qkv, ...) is the caller's, not a plain split
        self.caller_split = not all(isinstance(params[i], DTensor) for i in self.sharded.sharded_params())
        self.tp_blocks: dict[str, int] = {}  # [Note: fused sub-parameters]: the parts a slice holds one piece of each
        self.tp_dims: dict[str, int] = {}
        for param_id, key in self.sharded.sharded_params().items():
            param = params[param_id]
            if (blocks := blocks_of(param)) > 1:
                self.tp_blocks[key] = blocks
            if isinstance(param, DTensor):  # the split dimension, for the offline export ([Note: ...resharding])
                self.tp_dims[key] = next(p.dim for p in param.placements if isinstance(p, Shard | _StridedShard))
            local = local_of(param)
            self.renamed[key] = slice_name(key, position, tp)
            self.shapes[param_id] = tuple(local.shape)
            info = TensorInfo(tuple(local.shape), dtype_name(local.dtype), "param", True, param.requires_grad)
            self.peers.update({slice_name(key, j, tp): info for j in range(tp) if j != position})
        self.group_offset = len(strategy.sharded.buffers)  # the replicated part's groups follow in the optimizer

    def _model(self, pieces: list[ModelPiece]) -> list[ModelPiece]:
        return [ModelPiece(self.renamed[p.name], p.begin, p.end, p.values) for p in pieces]

    def full_shapes(self) -> dict[int, tuple[int, ...]]:
        return self.shapes  # a slice's shape, not the DTensor's global one

    def peer_tensors(self) -> dict[str, TensorInfo]:
        return self.peers

    @property
    def writes_optim(self) -> bool:
        return self.sharded.writes_optim

    def sharded_params(self) -> dict[int, str]:
        sliced = {ident: self.renamed[name] for ident, name in self.sharded.sharded_params().items()}
        return {**sliced, **self.replicated.sharded_params()}

    def model_pieces_to_save(self) -> list[ModelPiece]:
        replicated = self.replicated.model_pieces_to_save() if self.first else []
        return self._model(self.sharded.model_pieces_to_save()) + replicated

    def model_bytes_to_save(self, skip: frozenset[int] = frozenset()) -> int:
        replicated = self.replicated.model_bytes_to_save(skip) if self.first else 0
        return self.sharded.model_bytes_to_save(skip) + replicated

    def model_targets_to_load(self) -> list[ModelPiece]:
        return self._model(self.sharded.model_targets_to_load()) + self.replicated.model_targets_to_load()

    def _optim(self, with_replicated: bool) -> list[OptimPiece]:
        sliced = [
            OptimPiece(self.renamed[p.name], p.begin, p.end, p.param, p.offset, p.group)
            for p in self.sharded.optim_pieces()
        ]
        if not with_replicated:
            return sliced
        offset = self.group_offset
        return sliced + [
            OptimPiece(p.name, p.begin, p.end, p.param, p.offset, p.group + offset)
            for p in self.replicated.optim_pieces()
        ]

    def optim_pieces(self) -> list[OptimPiece]:
        return self._optim(True)

    def refresh_master_from_params(self) -> None:
        self.sharded.refresh_master_from_params()
        self.replicated.refresh_master_from_params()

    def publish_params(self) -> None:
        self.strategy.publish_params()

    def parts(self) -> list[StatePart]:
        return [
            StatePart(
                "",
                lambda changes: self.strategy.optimizer_state_resident(),
                self.model_pieces_to_save,
                self.model_targets_to_load,
                self.optim_pieces,
                self.refresh_master_from_params,
                None,
                lambda: self._optim(self.first),
            )
        ]
