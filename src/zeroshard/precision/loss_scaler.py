"""fp16 loss scaling with DeepSpeed's semantics (`fp16.loss_scale`, `initial_scale_power`, `hysteresis`, ...).

`fp16.loss_scale > 0` gives a StaticLossScaler; `0` a DynamicLossScaler.

[Note: dynamic loss scale update] One `update_scale(overflow)` call per optimizer step, at iteration
t = 0, 1, ...:

* overflow: if the hysteresis counter is exhausted (it is 1, or `hysteresis` is 1) the scale is divided by
  `scale_factor`, but not below `min_loss_scale`; otherwise the counter drops by one and the scale stays.
  Either way t becomes the last overflow iteration. An overflow while the scale already equals
  `min_loss_scale` with the counter exhausted cannot be absorbed and raises LossScaleError.
* clean step: with `consecutive_hysteresis` the counter is refilled. Let s = t - last_overflow - 1 (the
  last overflow is -1 before the first). When s > 0 and s % `loss_scale_window` == 0 the scale is multiplied
  by `scale_factor` (and, without consecutive_hysteresis, the counter is refilled). So the first raise comes
  on the (window + 1)-th consecutive clean step after an overflow (or from the start), later raises every
  `window` clean steps: DeepSpeed's off-by-one, kept so that runs match step for step.

That is DeepSpeed's ZeRO optimizers' scaler (stages 1-3). At stage 0 DeepSpeed's fp16 optimizers (FP16_Optimizer,
FP16_UnfusedOptimizer: `_update_scale`) keep a rule of their own, which `Fp16OptimizerLossScaler` follows: every
overflow divides the scale (no hysteresis: `fp16.hysteresis` and `consecutive_hysteresis` are not read), floored at
`min_loss_scale`, where further overflows are skipped steps and no error; clean steps raise it as above. Measured
against DeepSpeed's own `test_dynamic_loss_scale.py` sequences (all steps overflowing, window 2: 8, 4, 2, 1, 1, ...).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from zeroshard.errors import ConfigError, LossScaleError, ZeroshardError
from zeroshard.utils.logging import get_logger, log_rank

_LOGGER_NAME = "zeroshard.precision"


class StaticLossScaler:
    """A fixed loss scale (`fp16.loss_scale > 0`): overflowing steps are skipped, the scale never changes.

    Example:
        >>> scaler = StaticLossScaler(128.0)
        >>> scaler.update_scale(True)
        >>> scaler.loss_scale
        128.0
    """

    dynamic: ClassVar[bool] = False

    def __init__(self, scale: float) -> None:
        if not scale > 0:
            raise ConfigError(f"fp16.loss_scale must be > 0 for a static loss scale, got {scale!r}")
        self._scale = float(scale)
        self._iteration = 0

    @property
    def loss_scale(self) -> float:
        """The factor the loss is multiplied by before backward (settable, as DeepSpeed's `cur_scale`)."""
        return self._scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self._scale = _set_scale(value)

    @property
    def iteration(self) -> int:
        """Optimizer steps recorded so far (DeepSpeed's `cur_iter`)."""
        return self._iteration

    def update_scale(self, overflow: bool) -> None:
        """Record one step's overflow status; a static scale only logs the skipped step."""
        self._iteration += 1
        if overflow:
            log_rank(
                get_logger(_LOGGER_NAME),
                logging.WARNING,
                f"OVERFLOW with static loss scale {self._scale:g}: step skipped, weights not updated.",
            )

    def state_dict(self) -> dict[str, Any]:
        """The scale, for checkpoints."""
        return {"cur_scale": self._scale, "cur_iter": self._iteration}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scale saved by state_dict()."""
        self._scale = float(state_dict["cur_scale"])
        self._iteration = int(state_dict.get("cur_iter", 0))


class DynamicLossScaler:
    """A loss scale that halves on overflow (after `delayed_shift` overflows) and doubles when stable.

    See [Note: dynamic loss scale update] for the exact rule (DeepSpeed's DynamicLossScaler.update_scale).

    Example:
        >>> scaler = DynamicLossScaler(init_scale=2.0**16, scale_window=2, min_scale=1.0, delayed_shift=1,
        ...                            consecutive_hysteresis=False)
        >>> scaler.update_scale(True)
        >>> scaler.loss_scale
        32768.0
        >>> for _ in range(3):
        ...     scaler.update_scale(False)
        >>> scaler.loss_scale
        65536.0
    """

    dynamic: ClassVar[bool] = True

    def __init__(
        self,
        init_scale: float,
        scale_window: int,
        min_scale: float,
        delayed_shift: int,
        consecutive_hysteresis: bool,
        scale_factor: float = 2.0,
    ) -> None:
        _check_dynamic_args(init_scale, scale_window, min_scale, delayed_shift, scale_factor)
        self.scale_window = scale_window
        self.min_scale = float(min_scale)
        self.delayed_shift = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.scale_factor = float(scale_factor)
        self._scale = float(init_scale)
        self._iteration = 0
        self._last_overflow_iteration = -1
        self._hysteresis = delayed_shift
        self._consecutive_overflows = 0
        self._overflows_since_growth = 0

    @property
    def loss_scale(self) -> float:
        """The factor the loss is multiplied by before backward (settable, as DeepSpeed's `cur_scale`)."""
        return self._scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self._scale = _set_scale(value)

    @property
    def iteration(self) -> int:
        """Optimizer steps recorded so far (DeepSpeed's `cur_iter`)."""
        return self._iteration

    @property
    def last_overflow_iteration(self) -> int:
        """The step of the latest overflow, -1 before the first (DeepSpeed's `last_overflow_iter`)."""
        return self._last_overflow_iteration

    @property
    def hysteresis_left(self) -> int:
        """Overflows still absorbed before the scale is lowered (1: the next overflow lowers it)."""
        return self._hysteresis

    def update_scale(self, overflow: bool) -> None:
        """Record one step's overflow status and adjust the scale; raises LossScaleError when stuck."""
        if overflow:
            self._on_overflow()
        else:
            self._on_clean_step()
        self._iteration += 1

    def _on_overflow(self) -> None:
        exhausted = self.delayed_shift == 1 or self._hysteresis <= 1
        if exhausted and self._scale == self.min_scale:
            raise LossScaleError(self._stuck_message())
        self._consecutive_overflows += 1
        self._overflows_since_growth += 1
        if exhausted:
            lowered = max(self._scale / self.scale_factor, self.min_scale)
            self._log(f"OVERFLOW! Skipping step. Attempted loss scale: {self._scale:g}, reducing to {lowered:g}")
            self._scale = lowered
        else:
            self._log(
                f"OVERFLOW! Skipping step. Attempted loss scale: {self._scale:g}, but hysteresis is "
                f"{self._hysteresis}. Reducing hysteresis to {self._hysteresis - 1}"
            )
            self._hysteresis -= 1
        self._last_overflow_iteration = self._iteration

    def _on_clean_step(self) -> None:
        self._consecutive_overflows = 0
        if self.consecutive_hysteresis:
            self._hysteresis = self.delayed_shift
        stable = self._iteration - self._last_overflow_iteration - 1
        if stable > 0 and stable % self.scale_window == 0:
            if not self.consecutive_hysteresis:
                self._hysteresis = self.delayed_shift
            self._scale *= self.scale_factor
            self._overflows_since_growth = 0

    def _stuck_message(self) -> str:
        return (
            f"fp16 dynamic loss scale is stuck at min_loss_scale={self.min_scale:g} after "
            f"{self._consecutive_overflows + 1} consecutive overflows "
            f"({self._overflows_since_growth + 1} since the scale last grew): the gradients are inf/nan even "
            "at the smallest allowed scale. Train in "
            'bf16 instead ("bf16": {"enabled": true}), lower the learning rate, or check the data and the '
            "loss for inf/nan."
        )

    def _log(self, message: str) -> None:
        log_rank(get_logger(_LOGGER_NAME), logging.INFO, message)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the exact scale sequence after a restart."""
        return {
            "cur_scale": self._scale,
            "cur_iter": self._iteration,
            "last_overflow_iter": self._last_overflow_iteration,
            "cur_hysteresis": self._hysteresis,
            "consecutive_overflows": self._consecutive_overflows,
            "overflows_since_growth": self._overflows_since_growth,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state saved by state_dict(); the configured window, minimum and factor are kept. A static
        scaler's state (a checkpoint saved with `fp16.loss_scale > 0`) gives the scale and step count, the rest
        starts fresh."""
        self._scale = float(state_dict["cur_scale"])
        self._iteration = int(state_dict.get("cur_iter", 0))
        self._last_overflow_iteration = int(state_dict.get("last_overflow_iter", -1))
        self._hysteresis = int(state_dict.get("cur_hysteresis", self.delayed_shift))
        self._consecutive_overflows = int(state_dict.get("consecutive_overflows", 0))
        self._overflows_since_growth = int(state_dict.get("overflows_since_growth", 0))


class Fp16OptimizerLossScaler(DynamicLossScaler):
    """DeepSpeed's stage-0 dynamic scale ([Note: dynamic loss scale update]): every overflow halves the scale down to
    `min_loss_scale`, where overflows are skipped steps and no error; no hysteresis.

    Example:
        >>> scaler = Fp16OptimizerLossScaler(init_scale=8.0, scale_window=2, min_scale=1.0)
        >>> for _ in range(5):
        ...     scaler.update_scale(True)
        >>> scaler.loss_scale
        1.0
    """

    def __init__(self, init_scale: float, scale_window: int, min_scale: float, scale_factor: float = 2.0) -> None:
        super().__init__(init_scale, scale_window, min_scale, 1, False, scale_factor)

    def _on_overflow(self) -> None:
        lowered = max(self._scale / self.scale_factor, self.min_scale)
        if lowered < self._scale:
            self._log(f"OVERFLOW! Skipping step. Attempted loss scale: {self._scale:g}, reducing to {lowered:g}")
        else:
            self._log(f"OVERFLOW! Skipping step. The loss scale stays at min_loss_scale {lowered:g}")
        self._scale = lowered
        self._consecutive_overflows += 1
        self._overflows_since_growth += 1
        self._last_overflow_iteration = self._iteration


LossScaler = StaticLossScaler | DynamicLossScaler


def _set_scale(value: float) -> float:
    scale = float(value)
    if not math.isfinite(scale) or scale <= 0:
        raise ZeroshardError(f"loss scale {value!r}: set a finite scale > 0")
    return scale


def build_loss_scaler(
    *,
    loss_scale: float,
    initial_scale_power: int,
    loss_scale_window: int,
    hysteresis: int,
    consecutive_hysteresis: bool,
    min_loss_scale: float,
    zero_stage: int = 1,
) -> LossScaler:
    """The scaler for a ds_config `fp16` block: static when `loss_scale > 0`, dynamic when it is 0 (at `zero_stage` 0
    DeepSpeed's fp16 optimizers' rule: [Note: dynamic loss scale update]).

    Example:
        >>> scaler = build_loss_scaler(loss_scale=0, initial_scale_power=16, loss_scale_window=1000,
        ...                            hysteresis=2, consecutive_hysteresis=False, min_loss_scale=1)
        >>> scaler.dynamic, scaler.loss_scale
        (True, 65536.0)
    """
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, int | float) or loss_scale < 0:
        raise ConfigError(f"fp16.loss_scale must be 0 (dynamic) or a positive number, got {loss_scale!r}")
    if loss_scale > 0:
        return StaticLossScaler(float(loss_scale))
    if isinstance(initial_scale_power, bool) or not isinstance(initial_scale_power, int):
        raise ConfigError(f"fp16.initial_scale_power must be an integer, got {initial_scale_power!r}")
    if not isinstance(consecutive_hysteresis, bool):
        raise ConfigError(f"fp16.consecutive_hysteresis must be true or false, got {consecutive_hysteresis!r}")
    if zero_stage == 0:
        _check_dynamic_args(2.0**initial_scale_power, loss_scale_window, min_loss_scale, hysteresis, 2.0)
        return Fp16OptimizerLossScaler(2.0**initial_scale_power, loss_scale_window, min_loss_scale)
    return DynamicLossScaler(
        init_scale=2.0**initial_scale_power,
        scale_window=loss_scale_window,
        min_scale=min_loss_scale,
        delayed_shift=hysteresis,
        consecutive_hysteresis=consecutive_hysteresis,
    )


def _check_dynamic_args(
    init_scale: float, scale_window: int, min_scale: float, delayed_shift: int, scale_factor: float
) -> None:
    """ConfigError naming the fp16 key behind the first invalid dynamic-scaler argument."""
    if not _is_int(scale_window) or scale_window < 1:
        raise ConfigError(f"fp16.loss_scale_window must be an integer >= 1, got {scale_window!r}")
    if not _is_int(delayed_shift) or delayed_shift < 1:
        raise ConfigError(f"fp16.hysteresis must be an integer >= 1, got {delayed_shift!r}")
    if not _is_number(min_scale) or min_scale <= 0:
        raise ConfigError(f"fp16.min_loss_scale must be > 0, got {min_scale!r}")
    if not _is_number(init_scale) or init_scale <= 0:
        raise ConfigError(f"fp16.initial_scale_power gives an invalid initial scale {init_scale!r}")
    if not _is_number(scale_factor) or scale_factor <= 1:
        raise ConfigError(f"the loss scale factor must be > 1, got {scale_factor!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def has_inf_or_nan(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether any element of any tensor is inf or nan, with one host sync per device.

    One multi-tensor infinity-norm (max |x|, which propagates nan) per device and dtype, then a single
    isfinite reduction over the stacked norms; never a per-tensor `.item()` loop. Empty and non-floating
    tensors are skipped.

    Example:
        >>> import torch
        >>> has_inf_or_nan([torch.ones(3), torch.tensor([1.0, float("nan")])])
        True
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.numel() and (tensor.is_floating_point() or tensor.is_complex()):
            by_device.setdefault(tensor.device, []).append(tensor)
    for device_tensors in by_device.values():
        norms = torch._foreach_norm(device_tensors, ord=float("inf"))
        maxima = torch.stack([norm.float() for norm in norms])
        if not bool(torch.isfinite(maxima).all()):
            return True
    return False


__all__ = [
    "DynamicLossScaler",
    "Fp16OptimizerLossScaler",
    "LossScaler",
    "StaticLossScaler",
    "build_loss_scaler",
    "has_inf_or_nan",
]
