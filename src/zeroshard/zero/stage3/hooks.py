"""Every hook stage 3 puts on the user's module, registered in one place and removable.

Hook bodies only route the event to a named method of the strategy (or of the root unit, root.py):
- unit module pre-forward:  `on_pre_forward(unit)`; its tensor inputs pass through `_PostBackward`,
  an identity whose backward reports that the unit's backward has finished (`on_post_backward`);
- unit module post-forward: `on_post_forward(unit, output)` (registers the pre-backward hook on outputs);
- the root unit split by module ([Note: root unit by module]): the root's pre/post-forward and its entries'
  (`RootUnit`'s methods, which call the strategy's);
- parameter post-accumulate-grad: `on_grad(unit, index, param)`;
- pre-forward of a block without a unit (all its parameters persistent): `on_block_ran(index)`;
- root state_dict pre/post: gather everything / copy out full tensors and release.

[Note: hooks under torch.compile]
The module hooks run eagerly under `torch.compile` (`engine.compile()`, `module.compile()`): each is wrapped in
`torch.compiler.disable`, so dynamo breaks the graph at a unit's call, runs its gathering hooks as Python, and
compiles the unit's forward as a frame of its own. Traced, the hooks' collectives and storage swaps would be
captured (or fail) as graph operations. Tensor and gradient hooks run in the autograd engine, outside dynamo.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from zeroshard.zero.owners import weak_hook

if TYPE_CHECKING:
    from zeroshard.zero.stage3.root import RootUnit
    from zeroshard.zero.stage3.strategy import Stage3Strategy
    from zeroshard.zero.stage3.unit import ShardedUnit


class _PostBackward(torch.autograd.Function):
    """Identity in forward; in backward, calls `on_done` (a unit's backward has run)."""

    @staticmethod
    def forward(ctx: Any, on_done: Callable[[], None], *tensors: torch.Tensor) -> Any:
        ctx.on_done = on_done
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.on_done()
        return (None, *grads)


def route_inputs_through_post_backward(on_done: Callable[[], None], args: Any, kwargs: Any) -> Any:
    flat, _ = tree_flatten((args, kwargs))
    needs = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
    if not needs or not torch.is_grad_enabled():
        return None
    wrapped = _PostBackward.apply(on_done, *needs)
    wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
    replacement = {id(t): w for t, w in zip(needs, wrapped, strict=True)}
    return tree_map(lambda t: replacement.get(id(t), t) if isinstance(t, torch.Tensor) else t, (args, kwargs))


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """[Note: hooks under torch.compile]"""
    return torch.compiler.disable(hook, recursive=True)


class Stage3Hooks:
    def __init__(self, strategy: Stage3Strategy, root: nn.Module):
        self.strategy = strategy
        self.root = root
        self.handles: list[Any] = []

    def register(self) -> None:
        s = self.strategy
        self.handles.append(self.root.register_forward_pre_hook(_eager(lambda m, a: s.on_root_pre_forward())))
        for unit in s.units:
            if s.root_unit is not None and unit is s.root_unit.unit:
                self._register_root(s.root_unit)
            elif unit.module is not None:
                pre_forward = _eager(self._pre_forward(unit))
                self.handles.append(unit.module.register_forward_pre_hook(pre_forward, with_kwargs=True))
                self.handles.append(unit.module.register_forward_hook(_eager(self._post_forward(unit))))
            for index, param in enumerate(unit.params):
                if param.requires_grad:
                    self.handles.append(param.register_post_accumulate_grad_hook(self._on_grad(unit, index)))
        for index, block in s.parameterless_blocks:
            self.handles.append(block.register_forward_pre_hook(_eager(self._block_ran(index))))
        self.handles.append(
            self.root.register_state_dict_pre_hook(lambda m, prefix, keep_vars: s.on_state_dict_pre(keep_vars))
        )
        self.handles.append(self.root.register_state_dict_post_hook(lambda m, sd, prefix, meta: s.detach_state(sd)))

    def _register_root(self, root: RootUnit) -> None:
        """[Note: root unit by module]; the always-called hook leaves the probe also when the forward raised."""
        pre_forward = _eager(lambda m, a, k: root.root_pre_forward(a, k))
        self.handles.append(self.root.register_forward_pre_hook(pre_forward, with_kwargs=True))
        self.handles.append(self.root.register_forward_hook(_eager(lambda m, a, out: root.root_post_forward(out))))
        end_probe = _eager(lambda m, a, out: root.end_probe())
        self.handles.append(self.root.register_forward_hook(end_probe, always_call=True))
        for entry in root.entries:
            self.handles.append(entry.register_forward_pre_hook(_eager(root.entry_pre_forward), with_kwargs=True))
            entry_post = _eager(lambda m, a, out: root.entry_post_forward(m, out))
            self.handles.append(entry.register_forward_hook(entry_post))
        for index, param in enumerate(root.unit.params):
            if param.requires_grad:  # before autograd accumulates it; `on_grad` returns the placeholder
                self.handles.append(param.register_hook(self._grad_arriving(root.unit, index)))

    def _pre_forward(self, unit: ShardedUnit) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            self.strategy.on_pre_forward(unit)
            return route_inputs_through_post_backward(lambda: self.strategy.on_post_backward(unit), args, kwargs)

        return hook

    def _block_ran(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self.strategy.on_block_ran(index)

        return hook

    def _post_forward(self, unit: ShardedUnit) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.strategy.on_post_forward(unit, output)

        return hook

    # tensor hooks: [Note: tensor hooks hold their owner weakly], so they name the unit by its position
    def _grad_arriving(self, unit: ShardedUnit, index: int) -> Any:
        k = self.strategy.units.index(unit)
        return weak_hook(self.strategy, lambda strategy, grad: strategy.units[k].lend_shape(index))

    def _on_grad(self, unit: ShardedUnit, index: int) -> Any:
        k = self.strategy.units.index(unit)
        return weak_hook(self.strategy, lambda strategy, param: strategy.on_grad(strategy.units[k], index, param))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
