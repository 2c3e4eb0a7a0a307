"""Which strategy owns a parameter, for the APIs DeepSpeed gives only a parameter (no engine).

[Note: parameter registry]
DeepSpeed's `GatheredParameters` and `safe_get_full_fp32_param` and friends receive parameters alone, so the
strategy holding a parameter's shards must be found from the parameter. Rather than bolting attributes onto
`nn.Parameter`, every strategy (stages 0-3) registers its trainable parameters in `OWNERS` (weak references
both ways, removed on destroy). It is the one piece of process-wide state in zeroshard, and it holds nothing
alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from zeroshard.zero.strategy import Strategy


class _Owners:
    def __init__(self) -> None:
        self._by_param: dict[int, tuple[weakref.ref[nn.Parameter], weakref.ref[Strategy]]] = {}

    def register(self, strategy: Strategy, params: Iterable[nn.Parameter]) -> None:
        ref = weakref.ref(strategy)
        for p in params:
            self._by_param[id(p)] = (weakref.ref(p), ref)

    def unregister(self, params: Iterable[nn.Parameter]) -> None:
        for p in params:
            self._by_param.pop(id(p), None)

    def strategy_of(self, param: torch.Tensor) -> Strategy | None:
        entry = self._by_param.get(id(param))
        if entry is None or entry[0]() is not param:
            return None
        return entry[1]()


OWNERS = _Owners()
