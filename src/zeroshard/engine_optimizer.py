"""`engine.optimizer`: the optimizer as DeepSpeed scripts reach it ([Note: the engine's optimizer]).

[Note: the engine's optimizer]
DeepSpeed's `engine.optimizer`, which `initialize` also returns second, is its ZeRO optimizer: a wrapper around the
torch optimizer (`.optimizer`) that owns the loss scale and the model states. Scripts reach through it. RL trainers
(OpenRLHF and others) call `engine.optimizer.offload_states(...)` and `reload_states()` around generation, and
training loops log `engine.optimizer.cur_scale` or read `overflow`. Here the engine owns those things, so
`ZeroOptimizer` is a view of the engine, not a second owner:
* `offload_states` and `reload_states` are the engine's calls, and so is `zero_grad`, with DeepSpeed's one quirk
  kept: at stage 2 its `zero_grad` inside an accumulation window leaves the window's reduced gradients alone
  (stages 1 and 3 drop them), so a ZeRO-2 script that zeroes before every micro-step still accumulates;
* `cur_scale`/`loss_scale` are the engine's loss scale, and writing them sets it (1.0, unscaled, without fp16);
* `overflow` says whether the latest optimizer step was skipped for inf/nan gradients;
* `param_groups`, `state` and `defaults` are the torch optimizer's own objects, so an lr written into a group is
  the one the next step reads, and `state_dict()`/`load_state_dict()` are the torch optimizer's (this rank's shards).
  While `offload_states` holds the optimizer state, `state` and those two refuse in one line: the state's device
  storages are empty then (DeepSpeed's point at host copies);
* `step()` is refused in one line: the engine's step also reduces, unscales, clips and steps the lr scheduler, and
  a script that stepped the optimizer directly would skip all of it.
The torch optimizer is `engine.basic_optimizer` (DeepSpeed's name) and the view's `.optimizer`; the engine steps that
one. The view is no `torch.optim.Optimizer`, as DeepSpeed's is none: torch's lr schedulers take the torch optimizer.
It holds the engine weakly, so it keeps no destroyed engine alive, and after `destroy()` its calls refuse.
At stage 0 in fp32 DeepSpeed wraps nothing, and its own tests assert that `initialize` returns the client optimizer
there: so does `engine_optimizer`. Elsewhere the view's class carries the name of the DeepSpeed optimizer the same
configuration gets, for scripts that test `isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3)` (imported from
DeepSpeed's module paths: `runtime/zero/stage3.py`, ...), as DeepSpeed 0.19.8 chooses it: `DeepSpeedZeroOptimizer`
at stages 1-2 (but `BF16_Optimizer` at stage 1 with bf16 weights, `data_types.grad_accum_dtype: fp32` and no CPU
offload), `DeepSpeedZeroOptimizer_Stage3` at stage 3 (either backend), and at stage 0 `FP16_Optimizer` over FusedAdam
(a config's Adam/AdamW) or `FP16_UnfusedOptimizer` over anything else, in fp16 and in bf16 alike (a pipeline's bf16:
`BF16_Optimizer`). Only the name is DeepSpeed's: the attributes are this view's.
"""

from __future__ import annotations

import sys
import weakref
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.errors import ZeroshardError
from zeroshard.offload.states import OPTIM_STATES
from zeroshard.optim.optimizers import DEEPSPEED_CLASS
from zeroshard.utils.logging import get_logger, log_rank

if TYPE_CHECKING:
    from zeroshard.engine import Engine

logger = get_logger(__name__)


def engine_optimizer(engine: Engine, optimizer: torch.optim.Optimizer | None) -> ScriptOptimizer:
    """What `engine.optimizer` is: [Note: the engine's optimizer]."""
    if optimizer is None:
        return None
    if engine.zero_stage == 0 and not (engine.fp16_enabled() or engine.bfloat16_enabled()):
        return optimizer
    return _named(engine, optimizer)(engine, optimizer)


class ZeroOptimizer:
    """What `engine.optimizer` and `initialize`'s second value are: [Note: the engine's optimizer].

    Example:
        >>> engine, optimizer, _, _ = zeroshard.initialize(model=model, config=cfg)  # doctest: +SKIP
        >>> optimizer.param_groups[0]["lr"], optimizer.cur_scale, optimizer.overflow  # doctest: +SKIP
        (0.001, 1.0, False)
        >>> optimizer.offload_states(); optimizer.reload_states()  # doctest: +SKIP
    """

    def __init__(self, engine: Engine, optimizer: torch.optim.Optimizer):
        self._engine = weakref.ref(engine)
        self.optimizer = optimizer

    def _live(self, what: str) -> Engine:
        engine = self._engine()
        if engine is None or engine.optimizer is not self:
            raise ZeroshardError(
                f"engine.optimizer.{what}: its engine was destroyed (or this is a copy of engine.optimizer, which is "
                "a view of its engine)"
            )
        return engine

    def _state_here(self, what: str) -> Engine:
        engine = self._live(what)
        if engine.strategy is not None:
            engine.strategy.refuse_away(f"engine.optimizer.{what}", (OPTIM_STATES,))  # [Note: offloaded states]
        return engine

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups  # DeepSpeed's setter (accelerate's wrapper forwards to it)

    @property
    def state(self) -> Any:
        self._state_here("state")
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self._state_here("state")
        self.optimizer.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        self._state_here("state_dict")
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        engine = self._state_here("load_state_dict")
        speculation = getattr(engine.strategy, "speculation", None)
        if speculation is not None:  # super_offload: the state it replaces already holds this window's step
            speculation.check_unchanged("engine.optimizer.load_state_dict")
        self.optimizer.load_state_dict(state_dict)

    @property
    def cur_scale(self) -> float:
        return self._live("cur_scale").loss_scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self._set_scale("cur_scale", value)

    @property
    def loss_scale(self) -> float:
        return self._live("loss_scale").loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self._set_scale("loss_scale", value)

    @property
    def dynamic_loss_scale(self) -> bool:
        scaler = self._live("dynamic_loss_scale").loss_scaler
        return scaler is not None and bool(scaler.dynamic)

    def needs_scaler(self) -> bool:
        """Whether backward needs the loss scaled (DeepSpeed's: fp16 with a dynamic loss scale; bf16 and fp32 never)."""
        return self.dynamic_loss_scale

    @property
    def loss_scale_config(self) -> LossScaleConfig:
        """DeepSpeed's fp16 optimizers' `loss_scale_config` (`cur_scale`, `cur_iter`, `scale_window`, ...), read live
        from the engine's scaler."""
        return LossScaleConfig(self._live("loss_scale_config"), self)

    @property
    def overflow(self) -> bool:
        return self._live("overflow").last_step_overflowed

    def zero_grad(self, set_to_none: bool = True) -> None:
        engine = self._live("zero_grad")
        if engine.zero_stage == 2 and engine.accumulation.pending and not engine.accumulation.unfinished:
            return  # DeepSpeed's stage 2 keeps the window's reduced gradients: [Note: the engine's optimizer]
        engine.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> None:
        raise ZeroshardError(
            "engine.optimizer.step(): the engine steps its optimizer; call engine.step() (it also reduces, unscales "
            "and clips the gradients and steps the lr scheduler)"
        )

    def offload_states(
        self, include: Any = None, device: Any = "cpu", pin_memory: bool = True, non_blocking: bool = False
    ) -> None:
        """The engine's `offload_states` (DeepSpeed's engine passes its own call on to this one)."""
        self._live("offload_states").offload_states(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        self._live("reload_states").reload_states(non_blocking)

    def quantize_nontrainable_params(self) -> None:
        """DeepSpeed's stage-3 call for a script that froze parameters after its engine partitioned them (DeepSpeed-Chat
        calls it after `initialize` with LoRA). Here what trains is fixed at `initialize`, the parameters the optimizer
        steps, and with `zero_quantized_nontrainable_weights` the others were quantized as their units were built
        ([Note: quantized frozen weights]): nothing is left to quantize. Without the key, DeepSpeed's warning."""
        engine = self._live("quantize_nontrainable_params")
        if not engine.config.zero_optimization.zero_quantized_nontrainable_weights:
            log_rank(
                logger,
                30,
                "quantize_nontrainable_params() called with zero_quantized_nontrainable_weights disabled: nothing done",
            )

    def _set_scale(self, name: str, value: float) -> None:
        engine = self._live(name)
        if engine.loss_scaler is not None:
            engine.loss_scaler.loss_scale = value
        elif float(value) != 1.0:
            raise ZeroshardError(
                f"engine.optimizer.{name} = {value!r}: this engine scales no loss (bf16 or fp32; only fp16 has a "
                'loss scale); enable "fp16" in the config to train with one'
            )

    def __repr__(self) -> str:
        return f"ZeroOptimizer({self.optimizer!r})"


class DeepSpeedZeroOptimizer(ZeroOptimizer):
    """`engine.optimizer` at stages 1-2, under DeepSpeed's class name ([Note: the engine's optimizer])."""


class DeepSpeedZeroOptimizer_Stage3(ZeroOptimizer):  # noqa: N801 - DeepSpeed's name
    """`engine.optimizer` at stage 3, under DeepSpeed's class name ([Note: the engine's optimizer])."""


class BF16_Optimizer(ZeroOptimizer):  # noqa: N801 - DeepSpeed's name
    """`engine.optimizer` at stage 0 in bf16, under DeepSpeed's class name ([Note: the engine's optimizer])."""


class FP16_Optimizer(ZeroOptimizer):  # noqa: N801 - DeepSpeed's name
    """`engine.optimizer` at stage 0 in fp16 over FusedAdam, under DeepSpeed's class name ([Note: the engine's
    optimizer])."""


class FP16_UnfusedOptimizer(ZeroOptimizer):  # noqa: N801 - DeepSpeed's name
    """`engine.optimizer` at stage 0 in fp16 over another optimizer, under DeepSpeed's class name ([Note: the
    engine's optimizer])."""


def _named(engine: Engine, optimizer: torch.optim.Optimizer) -> type[ZeroOptimizer]:
    """DeepSpeed 0.19.8's choice (`_do_optimizer_sanity_check`): at stage 1, bf16 weights with fp32 gradient
    accumulation set and no CPU offload get its BF16_Optimizer; at stage 0 a pipeline's bf16 does, other bf16 and
    fp16 its FP16 optimizers (fused over FusedAdam)."""
    model_dtype, accum_dtype = engine.get_data_types()
    bf16 = model_dtype == torch.bfloat16
    if engine.zero_stage == 1 and bf16 and accum_dtype == torch.float32 and not engine.zero_cpu_offload():
        return BF16_Optimizer
    if engine.zero_stage > 0:
        return DeepSpeedZeroOptimizer_Stage3 if engine.zero_stage == 3 else DeepSpeedZeroOptimizer
    if bf16 and _is_pipeline(engine):
        return BF16_Optimizer
    return FP16_Optimizer if getattr(optimizer, DEEPSPEED_CLASS, None) == "FusedAdam" else FP16_UnfusedOptimizer


def _is_pipeline(engine: Engine) -> bool:
    module = sys.modules.get("zeroshard.pipe.engine")  # loaded wherever a pipeline engine exists, and only there
    return module is not None and isinstance(engine, module.PipelineEngine)


class LossScaleConfig:
    """DeepSpeed's `LossScaleConfig` fields over an engine's loss scaler ([Note: dynamic loss scale update]): what
    DeepSpeed's own loss-scale tests read. Without fp16: no grad scaling, scale 1.0, the dynamic fields None."""

    def __init__(self, engine: Engine, optimizer: ZeroOptimizer):
        self._engine, self._optimizer = engine, optimizer
        scaler = engine.loss_scaler
        dynamic = scaler is not None and bool(scaler.dynamic)
        self.use_grad_scaling = scaler is not None
        self.dynamic_loss_scale = dynamic
        self.scale_factor = scaler.scale_factor if dynamic else None
        self.scale_window = scaler.scale_window if dynamic else None
        self.min_loss_scale = scaler.min_scale if dynamic else None

    @property
    def cur_scale(self) -> float:
        return self._optimizer.cur_scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self._optimizer.cur_scale = value

    @property
    def cur_iter(self) -> int:
        scaler = self._engine.loss_scaler
        return scaler.iteration if scaler is not None else 0

    @property
    def last_overflow_iter(self) -> int | None:
        scaler = self._engine.loss_scaler
        return scaler.last_overflow_iteration if self.dynamic_loss_scale else None


ScriptOptimizer = ZeroOptimizer | torch.optim.Optimizer | None
