"""ZeRO stages 0-2 over the data-parallel dimension of a dp x tp mesh.

[Note: tensor-parallel norm]
Each rank's flat buffers hold its tensor-parallel slice of every parameter ([Note: DTensor parameters]); ZeRO
reduces and shards them over the data-parallel group only, so its per-rank squared norms summed over that group
give the norm of this tensor-parallel rank's slice. Summing once more over the tensor-parallel group (the step
policy's `model_parallel`) gives the whole model's norm for the sharded parameters, but would count `tp` times
those every tensor-parallel rank holds whole (RMSNorm weights, row-parallel biases: their gradients are equal on
every tensor-parallel rank, since the activations around them are replicated). So the model splits into two
`FlatStrategy`s ([Note: split flat strategies]): the tensor-parallel shards, whose squares count as they are,
and the replicated parameters, whose squares are divided by `tp` before that sum (DeepSpeed counts them on
tensor-parallel rank 0 only; the sum is the same). Clipping then sees the global norm over dp and tp, as DeepSpeed's
and Megatron's does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from zeroshard.checkpoint.state import ShardedState
from zeroshard.comm.collectives import Collectives
from zeroshard.errors import ZeroshardError
from zeroshard.offload.gradients import GradShard
from zeroshard.precision.loss_scaler import has_inf_or_nan
from zeroshard.zero.flat.split import SplitStrategy, flat_parts, split_groups
from zeroshard.zero.flat.strategy import FlatPolicy
from zeroshard.zero.stepmath import tensor_norms
from zeroshard.zero.strategy import AccumulationState, ParamGroupSpec

SHARDS = (Shard, _StridedShard)  # split placements (a fused layer's parts: [Note: fused sub-parameters] in tp/plan.py)


def is_tp_sharded(param: torch.Tensor) -> bool:
    """Whether `param` holds a different slice on each tensor-parallel rank: a DTensor with a Shard placement (or
    `_StridedShard`, not a Shard subclass in every torch release), or a Megatron parameter marked
    `tensor_model_parallel` / `model_parallel` (DeepSpeed's test for an mpu's model)."""
    if isinstance(param, DTensor):
        return any(isinstance(p, SHARDS) for p in param.placements)
    return bool(getattr(param, "tensor_model_parallel", False) or getattr(param, "model_parallel", False))


class TensorParallelStrategy(SplitStrategy):
    """[Note: tensor-parallel norm] ZeRO over `comm` (the data-parallel group) for tensor-parallel shards and for
    replicated parameters, one optimizer."""

    def __init__(
        self,
        module: nn.Module,
        groups: Sequence[ParamGroupSpec],
        policy: FlatPolicy,
        comm: Collectives,
        device: torch.device,
        accumulation: AccumulationState,
        tp_comm: Collectives,
    ):
        super().__init__(module, groups, policy, comm, device, accumulation)
        sharded = {id(p) for g in groups for _, p in g.params if is_tp_sharded(p)}
        replicated_groups, sharded_groups = split_groups(groups, sharded)
        self.tp_comm = tp_comm
        halves = [(sharded_groups, policy, comm), (replicated_groups, policy, comm)]
        self.sharded, self.replicated = self._hold(flat_parts(module, halves, device, accumulation))

    def _grad_slots(self) -> list[GradShard]:
        return self.sharded._grad_slots()

    def _extra_overflow(self) -> bool:
        return has_inf_or_nan([s.shard for s in self.replicated._grad_slots()])

    def _extra_norms(self) -> list[torch.Tensor]:
        """The replicated parameters' norms, weighted to count once in the sum over tp ([Note: tensor-parallel
        norm]); then each part's own extras."""
        weight = 1.0 / math.sqrt(self.tp_comm.world_size)
        replicated = [n * weight for n in tensor_norms([s.shard for s in self.replicated._grad_slots()])]
        # [Note: clipping over the whole module at stage 0] the bystanders (all in the first part) alike
        bystanders = [n if is_tp_sharded(p) else n * weight for p, n in self.sharded.bystanders.norms()]
        return replicated + bystanders

    def full_state_dict(self) -> dict[str, Any]:
        """The module's state dict with each tensor-parallel slice made whole (`save_16bit_model`, accelerate's
        `get_state_dict`; collective over the tensor-parallel group, in the state dict's order, as DeepSpeed's
        `_replace_module_consolidated_state_dict` gathers AutoTP's layers). An mpu's own split layers (Megatron-marked
        parameters) are laid out as only the caller knows (a fused qkv, ...): refused."""
        self._refuse_mpu_slices()
        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in self.module.state_dict().items()}

    def _refuse_mpu_slices(self) -> None:
        mine = [name for name, p in self.module.named_parameters() if is_tp_sharded(p) and not isinstance(p, DTensor)]
        if mine:
            raise ZeroshardError(
                f"the whole model cannot be gathered here: {mine[0]} and {len(mine) - 1} more are the mpu's own "
                "tensor-parallel slices, whose layout zeroshard does not know; save_checkpoint keeps every slice"
            )

    def save_state_dict(self, keep: bool) -> dict[str, Any]:
        """`full_state_dict`'s tensors, each on the host as soon as it is whole and only where `keep`: the whole model
        is never on a GPU (every rank gathers, in state-dict order)."""
        self._refuse_mpu_slices()
        out, done = {}, {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            if id(value) not in done:  # a tied weight once (the save writes it once)
                whole = value.full_tensor() if isinstance(value, DTensor) else value  # (collective: every rank)
                on_host = whole.detach().to("cpu", copy=True) if isinstance(whole, torch.Tensor) and keep else whole
                done[id(value)] = on_host if keep else None
            if keep:
                out[key] = done[id(value)]
        return out

    def checkpoint_state(self) -> ShardedState:
        from zeroshard.tp.checkpoint import TensorParallelState

        return TensorParallelState(self)
