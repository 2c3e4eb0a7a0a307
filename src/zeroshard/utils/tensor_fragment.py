"""`deepspeed.utils.safe_get_full_fp32_param`, `safe_get_full_grad`, `safe_get_full_optimizer_state`.

DeepSpeed finds a parameter's optimizer from the `ds_*` attributes it bolts onto every `nn.Parameter`; we find
the strategy that holds it in the registry every strategy fills ([Note: parameter registry]), at every stage.
As in DeepSpeed these are collectives at stages 1-3 (the shards are all-gathered): every rank must call them,
for the same parameters in the same order. They return new fp32 tensors on the compute device.

Where zeroshard differs: at fp32 stage 0 DeepSpeed has no fp32 copy and returns None from
`safe_get_full_fp32_param` / `safe_get_full_optimizer_state`; we return the master value and the state, as at
the other stages. `safe_set_full_fp32_param` also updates the parameter the next forward uses (DeepSpeed
updates its low-precision copy at the next step). The `safe_*_local_*` calls read and write one rank's part of a
stage-3 parameter ([Note: local values]). The gradient setters write where the step reads ([Note: setting a
gradient] in offload/gradients.py), in `safe_get_full_grad`'s terms: averaged and unscaled (DeepSpeed's are its
partitions' own terms, the loss scale included with fp16).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from zeroshard.errors import ZeroshardError
from zeroshard.zero.owners import OWNERS


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The whole fp32 master value of `param`; None for a parameter no engine trains (collective).

    Example:
        >>> full = safe_get_full_fp32_param(model.fc.weight)  # doctest: +SKIP
    """
    strategy = OWNERS.strategy_of(param)
    if strategy is not None:
        _usable(strategy, "safe_get_full_fp32_param")
    return None if strategy is None else strategy.full_fp32_param(param)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole gradient of `param`, averaged over ranks and unscaled, before clipping (collective). Read it
    between the backward of the accumulation boundary and `engine.step()` (the step consumes it); a parameter no
    engine trains returns its `.grad`, as in DeepSpeed.

    Example:
        >>> engine.backward(loss)  # doctest: +SKIP
        >>> grad = safe_get_full_grad(model.fc.weight)  # doctest: +SKIP
        >>> engine.step()  # doctest: +SKIP
    """
    strategy = OWNERS.strategy_of(param)
    if strategy is not None:
        _usable(strategy, "safe_get_full_grad")
    return param.grad if strategy is None else strategy.full_grad(param)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The whole fp32 optimizer state `optim_state_key` (e.g. "exp_avg", "exp_avg_sq") of `param`; None before
    the first step made it, or for a parameter no engine trains (collective)."""
    strategy = OWNERS.strategy_of(param)
    if strategy is not None:
        _usable(strategy, "safe_get_full_optimizer_state")
    return None if strategy is None else strategy.full_optimizer_state(param, optim_state_key)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """`param` := `value`, its whole new value (the same on every rank; collective at stage 3): the fp32 master,
    and the parameter the next forward uses. Nothing for a parameter no engine trains, as in DeepSpeed."""
    strategy = OWNERS.strategy_of(param)
    if strategy is not None:
        _usable(strategy, "safe_set_full_fp32_param")
        _wait_for_writes()
        strategy.set_full_fp32_param(param, value)


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """`param`'s optimizer state `optim_state_key` := `value` (whole, the same on every rank). A KeyError names
    the key before the optimizer created it (its first step)."""
    strategy = OWNERS.strategy_of(param)
    if strategy is not None:
        _usable(strategy, "safe_set_full_optimizer_state")
        _wait_for_writes()
        strategy.set_full_optimizer_state(param, value, optim_state_key)


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """`param`'s gradient := `value`, whole and the same on every rank, in `safe_get_full_grad`'s terms (averaged
    over ranks, unscaled); the step applies it, clipping and the inf/nan check included. Between the boundary's
    backward and `engine.step()`; a parameter no engine trains gets it in its `.grad`, as in DeepSpeed.

    Example:
        >>> grad = safe_get_full_grad(model.embed.weight)  # doctest: +SKIP
        >>> grad[:old_vocab] = 0  # train only the new tokens' rows  # doctest: +SKIP
        >>> safe_set_full_grad(model.embed.weight, grad)  # doctest: +SKIP
    """
    strategy = OWNERS.strategy_of(param)
    if strategy is None:
        if param.grad is not None:
            param.grad.copy_(value)
        return
    _usable(strategy, "safe_set_full_grad")
    strategy.set_full_grad(param, value)


def safe_update_full_grad_vectorized(param_list: Sequence[torch.Tensor], update_func: Callable[..., Any]) -> None:
    """Each parameter's gradient := `update_func(its full gradient, param)`, as `safe_get_full_grad` then
    `safe_set_full_grad` (collective at stages 1-3: every rank, the same parameters in the same order)."""
    for param in param_list:
        strategy = OWNERS.strategy_of(param)
        if strategy is None:
            if param.grad is not None:
                param.grad.copy_(update_func(param.grad, param))
            continue
        grad = safe_get_full_grad(param) if param.requires_grad else None
        if grad is not None:  # (None: fsdp2 with no gradient on any rank)
            safe_set_full_grad(param, update_func(grad, param))


# -- one rank's part of a stage-3 parameter ([Note: local values] in zero/stage3/param_values.py) -------------------
def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of a ZeRO-3 parameter's fp32 master, 1-D on the compute device (empty where the rank holds
    none of it; None for a frozen parameter, as in DeepSpeed); no collective.

    Example:
        >>> mine = safe_get_local_fp32_param(model.fc.weight)  # doctest: +SKIP
    """
    return _local(param, "safe_get_local_fp32_param").local_fp32_param(param)


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of a ZeRO-3 parameter's reduced gradient, fp32 and unscaled (between the boundary's backward
    and `step()`, as `safe_get_full_grad`); None for a frozen parameter."""
    return _local(param, "safe_get_local_grad").local_grad(param)


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """This rank's part of a ZeRO-3 parameter's optimizer state `optim_state_key`, fp32; None before the first
    step made it, or for a frozen parameter."""
    return _local(param, "safe_get_local_optimizer_state").local_optimizer_state(param, optim_state_key)


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """This rank's part of a ZeRO-3 parameter's fp32 master := `value` (the getter's length); the compute values
    follow at the next step, as DeepSpeed's."""
    _wait_for_writes()
    _local(param, "safe_set_local_fp32_param").set_local_fp32_param(param, value)


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """This rank's part of a ZeRO-3 parameter's reduced gradient := `value` (the getter's length), in
    `safe_get_local_grad`'s terms (unscaled); nothing for a frozen parameter, as in DeepSpeed."""
    _local(param, "safe_set_local_grad").set_local_grad(param, value)


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    """This rank's part of a ZeRO-3 parameter's optimizer state `optim_state_key` := `value` (the getter's length)."""
    _wait_for_writes()
    _local(param, "safe_set_local_optimizer_state").set_local_optimizer_state(param, value, optim_state_key)


def _local(param: torch.Tensor, call: str) -> Any:
    """The stage-3 strategy holding `param` (DeepSpeed defines the local API for ZeRO-3 partitioned ones only)."""
    from zeroshard.zero.stage3.param_values import Stage3ParamValues

    strategy = OWNERS.strategy_of(param)
    if not isinstance(strategy, Stage3ParamValues):
        raise ZeroshardError(
            f"{call}: defined for ZeRO-3 partitioned parameters only, as in DeepSpeed (this one is "
            f"{'not trained by an engine' if strategy is None else 'whole on every rank or on the fsdp2 backend'}); "
            f"use safe_{'get' if 'get' in call else 'set'}_full_{call.split('_local_')[1]}"
        )
    _usable(strategy, call)
    return strategy


def _usable(strategy: Any, call: str) -> None:
    """Neither held elsewhere by `offload_states()` nor torn by a failed load ([Note: a torn load])."""
    from zeroshard.checkpoint.torn import refuse_torn_state  # zeroshard.utils is imported before checkpoint

    strategy.refuse_offloaded(call)
    refuse_torn_state(strategy, call)


def _wait_for_writes() -> None:
    """A decoupled save's thread must have written the old values first ([Note: decoupled checkpoint writes])."""
    from zeroshard.checkpoint.decoupled import wait_for_writes  # zeroshard.utils is imported before checkpoint

    wait_for_writes()
