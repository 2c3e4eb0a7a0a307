"""Tensor parallelism on the fsdp2 backend: torch's 2-D composition (FSDP2 over dp of DTensor-split parameters).

[Note: tensor parallelism on fsdp2]
With `"zeroshard": {"backend": "fsdp2"}` the tensor-parallel model ([Note: autotp plan]) is `fully_shard`ed over the
mesh's dp dimension, as PyTorch's 2-D recipe does: FSDP2 shards each tensor-parallel slice's rows over dp (placements
`(Shard(0) or _StridedShard(0), <tp placement>)`) and reduce-scatters gradients over dp; ZeRO-3 (and stage 2's
`reshard_after_forward=False`) of a tensor-parallel model is therefore FSDP2's. To the strategy, the "full" tensor
of a parameter is its tensor-parallel slice ([Note: fsdp2 shards are element ranges] over that slice), so full
values gather over dp only. The norm and the checkpoint names follow the zero backend's: parameters the tensor
parallel plan split count as they are and those it left whole once ([Note: tensor-parallel norm]); slices are
named per tensor-parallel position and the whole ones are written by position 0 ([Note: tensor-parallel
checkpoints]).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from zeroshard.checkpoint.format import TensorInfo
from zeroshard.checkpoint.safetensors_io import dtype_name
from zeroshard.checkpoint.state import ModelPiece, OptimPiece, ShardedState, StatePart
from zeroshard.comm.collectives import Collectives
from zeroshard.errors import ZeroshardError
from zeroshard.fsdp2.checkpoint import Fsdp2State
from zeroshard.fsdp2.strategy import Fsdp2Policy, Fsdp2Strategy
from zeroshard.offload.gradients import GradShard
from zeroshard.precision.loss_scaler import has_inf_or_nan
from zeroshard.tp.checkpoint import blocks_of, slice_name
from zeroshard.tp.mesh import TensorParallelContext
from zeroshard.tp.zero import SHARDS, is_tp_sharded
from zeroshard.zero.stepmath import tensor_norms
from zeroshard.zero.strategy import AccumulationState, ParamGroupSpec


class TensorParallelFsdp2Strategy(Fsdp2Strategy):
    """[Note: tensor parallelism on fsdp2] FSDP2 over dp; the norm and the checkpoint of a tensor-parallel model."""

    def consolidation_refused(self) -> str | None:
        return self.TP_SLICES

    def __init__(
        self,
        module: nn.Module,
        groups: Sequence[ParamGroupSpec],
        policy: Fsdp2Policy,
        comm: Collectives,
        device: torch.device,
        accumulation: AccumulationState,
        tp: TensorParallelContext,
    ):
        # by name: fully_shard replaces the parameter objects
        self.tp_sliced = {name for name, p in module.named_parameters() if is_tp_sharded(p)}
        self.tp_dims = {name: _shard_dim(p) for name, p in module.named_parameters() if name in self.tp_sliced}
        # [Note: fused sub-parameters]: read off the tensor-parallel placements before FSDP2 adds its own
        self.tp_blocks = {name: blocks_of(p) for name, p in module.named_parameters() if blocks_of(p) > 1}
        self.tp_comm: Collectives = tp.tp_comm
        super().__init__(module, groups, policy, comm, device, accumulation)

    def _grad_slots(self) -> list[GradShard]:
        return [s for s in super()._grad_slots() if s.key in self.tp_sliced]

    def _extra_overflow(self) -> bool:
        return has_inf_or_nan([s.shard for s in super()._grad_slots() if s.key not in self.tp_sliced])

    def _extra_norms(self) -> list[torch.Tensor]:
        """The whole parameters' norms, weighted to count once in the sum over tp ([Note: tensor-parallel norm])."""
        whole = [s.shard for s in super()._grad_slots() if s.key not in self.tp_sliced]
        weight = 1.0 / math.sqrt(self.tp_comm.world_size)
        return [n.to(self.device, torch.float32) * weight for n in tensor_norms(whole)]

    def _made_whole(self, key: str, gathered: torch.Tensor) -> torch.Tensor:
        """Each parameter gathered over dp (its tensor-parallel slice), then its slices over tp along the dimension
        the plan split, one parameter at a time (collective; `save_16bit_model` wrote the slices)."""
        dim = self.tp_dims.get(key)
        if dim is None:
            return gathered
        local = gathered.contiguous()
        whole = local.new_empty(self.tp_comm.world_size * local.numel())
        self.tp_comm.all_gather(whole, local.view(-1), label="tp full state dict")
        slices = whole.view(self.tp_comm.world_size, *local.shape).unbind(0)
        blocks = self.tp_blocks.get(key, 1)  # a fused layer's slices hold a piece of each part: part by part
        pieces = [piece for k in range(blocks) for piece in (s.chunk(blocks, dim)[k] for s in slices)]
        return torch.cat(pieces, dim=dim)

    def whole_state_dict(self, exclude_frozen: bool) -> dict[str, Any] | None:
        """The 16-bit state dict (accelerate's `get_state_dict`), each tensor on the host as soon as it is whole: the
        consolidated fp32 masters are slices here."""
        frozen = {name for name, p in self.module.named_parameters() if not p.requires_grad}
        whole = self.whole_tensors(keep=True, device=torch.device("cpu"))
        return {k: v for k, v in whole.items() if not (exclude_frozen and k in frozen)}

    def checkpoint_state(self) -> ShardedState:
        return TensorParallelFsdp2State(self)


def _shard_dim(param: torch.Tensor) -> int:
    """The dimension the tensor-parallel plan split `param` along (its DTensor's Shard placement)."""
    if isinstance(param, DTensor):
        return next(p.dim for p in param.placements if isinstance(p, SHARDS))
    raise ZeroshardError("tensor parallelism on the fsdp2 backend needs DTensor parameters ([Note: autotp plan])")


class TensorParallelFsdp2State(Fsdp2State):
    """`Fsdp2State` with slices under per-position names and whole parameters written by position 0."""

    def __init__(self, strategy: TensorParallelFsdp2Strategy):
        super().__init__(strategy)
        tp, position = strategy.tp_comm.world_size, strategy.tp_comm.rank
        self.first = position == 0
        self.sliced = strategy.tp_sliced
        self.renamed = {name: slice_name(name, position, tp) for name in self.sliced}
        self.peers: dict[str, TensorInfo] = {}
        self.tp_blocks = dict(strategy.tp_blocks)
        self.tp_dims = dict(strategy.tp_dims)
        for sp in strategy.params:
            if sp.name in self.sliced:
                info = TensorInfo(sp.full_shape, dtype_name(sp.master.dtype), "param", True, sp.param.requires_grad)
                self.peers.update({slice_name(sp.name, j, tp): info for j in range(tp) if j != position})

    def _name(self, name: str) -> str:
        return self.renamed.get(name, name)

    def sharded_params(self) -> dict[int, str]:
        return {ident: self._name(name) for ident, name in super().sharded_params().items()}

    def peer_tensors(self) -> dict[str, TensorInfo]:
        return self.peers

    def _model(self, saving: bool) -> list[ModelPiece]:
        return [
            ModelPiece(self._name(p.name), p.begin, p.end, p.values)
            for p in super().model_pieces_to_save()
            if not saving or self.first or p.name in self.sliced
        ]

    def model_pieces_to_save(self) -> list[ModelPiece]:
        return self._model(True)

    def model_bytes_to_save(self, skip: frozenset[int] = frozenset()) -> int:
        left_out = {self._name(sp.name) for sp in self.strategy.params if id(sp.param) in skip}
        return sum(p.values.numel() * p.values.element_size() for p in self._model(True) if p.name not in left_out)

    def model_targets_to_load(self) -> list[ModelPiece]:
        return self._model(False)

    def _optim(self, saving: bool) -> list[OptimPiece]:
        return [
            OptimPiece(self._name(p.name), p.begin, p.end, p.param, p.offset, p.group)
            for p in super().optim_pieces()
            if not saving or self.first or p.name in self.sliced
        ]

    def optim_pieces(self) -> list[OptimPiece]:
        return self._optim(False)

    def parts(self) -> list[StatePart]:
        (part,) = super().parts()
        return [
            StatePart(
                part.suffix,
                part.hold,
                self.model_pieces_to_save,
                self.model_targets_to_load,
                self.optim_pieces,
                part.refresh_master,
                None,
                lambda: self._optim(True),
            )
        ]
