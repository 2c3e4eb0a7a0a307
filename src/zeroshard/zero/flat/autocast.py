"""`torch_autocast` at stages 0-2: gradients of lower-precision-safe modules reduced in the autocast dtype.

[Note: torch autocast]
DeepSpeed's `torch_autocast` mode keeps parameters, gradients and master weights in fp32 and runs the forward under
`torch.autocast(dtype)`; the gradients of the parameters of "lower-precision-safe" modules (`torch.nn.Linear` and
`Conv1d/2d/3d` unless `lower_precision_safe_modules` names others, matched by exact class) are communicated in the
autocast dtype, the rest in fp32. Here the engine enters the autocast context around the forward, and at stages 0-2
at stages 1-2 the model splits into two `FlatStrategy`s ([Note: split flat strategies]) over the same data-parallel
group that differ only in their communication dtype: the autocast dtype, and fp32 (the parameters' dtype, whatever
`communication_data_type` says, as DeepSpeed sends them). Stage 0 reduces every gradient in
`communication_data_type` (fp32 by default), as DeepSpeed's engine does without a ZeRO optimizer. Stage 3 and the
fsdp2 backend reduce every gradient in fp32 (a warning says so: twice DeepSpeed's bytes for those modules, and no
rounding of them). The float16 autocast dtype, which needs a gradient scaler, is refused at parse time; so are
offload_optimizer, tensor and expert parallelism at stages 1-2 (they split the flat strategy their own way).
Beside `bf16.enabled` (DeepSpeed's bf16_master_weight example sets both) nothing of this applies: the model trains in
bf16 and only its forward runs under `torch.autocast(bf16)` (`PrecisionPolicy.forward_autocast`), as DeepSpeed's does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from zeroshard.checkpoint.state import ModelPiece, OptimPiece, StatePart
from zeroshard.comm.collectives import Collectives
from zeroshard.zero.flat.checkpoint import FlatState, one_resident_part
from zeroshard.zero.flat.split import SplitStrategy, flat_parts, split_groups
from zeroshard.zero.flat.strategy import FlatPolicy
from zeroshard.zero.strategy import AccumulationState, ParamGroupSpec


def lower_precision_params(module: nn.Module, classes: tuple[type, ...]) -> set[int]:
    """The parameters owned (directly) by modules of exactly one of `classes`, as DeepSpeed matches them."""
    return {id(p) for m in module.modules() if type(m) in classes for p in m.parameters(recurse=False)}


class AutocastSplitStrategy(SplitStrategy):
    """[Note: torch autocast] the lower-precision-safe modules' parameters, reduced in `low_dtype`, and the rest,
    reduced in the policy's (fp32) communication dtype: two parts over one group, one optimizer."""

    def __init__(
        self,
        module: nn.Module,
        groups: Sequence[ParamGroupSpec],
        policy: FlatPolicy,
        comm: Collectives,
        device: torch.device,
        accumulation: AccumulationState,
        low: set[int],
        low_dtype: torch.dtype,
    ):
        super().__init__(module, groups, policy, comm, device, accumulation)
        rest, picked = split_groups(groups, low)
        low_policy = dataclasses.replace(policy, comm_dtype=low_dtype)
        fp32_policy = dataclasses.replace(policy, comm_dtype=torch.float32)
        halves = [(picked, low_policy, comm), (rest, fp32_policy, comm)]
        self.low, self.rest = self._hold(flat_parts(module, halves, device, accumulation))

    def checkpoint_state(self) -> AutocastSplitState:
        return AutocastSplitState(self)


class AutocastSplitState:
    """`ShardedState` of `AutocastSplitStrategy`: both parts' `FlatState`s under the parameters' own names, the
    second part's optimizer groups after the first's."""

    regather_after_load = False
    loads_whole = True

    def __init__(self, strategy: AutocastSplitStrategy):
        self.strategy = strategy
        self.low, self.rest = FlatState(strategy.low), FlatState(strategy.rest)
        self.group_offset = len(strategy.low.buffers)

    @property
    def writes_optim(self) -> bool:
        return self.low.writes_optim

    def full_shapes(self) -> dict[int, tuple[int, ...]]:
        return {}

    def peer_tensors(self) -> dict:
        return {}

    def sharded_params(self) -> dict[int, str]:
        return {**self.low.sharded_params(), **self.rest.sharded_params()}

    def model_pieces_to_save(self) -> list[ModelPiece]:
        return self.low.model_pieces_to_save() + self.rest.model_pieces_to_save()

    def model_bytes_to_save(self, skip: frozenset[int] = frozenset()) -> int:
        return self.low.model_bytes_to_save(skip) + self.rest.model_bytes_to_save(skip)

    def model_targets_to_load(self) -> list[ModelPiece]:
        return self.low.model_targets_to_load() + self.rest.model_targets_to_load()

    def optim_pieces(self) -> list[OptimPiece]:
        rest = [dataclasses.replace(p, group=p.group + self.group_offset) for p in self.rest.optim_pieces()]
        return self.low.optim_pieces() + rest

    def refresh_master_from_params(self) -> None:
        self.low.refresh_master_from_params()
        self.rest.refresh_master_from_params()

    def publish_params(self) -> None:
        self.strategy.publish_params()

    def parts(self) -> list[StatePart]:
        return one_resident_part(self, self.strategy)
