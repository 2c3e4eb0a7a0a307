"""The root unit, gathered by the modules that use it rather than for the root's whole forward and backward.

[Note: root unit by module]
The root unit holds the parameters no block owns: embeddings, position table, final norm, head (a tied
embedding/head weight is one parameter: one shard, one gradient). Gathered from the root's pre-forward to its
post-forward and again from the loss to the end of backward, it sat beside every block, and with a large
vocabulary it is the largest unit. Instead its *entries*, the modules outside the blocks that own one of its
parameters directly (`plan.root_entries`: wte, wpe, ln_f and lm_head of a GPT), gather it in their pre-forward
and release it after their forward as a block does (or keep it, [Note: live parameter limit]); in backward an
entry's outputs' gradient gathers it and it is released once the last entry's backward has run.
An nn.Embedding entry's backward reads the indices, not the weight: it asks for no gather in backward
(a *grad-only* entry). Its gradient comes last (autograd sums a tied weight's uses into one `.grad`, once per
backward, after the embedding's backward), so a unit with such an entry is released at its last entry's
backward but reduced when backward ends, as before. The unit's layout is unchanged (one shard, one
reduce-scatter, one norm term), so the numerics are the same. Entries nested in one another act at the outermost.

A model may read a root parameter outside its entries: `F.linear(x, self.wte.weight)` in the root's forward,
an embedding matrix handed to a block. The first forward is therefore a probe: the unit stays gathered for the
root's whole forward, as before, while a TorchFunctionMode watches the calls that touch its parameters. One made
while no entry runs (metadata reads aside, which a released parameter's placeholder answers alike: dtype,
device, ...) keeps the root *whole* from then on (gathered by the root's forward, released when backward ends);
otherwise the probe's own backward is already split. A read outside the entries on a later, different path only
finds the empty placeholder and fails loudly (a shape error), never silently; `"zeroshard":
{"stage3_root_by_module": false}` keeps the root whole from the start for such a model.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from zeroshard.utils.logging import get_logger
from zeroshard.zero.stage3.hooks import route_inputs_through_post_backward
from zeroshard.zero.stage3.plan import LeafModules, UnitPolicy, root_entries

if TYPE_CHECKING:
    from zeroshard.zero.stage3.strategy import Stage3Strategy
    from zeroshard.zero.stage3.unit import ShardedUnit

logger = get_logger(__name__)

# what a released parameter's placeholder answers as the gathered parameter would (same dtype, device, flags)
_METADATA = frozenset(
    {"dtype", "device", "requires_grad", "is_leaf", "layout", "is_cuda", "is_meta", "is_sparse", "is_quantized"}
    | {"grad", "grad_fn", "is_floating_point", "is_complex", "element_size", "get_device", "__set__"}
)


class RootScope(Enum):
    PROBING = auto()  # the first forward: gathered for the whole forward while uses are watched
    SPLIT = auto()  # gathered by its entries
    WHOLE = auto()  # a parameter was read outside its entries: gathered for the root's forward and backward


def grad_only(module: nn.Module) -> bool:
    """An nn.Embedding (or a subclass keeping its forward): backward needs the indices, not the weight."""
    return isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward


class _OutsideUse(TorchFunctionMode):
    """Names the first call that touches one of `params` while `running()` is False."""

    def __init__(self, params: list[nn.Parameter], running: Callable[[], bool]):
        super().__init__()
        self.ids = {id(p) for p in params}
        self.running = running
        self.seen: str | None = None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.seen is None and not self.running():
            name = getattr(func, "__name__", str(func))
            if name in ("__get__", "__set__"):  # a property: named by its descriptor
                name = getattr(getattr(func, "__self__", None), "__name__", name)
            if name not in _METADATA:
                flat, _ = tree_flatten((args, kwargs))
                if any(isinstance(t, torch.Tensor) and id(t) in self.ids for t in flat):
                    self.seen = name
        return func(*args, **kwargs)


class RootUnit:
    """[Note: root unit by module] the root unit's scope and the events of the root and of its entries."""

    def __init__(self, strategy: Stage3Strategy, unit: ShardedUnit, entries: list[nn.Module]):
        self.strategy = strategy
        self.unit = unit
        self.entries = entries
        self.grad_only = {id(m) for m in entries if grad_only(m)}
        self.scope = RootScope.PROBING
        self.outside_use: str | None = None  # the call that kept the root whole
        self._depth = 0  # entries running (nested ones count)
        self._probe: _OutsideUse | None = None
        self._root_running = False  # whole: the root's forward holds the unit
        self._outside = False  # whole: an entry gathered it outside the root's forward (below)

    # -- the root module -------------------------------------------------------------------------------
    def root_pre_forward(self, args: Any, kwargs: Any) -> Any:
        self._depth = 0  # an entry whose forward raised never ran its post-forward
        if self.scope is RootScope.WHOLE:
            self._root_running = True
            self.strategy.on_pre_forward(self.unit)
            return route_inputs_through_post_backward(self._whole_post_backward, args, kwargs)
        if self.scope is RootScope.PROBING and self._probe is None:
            self.strategy.schedule.hold(self.unit)  # the entries record their uses and count their backward calls
            self._probe = _OutsideUse(self.unit.params, lambda: self._depth > 0)
            self._probe.__enter__()
        return None

    def root_post_forward(self, output: Any) -> None:
        if self.scope is RootScope.WHOLE:
            self._root_running = False
            self.strategy.on_post_forward(self.unit, output)
        elif self._probe is not None:
            seen = self._probe.seen
            self.end_probe()
            self.scope = RootScope.WHOLE if seen is not None else RootScope.SPLIT
            if seen is not None:
                self.outside_use = seen
                logger.info(
                    "stage 3: a root parameter is read outside its modules (%s): the root unit stays whole", seen
                )
            # whole: its backward gathers it from the loss on; split: its entries' backward does
            self.strategy.on_post_forward(self.unit, output, backward=None if seen is None else _always)

    def end_probe(self) -> None:
        """Leaves the probe's mode, also when the forward raised (an always-called hook)."""
        self._root_running = False
        if self._probe is not None:
            self._probe.__exit__(None, None, None)
            self._probe = None

    # -- the entries -----------------------------------------------------------------------------------
    def entry_pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        self._depth += 1
        if self._depth > 1:
            return None
        if self.scope is RootScope.WHOLE:
            # [Note: a whole root used without its forward] generation or evaluation that runs an inner module
            # (PeftModel.generate runs the base model's forward, a merged model is the base model): the root's
            # forward never runs to gather the unit, so its entries do, as split ones without a backward
            if not self._root_running and not torch.is_grad_enabled():
                self._outside = True
                self.strategy.on_pre_forward(self.unit, counted=False)
            return None
        needs_weights = id(module) not in self.grad_only
        self.strategy.on_pre_forward(self.unit, counted=needs_weights)
        return route_inputs_through_post_backward(self._post_backward, args, kwargs) if needs_weights else None

    def entry_post_forward(self, module: nn.Module, output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth > 0:
            return
        if self.scope is RootScope.WHOLE:
            if self._outside:  # [Note: a whole root used without its forward]
                self._outside = False
                self.strategy.on_post_forward(self.unit, output, backward=None, release=True)
            return
        backward = self._split if id(module) not in self.grad_only else None
        # probing, the root's forward holds the unit until its end
        self.strategy.on_post_forward(self.unit, output, backward=backward, release=self.scope is RootScope.SPLIT)

    def _split(self) -> bool:
        return self.scope is not RootScope.WHOLE

    def _post_backward(self) -> None:
        if self.scope is not RootScope.WHOLE:  # grad-only entries' gradients are still to come: reduced at the end
            self.strategy.on_post_backward(self.unit, reduce=not self.grad_only)

    def _whole_post_backward(self) -> None:
        self.strategy.on_post_backward(self.unit)


def _always() -> bool:
    return True


def root_unit_of(
    strategy: Stage3Strategy, module: nn.Module, policy: UnitPolicy | None, leaves: LeafModules
) -> RootUnit | None:
    """The root unit gathered by its entries, when its parameters have some ([Note: root unit by module])."""
    unit = next((u for u in strategy.units if u.name == "" and u.module is module), None)
    if unit is None:
        return None
    names = root_entries(module, policy, [slot.name for slot in unit.layout.slots], leaves)
    if not names:
        return None
    modules = dict(module.named_modules())
    return RootUnit(strategy, unit, [modules[name] for name in names])
