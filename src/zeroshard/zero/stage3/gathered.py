"""`zeroshard.GatheredParameters`: DeepSpeed's context for reading or changing sharded parameters.

Parameters are found through `zero.owners.OWNERS` ([Note: parameter registry]); stages 0-2 keep whole
parameters, so their strategies gather nothing (`Strategy.gather_begin` returns nothing to hold). Parameters
`zero_init` built, before `initialize`, get values for the block ([Note: GatheredParameters before initialize] in
pending.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zeroshard.zero.owners import OWNERS
from zeroshard.zero.stage3.pending import Pending, begin, end

if TYPE_CHECKING:
    from zeroshard.zero.strategy import Strategy


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
        self,
        params: nn.Parameter | Iterable[nn.Parameter],
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ):
        """`fwd_module`: DeepSpeed's hint that the module's forward uses `params` (its `register_external_parameter`,
        for the stage-3 parameters; PEFT passes it, often None): a no-op for a module that owns them, refused for one
        that does not ([Note: units] in zero/stage3/plan.py gather a parameter with the modules that own it)."""
        self.params = [params] if isinstance(params, torch.Tensor) else list(params)
        if fwd_module is not None and enabled:
            from zeroshard.zero.deepspeed_api import register_external_parameter

            owned = {id(p) for p in fwd_module.parameters()}  # (one pass: the check per parameter is a scan)
            for p in self.params:
                if isinstance(p, nn.Parameter) and hasattr(p, "ds_id") and id(p) not in owned:
                    register_external_parameter(fwd_module, p)  # one it does not own: refused, naming the ways
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._plan: list[tuple[Strategy, list[Any]]] = []
        self._pending: Pending | None = None  # zero_init's parameters before initialize, given values for the block

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        by_strategy: dict[int, tuple[Strategy, list[torch.Tensor]]] = {}
        unowned: list[nn.Parameter] = []
        for p in self.params:
            strategy = OWNERS.strategy_of(p)
            if strategy is not None:
                by_strategy.setdefault(id(strategy), (strategy, []))[1].append(p)
            elif isinstance(p, nn.Parameter):  # zero_init's before initialize: [Note: GatheredParameters before
                unowned.append(p)  # initialize]; a model built whole needs nothing
        try:
            self._pending = begin(unowned, self.modifier_rank) if unowned else None
            for strategy, params in by_strategy.values():
                if self.modifier_rank is not None:  # the block's changes go into the masters
                    strategy.refuse_offloaded("GatheredParameters(modifier_rank=...)")
                self._plan.append((strategy, strategy.gather_begin(params, modifier_rank=self.modifier_rank)))
        except BaseException:
            self._release(None)  # one engine refused (its agreement): what the others hold goes back
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        modifier_rank = self.modifier_rank if exc[0] is None else None
        if modifier_rank is not None and self._plan:
            from zeroshard.checkpoint.decoupled import wait_for_writes

            wait_for_writes()  # the shards change: a decoupled save's thread must have written them
        self._release(modifier_rank)

    def _release(self, modifier_rank: int | None) -> None:
        """Every engine's units go back to their shards, after `modifier_rank`'s broadcast; once one engine raised
        (its broadcast's agreement), the rest are released without broadcasting and the first error is raised."""
        plan, self._plan = self._plan, []
        pending, self._pending = self._pending, None
        failed: BaseException | None = None
        for strategy, held in plan:
            try:
                strategy.gather_end(held, modifier_rank if failed is None else None)
            except BaseException as err:
                failed = failed or err
        if pending is not None:
            end(pending, modifier_rank if failed is None else None)
        if failed is not None:
            raise failed
