"""`zeroshard.GatheredParameters`: DeepSpeed's context for reading or changing sharded parameters.

[Note: parameter registry]
DeepSpeed's API passes only parameters, no engine, so the owners of sharded parameters must be found
from the parameters alone. Rather than bolting attributes onto `nn.Parameter`, each stage-3 strategy
registers its parameters in `OWNERS` (weak references both ways, removed on destroy). It is the one
piece of process-wide state in zeroshard, and it holds nothing alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from zeroshard.zero.stage3.strategy import Stage3Strategy


class _Owners:
    def __init__(self) -> None:
        self._by_param: dict[int, tuple[weakref.ref[nn.Parameter], weakref.ref[Stage3Strategy]]] = {}

    def register(self, strategy: Stage3Strategy, params: Iterable[nn.Parameter]) -> None:
        ref = weakref.ref(strategy)
        for p in params:
            self._by_param[id(p)] = (weakref.ref(p), ref)

    def unregister(self, params: Iterable[nn.Parameter]) -> None:
        for p in params:
            self._by_param.pop(id(p), None)

    def strategy_of(self, param: torch.Tensor) -> Stage3Strategy | None:
        entry = self._by_param.get(id(param))
        if entry is None or entry[0]() is not param:
            return None
        return entry[1]()


OWNERS = _Owners()


class GatheredParameters:
    """Gather sharded (stage 3) parameters for the duration of the block; a no-op for others.

    With `modifier_rank=r`, changes made on rank r inside the block are broadcast to every rank and
    written into the shards at exit. Every rank must enter the block (it runs collectives).

    Example:
        >>> with zeroshard.GatheredParameters(model.lm_head.weight, modifier_rank=0):  # doctest: +SKIP
        ...     if rank == 0:
        ...         model.lm_head.weight.zero_()
    """

    def __init__(
        self, params: nn.Parameter | Iterable[nn.Parameter], modifier_rank: int | None = None, enabled: bool = True
    ):
        self.params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._plan: list[tuple[Stage3Strategy, list[Any]]] = []

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        by_strategy: dict[int, tuple[Stage3Strategy, list[torch.Tensor]]] = {}
        for p in self.params:
            strategy = OWNERS.strategy_of(p)
            if strategy is not None:
                by_strategy.setdefault(id(strategy), (strategy, []))[1].append(p)
        for strategy, params in by_strategy.values():
            units = strategy.units_of(params)
            strategy.schedule.pin(units)
            self._plan.append((strategy, units))
        return self

    def __exit__(self, *exc: object) -> None:
        for strategy, units in self._plan:
            if self.modifier_rank is not None and exc[0] is None:
                with torch.no_grad():
                    for unit in units:
                        strategy.comm.broadcast(unit.full.data, src=self.modifier_rank)
                        strategy.write_back(unit)
            strategy.schedule.unpin(units)
        self._plan.clear()
