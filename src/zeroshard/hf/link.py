"""What the Trainer's loop holds in place of its accelerator, optimizer and scheduler once the engine exists.

[Note: the Trainer's loop over the engine]
transformers' inner loop, per micro-batch: `training_step` (forward, `accelerator.backward(loss)` with the loss
already divided by the window's micro-batch count); on the window's last micro-batch: `_clip_grad_norm`
(`accelerator.clip_grad_norm_`), `optimizer.step()`, `lr_scheduler.step()` unless
`accelerator.optimizer_step_was_skipped`, `model.zero_grad()`. Under DeepSpeed, accelerate turns
`backward` into `engine.backward(loss, scale_wrt_gas=False)` plus `engine.step()` on the boundary and makes the
optimizer's and scheduler's `step` no-ops. We do the same with three small objects sharing one `EngineLink`:

- `EngineAccelerator` wraps the Trainer's accelerator (every other call passes through) and owns `backward`,
  `clip_grad_norm_` (the norm the engine measured; the engine clips by `gradient_clipping`), `no_sync` (the engine
  decides when to communicate) and `optimizer_step_was_skipped`.
- `EngineOptimizer` / `EngineScheduler`: `step()` does nothing (the engine stepped), the rest reads the engine's.

The engine counts its own accumulation window. When the Trainer ends a window early (the last, shorter window of
an epoch) `backward` moves the engine's micro-step count to that window's last slot, so both agree on where the
optimizer step falls. With `managed_gradient_accumulation: false` the engine counts nothing: `backward` calls
`engine.step()` on the Trainer's boundaries only. `get_last_lr()` reports the lr the step just taken used, as the
plain Trainer logs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.checkpoint.torn import refuse_torn
from zeroshard.engine_weights import live_storages, on_host
from zeroshard.errors import ConfigError

if TYPE_CHECKING:
    from zeroshard.engine import Engine
    from zeroshard.engine_optimizer import ZeroOptimizer


@dataclass
class EngineLink:
    """The engine the Trainer drives and what its last step left behind."""

    engine: Engine | None = None
    last_lr: list[float] = field(default_factory=lambda: [0.0])

    def require(self) -> Engine:
        assert self.engine is not None, "the zeroshard engine is built when training starts"
        return self.engine

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        engine = self.require()
        if not engine.managed_gradient_accumulation():  # [Note: caller-owned windows]: the Trainer's are the engine's
            engine.backward(loss, scale_wrt_gas=False)
            if boundary:
                self.last_lr = engine.get_lr()
                engine.step()
            return
        if boundary and not engine.is_gradient_accumulation_boundary():
            accum = engine.gradient_accumulation_steps()
            engine.micro_steps = (engine.micro_steps // accum + 1) * accum - 1  # a window the Trainer ends early
        engine.backward(loss, scale_wrt_gas=False)
        if engine.is_gradient_accumulation_boundary():
            self.last_lr = engine.get_lr()
        engine.step()


def engine_state_dict(engine: Engine) -> dict[str, Any] | None:
    """accelerate's `get_state_dict` under DeepSpeed, for a zeroshard engine (every rank must call it). Stage 3: in
    the compute dtype on rank 0 (None elsewhere), and only with `stage3_gather_16bit_weights_on_model_save`, as
    under DeepSpeed; stages 0-2: a CPU copy of the strategy's full state dict on every rank (experts split over
    ranks whole: [Note: expert checkpoints])."""
    refuse_torn(engine, "get_state_dict")  # accelerate's save of the model: [Note: a torn load]
    if engine.zero_stage == 3:
        if not engine.zero_gather_16bit_weights_on_model_save():
            raise ConfigError(
                "get_state_dict at ZeRO stage 3 gathers the whole model: set zero_optimization."
                "stage3_gather_16bit_weights_on_model_save true (accelerate: zero3_save_16bit_model), or save "
                "the sharded checkpoint with save_state / engine.save_checkpoint"
            )
        return engine._zero3_consolidated_16bit_state_dict()
    strategy = engine.strategy
    # each tensor on the host as the strategy makes it whole (fsdp2, tensor parallelism: never the whole model on a GPU)
    state = strategy.save_state_dict(keep=True) if strategy is not None else engine.module.state_dict()
    live = live_storages(engine.module)
    return {k: on_host(v, live) for k, v in state.items()}


class EngineAccelerator:
    """The Trainer's accelerator with `backward` and gradient clipping handed to the engine
    ([Note: the Trainer's loop over the engine]); anything else is the wrapped accelerator's."""

    def __init__(self, accelerator: Any, link: EngineLink, ulysses: Any = None):
        self._accelerator = accelerator
        self._link = link
        self._ulysses = ulysses  # [Note: the Trainer's sequence parallelism]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    @property
    def parallelism_config(self) -> Any:
        return self._ulysses if self._ulysses is not None else self._accelerator.parallelism_config

    def deepspeed_ulysses_dl_adapter(self, dl: Any, model: Any) -> Any:
        if self._ulysses is None:
            return dl
        from zeroshard.hf.ulysses import adapt_dataloader

        return adapt_dataloader(dl, self._link.require(), self._accelerator.device)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self._link.engine is None:
            self._accelerator.backward(loss, **kwargs)
            return
        self._link.backward(loss, boundary=bool(self._accelerator.sync_gradients))

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        if self._link.engine is None:
            return self._accelerator.clip_grad_norm_(parameters, max_norm, norm_type)
        return self._link.engine.get_global_grad_norm()

    @contextlib.contextmanager
    def no_sync(self, model: Any) -> Iterator[None]:
        yield

    @property
    def optimizer_step_was_skipped(self) -> bool:
        engine = self._link.engine
        return engine is not None and not engine.was_step_applied()

    def get_state_dict(self, model: Any, unwrap: bool = True) -> Any:
        """The whole model's weights for the engine or its module (the wrapped accelerator knows neither)."""
        engine = self._link.engine
        if engine is not None and (model is engine or model is engine.module):
            return engine_state_dict(engine)
        return self._accelerator.get_state_dict(model, unwrap=unwrap)

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Any:
        engine = self._link.engine
        if engine is not None and model is engine:
            model = engine.module
        return self._accelerator.unwrap_model(
            model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile
        )


class EngineOptimizer:
    """`trainer.optimizer` while the engine trains: the engine's optimizer, stepped by the engine."""

    def __init__(self, link: EngineLink):
        self._link = link

    @property
    def optimizer(self) -> ZeroOptimizer | torch.optim.Optimizer:
        """`engine.optimizer`, as `trainer.optimizer.optimizer` is DeepSpeed's under transformers ([Note: the engine's
        optimizer]): callbacks read `cur_scale`/`overflow` and call `offload_states` through it."""
        optimizer = self._link.require().optimizer
        assert optimizer is not None
        return optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def step(self, closure: Any = None) -> None:
        pass  # engine.step() ran in backward: [Note: the Trainer's loop over the engine]

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # the engine's step leaves its gradient buffers empty

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)


class EngineScheduler:
    """`trainer.lr_scheduler` while the engine trains: the engine steps the real one on every applied step."""

    def __init__(self, link: EngineLink):
        self._link = link

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass  # [Note: the Trainer's loop over the engine]

    def get_last_lr(self) -> list[float]:
        return list(self._link.last_lr)

    def state_dict(self) -> dict[str, Any]:
        scheduler = self._link.require().lr_scheduler
        return scheduler.state_dict() if scheduler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        scheduler = self._link.require().lr_scheduler
        if scheduler is not None:
            scheduler.load_state_dict(state_dict)
