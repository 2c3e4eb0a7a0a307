"""`hybrid_engine`: one engine that trains a model and generates with it (the actor of an RLHF loop).

[Note: hybrid engine]
DeepSpeed's hybrid engine swaps a model's layers for its inference kernels at `engine.eval()` and back at
`engine.train()`, for the architectures its injection policies name; any other model runs its own `generate`
(DeepSpeed 0.19.8 says so in a warning). zeroshard has no inference kernels, so `generate` is always the model's own.
What the block still does here, for every model:
- `generate` at stage 3 with `pin_parameters` (the default) gathers the whole model once per call and releases it
  when the call returns; without it, every generated token would all-gather every unit again (the stage-3 hooks).
  `pin_parameters: false` keeps that unit-by-unit gathering: one unit's memory at a time, every token's traffic.
  Stages 0-2 hold whole parameters and gather nothing.
- `engine.module.generate(...)`, the call DeepSpeed-Chat's PPO trainer makes, is the engine's `generate`: the one
  method of a user's module zeroshard replaces, because DeepSpeed replaces it and RLHF scripts call it there;
  `destroy()` gives the module its own back.
- `max_out_tokens`: a call that asks for more tokens than that, prompt and new ones together, is refused before it
  runs (DeepSpeed's kernels fail on their workspace). Calls that say no length are checked against the model's
  `generation_config`.
- `release_inference_cache`: after each call Python's garbage is collected and the device's cache emptied, so the
  training step that follows has the memory the key-value cache held.
- At `initialize` every rank takes rank 0's RNG state (the device's; the CPU's on the CPU), as DeepSpeed does.
- `engine.eval()` logs DeepSpeed's latency line on rank 0 (end to end since the last `eval()`, the gather, the
  generation and the training in it, samples per second); the times add up every `generate` call in the interval,
  where DeepSpeed's keep the last call's.
- Accepted and warned as unimplemented (support.UNIMPLEMENTED): `inference_tp_size` > 1 with
  `tp_gather_partition_size` (DeepSpeed's kernels split the layers over a tensor-parallel group; here each rank
  generates with the whole model: the same tokens, more memory) and `enable_cuda_graph`. A PipelineModule is refused
  (DeepSpeed builds its pipeline engine and ignores the block).
"""

from __future__ import annotations

import contextlib
import gc
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from zeroshard.comm.collectives import Collectives
from zeroshard.engine import Engine
from zeroshard.errors import ZeroshardError
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)


def share_rank0_rng(world: Collectives, device: torch.device) -> None:
    """Every rank takes rank 0's RNG state: the device's on CUDA, the CPU's on the CPU (DeepSpeed's accelerator)."""
    from zeroshard.accelerator import get_accelerator

    accelerator = get_accelerator()
    state = accelerator.get_rng_state().to(device)
    world.broadcast(state, src=0, label="hybrid_engine RNG state")
    accelerator.set_rng_state(state.cpu())


def requested_tokens(module: Any, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The most tokens (prompt and new) a `generate(*inputs, **kwargs)` call can produce, as transformers decides it:
    `max_new_tokens` over `max_length`, the call's over its `generation_config`'s over the model's, and with neither
    20 new tokens (transformers 5; 4.x's default `max_length` is 20 in all) up to `max_position_embeddings`. None for
    a module without a generation config, or a call whose prompt length cannot be read."""
    config = kwargs.get("generation_config") or getattr(module, "generation_config", None)
    if config is None:
        return None

    def setting(name: str) -> Any:
        return kwargs[name] if kwargs.get(name) is not None else getattr(config, name, None)

    prompt = inputs[0] if inputs else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
    if not isinstance(prompt, torch.Tensor):
        return None
    length = int(prompt.shape[1] if prompt.dim() > 1 else prompt.shape[0])
    if setting("max_new_tokens") is not None:
        return length + int(setting("max_new_tokens"))
    if setting("max_length") is not None:
        return int(setting("max_length"))
    positions = getattr(getattr(module, "config", None), "max_position_embeddings", None)
    return min(length + 20, int(positions)) if positions is not None else length + 20


class _Latency:
    """DeepSpeed's eval-time latency line: what the time since the last `eval()` went to."""

    def __init__(self) -> None:
        self.since: float | None = None  # the last eval()
        self.total = 0.0
        self.intervals = 0
        self.gather = self.generate = self.training = 0.0
        self.training_since: float | None = None
        self.batch: int | None = None  # samples generated per call over all ranks (the first call's)

    def line(self) -> str | None:
        """At `eval()`: the interval's line (None at the first), and a new interval."""
        now = time.perf_counter()
        text = None
        if self.since is not None:
            latency = now - self.since
            self.total += latency
            self.intervals += 1
            others = latency - self.generate - self.gather - self.training
            text = (
                f"|E2E latency={latency:.2f}s |Gather latency={self.gather:.2f}s ({self.gather / latency:.2%}) "
                f"|Generate time={self.generate:.2f}s ({self.generate / latency:.2%}) "
                f"|Training time={self.training:.2f}s ({self.training / latency:.2%}) "
                f"|Others={others:.2f} ({others / latency:.2%})"
            )
            if self.batch is not None:
                text += (
                    f"|CurSamplesPerSec={self.batch / latency:.2f} "
                    f"|AvgSamplesPerSec={self.batch * self.intervals / self.total:.2f}"
                )
        self.since = now
        self.gather = self.generate = self.training = 0.0
        return text


class HybridEngine(Engine):
    """The engine `initialize` returns when `hybrid_engine.enabled` ([Note: hybrid engine]): an `Engine` that also
    generates. Every rank must call `generate` (stage 3 gathers).

    Example:
        >>> engine.eval()  # doctest: +SKIP
        >>> seq = engine.module.generate(prompts, attention_mask=mask, max_new_tokens=64)  # doctest: +SKIP
        >>> engine.train()  # doctest: +SKIP
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._latency = _Latency()
        self._module_generate: Callable[..., Any] | None = getattr(self.module, "generate", None)
        if self._module_generate is not None:
            self.module.generate = _EngineGenerate(self)  # type: ignore[assignment]

    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """The module's `generate(*inputs, **kwargs)`, the model gathered once for the call at stage 3 (with
        `pin_parameters`), after the `max_out_tokens` check."""
        if self._module_generate is None:
            raise ZeroshardError(
                f"hybrid_engine: {type(self.module).__name__} has no generate(); the hybrid engine generates with "
                "the module's own generate (a transformers model's, for example)"
            )
        settings = self.config.hybrid_engine
        wanted = requested_tokens(self.module, inputs, kwargs)
        if wanted is not None and wanted > int(settings.max_out_tokens):
            raise ZeroshardError(
                f"hybrid_engine.max_out_tokens is {settings.max_out_tokens} but this generate call can produce "
                f"{wanted} tokens (prompt and new ones): raise max_out_tokens or ask for fewer tokens"
            )
        if self._latency.batch is None:
            prompt = inputs[0] if inputs else kwargs.get("input_ids")
            if isinstance(prompt, torch.Tensor):
                self._latency.batch = int(prompt.shape[0]) * self.world_size
        start = time.perf_counter()
        with torch.profiler.record_function("zeroshard.generate"), self._gathered(settings.pin_parameters):
            gathered = time.perf_counter()
            out = self._module_generate(*inputs, **kwargs)
        if settings.release_inference_cache:
            from zeroshard.accelerator import get_accelerator

            gc.collect()
            get_accelerator().empty_cache()
        self._latency.gather += gathered - start
        self._latency.generate += time.perf_counter() - gathered
        return out

    @contextlib.contextmanager
    def _gathered(self, pin: bool) -> Iterator[None]:
        if pin and self.zero_stage == 3:
            with self.gathered_for_generation():
                yield
        else:
            yield

    def train(self, mode: bool = True) -> HybridEngine:
        """`eval()` (`train(False)`) logs the latency line of the interval since the last one."""
        if not mode:
            line = self._latency.line()
            if line is not None:
                log_rank(logger, 20, line)
        super().train(mode)
        self._latency.training_since = time.perf_counter() if mode else None
        return self

    def step(self) -> None:
        super().step()
        started = self._latency.training_since
        if started is not None:
            now = time.perf_counter()
            self._latency.training += now - started
            self._latency.training_since = now

    def destroy(self) -> None:
        """The module gets its own `generate` back."""
        if isinstance(self.module.__dict__.get("generate"), _EngineGenerate):
            del self.module.generate
        super().destroy()


class _EngineGenerate:
    """`engine.module.generate`: the engine's generate, holding the engine weakly (the module is the engine's)."""

    def __init__(self, engine: HybridEngine) -> None:
        self._engine = weakref.ref(engine)

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        engine = self._engine()
        if engine is None:
            raise ZeroshardError("hybrid_engine: the engine this module belonged to is gone")
        return engine.generate(*inputs, **kwargs)
