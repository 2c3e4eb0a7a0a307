"""DeepSpeed's ZeRO-3 parameter attributes, for the scripts and libraries that read them.

[Note: DeepSpeed's parameter attributes]
DeepSpeed's stage 3 sets about twenty `ds_*` attributes on every parameter, and code written for it reads a few of
them to tell a partitioned parameter (whose `.data` is empty between uses) from a whole one:
- DeepSpeed-Chat saves a ZeRO-3 model by gathering `[p for p in params if hasattr(p, "ds_id") and p.ds_status ==
  ZeroParamStatus.NOT_AVAILABLE]` around `p.data.cpu()` (`save_zero_three_model`; also its EMA and its loading), and
  counts parameters as `p.ds_numel if hasattr(p, "ds_tensor") else p.numel()`. Without the attributes zeroshard's
  stage 3 saved every released parameter as an empty tensor and printed 0 parameters, with no error.
- PEFT counts with `ds_numel` (`print_trainable_parameters`) and reads a layer's shape from `ds_shape`; TRL decides
  what to gather from `ds_status`; transformers' `get_model_param_count` reads `ds_numel`.
So zeroshard's stage 3 sets, on each parameter it partitions, the six that such code reads, with DeepSpeed 0.19.8's
meanings: `ds_id` (a number unique in the process, in the model's parameter order), `ds_shape`, `ds_numel` (the
whole parameter's), `ds_persist` (in the persistent unit: never released, [Note: units] in plan.py), `ds_status` (a
`ZeroParamStatus`, kept current as its unit is gathered and released: AVAILABLE, INFLIGHT while a gather is issued
and not waited for, NOT_AVAILABLE) and `ds_tensor` (this rank's part of the parameter in the compute dtype: a view
of the unit's shard, empty where this rank holds none of it, and empty when the shard's home is NVMe or the part is
held quantized, as DeepSpeed's is empty when swapped out). They are a mirror for callers, written and never read by
zeroshard (a prefetched unit's parameters are INFLIGHT with `.data` still the empty placeholder, where DeepSpeed
shows the buffer being filled; DeepSpeed-Chat's save skips INFLIGHT ones under both); tensors read inside a
`GatheredParameters` block stay valid after it ([Note: gathered storage] in unit.py). zeroshard's own lookups stay
in `zero.owners` ([Note: parameter registry]), which is why this is the one exception to STYLE.md's rule against
attributes on `nn.Parameter`. DeepSpeed's other attributes (its methods `all_gather`/`partition`, process groups,
swap handles) are its machinery and are not set; stages 0-2 set none, as DeepSpeed's; `destroy()` removes them with
the partitioning.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from enum import Enum

import torch
from torch import nn

from zeroshard.zero.stage3.plan import Slot, UnitLayout

ATTRIBUTES = ("ds_id", "ds_shape", "ds_numel", "ds_persist", "ds_tensor", "ds_status")

_IDS = itertools.count()  # DeepSpeed's `Init.param_id`: unique in the process, never reused


class ZeroParamStatus(Enum):
    """DeepSpeed's `deepspeed.runtime.zero.partition_parameters.ZeroParamStatus` (same members and values)."""

    AVAILABLE = 1  # the whole parameter is in `.data` on every rank
    NOT_AVAILABLE = 2  # partitioned: `.data` is empty
    INFLIGHT = 3  # being gathered


def mark(
    params: Sequence[nn.Parameter], views: Sequence[torch.Tensor], parts: Sequence[torch.Tensor], persistent: bool
) -> None:
    """Point each of a new unit's parameters at its view of the gathered buffer and give it DeepSpeed's attributes
    ([Note: DeepSpeed's parameter attributes]); `parts[i]` is this rank's part of `params[i]`."""
    show(params, views, ZeroParamStatus.AVAILABLE)
    number(params)  # numbered in the model's order by `build_units` first, or by zero_init at construction
    for param, part in zip(params, parts, strict=True):
        _describe(param, part, persistent)


def _describe(param: nn.Parameter, part: torch.Tensor, persistent: bool) -> None:
    param.ds_shape = param.shape  # type: ignore[attr-defined]
    param.ds_numel = param.numel()  # type: ignore[attr-defined]
    param.ds_persist = persistent  # type: ignore[attr-defined]
    param.ds_tensor = part  # type: ignore[attr-defined]


def number(params: Iterable[nn.Parameter]) -> None:
    """`ds_id`s in the model's parameter order (DeepSpeed numbers them as `zero.Init` builds the modules), for those
    `zero_init` did not number at construction."""
    for param in params:
        if "ds_id" not in param.__dict__:
            param.ds_id = next(_IDS)  # type: ignore[attr-defined]


def mark_pending(param: nn.Parameter) -> None:
    """A parameter `zero_init` builds on the meta device: partitioned in DeepSpeed's terms from construction, its
    part not known until `initialize` ([Note: GatheredParameters before initialize] in pending.py)."""
    number([param])
    _describe(param, torch.empty(0, dtype=param.dtype), persistent=False)
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE  # type: ignore[attr-defined]


def rank_parts(
    layout: UnitLayout, slots: Sequence[Slot], shard: torch.Tensor, shard_rank: int, resident: bool
) -> list[torch.Tensor]:
    """This rank's part of each slot's parameter: a view of `shard` (a parameter lies in one section, so its part
    is one range), or an empty tensor where the rank holds none of it, the part is held quantized (past the
    shard's end: [Note: quantized frozen weights]), or the shard is not `resident` (its home is NVMe)."""
    empty = shard.new_empty(0)
    parts = []
    for slot in slots:
        owned = layout.owned_parts(shard_rank, slot.offset, slot.offset + slot.numel) if resident else []
        begin, end, at = owned[0] if owned else (0, 0, 0)
        parts.append(shard.narrow(0, at, end - begin) if owned and at + end - begin <= shard.numel() else empty)
    return parts


def show(params: Sequence[nn.Parameter], tensors: Sequence[torch.Tensor], status: ZeroParamStatus) -> None:
    """Point each parameter's `.data` at its tensor (a view of the gathered buffer, or an empty placeholder) and
    set its `ds_status` to match."""
    for param, tensor in zip(params, tensors, strict=True):
        param.data = tensor
        param.ds_status = status  # type: ignore[attr-defined]


def set_status(params: Sequence[nn.Parameter], status: ZeroParamStatus) -> None:
    for param in params:
        param.ds_status = status  # type: ignore[attr-defined]


def unmark(params: Sequence[nn.Parameter]) -> None:
    """Remove the attributes (the parameters are whole again and no longer partitioned by anyone)."""
    for param in params:
        for name in ATTRIBUTES:
            param.__dict__.pop(name, None)
