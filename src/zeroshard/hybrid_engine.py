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
- `engine.module.generate(...)`, the call DeepSpeed-Chat's PPO trainer makes, is the engine's `generate`
  ([Note: generation at stage 3] in generation.py: also `synced_gpus=True` by default, as under DeepSpeed ZeRO-3).
- `max_out_tokens` sizes DeepSpeed's inference kernels' workspace, and DeepSpeed checks nothing for a model its
  policies do not name; the model's own `generate` here grows its cache as it goes, so the key has nothing to size
  (support.NO_OP_BY_DESIGN).
- `release_inference_cache`: after each call Python's garbage is collected and the device's cache emptied, so the
  training step that follows has the memory the key-value cache held.
- At `initialize` every rank takes rank 0's state of the device's RNG (on CUDA the CUDA generator, the CPU one staying
  per rank; on the CPU the CPU generator), as DeepSpeed does.
- While `generate` holds the model gathered, its forwards are left out of stage 3's prefetch trace and of the
  per-step divergence digest ([Note: forwards of the whole gathered model] in zero/stage3/strategy.py): ranks may
  generate different numbers of tokens (no `synced_gpus` needed), and the training step's recorded order survives.
  Under ZeRO++'s quantized weights the gathered model is the exact one (as `GatheredParameters` gives), where
  training forwards use the quantized gather.
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
from collections.abc import Iterator
from typing import Any

import torch

from zeroshard.comm.collectives import Collectives
from zeroshard.engine import Engine
from zeroshard.errors import ZeroshardError
from zeroshard.offload.states import PARAMS
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)


def share_rank0_rng(world: Collectives, device: torch.device) -> None:
    """Every rank takes rank 0's RNG state: the device's on CUDA, the CPU's on the CPU (DeepSpeed's accelerator)."""
    from zeroshard.accelerator import get_accelerator

    accelerator = get_accelerator()
    state = accelerator.get_rng_state().to(device)
    world.broadcast(state, src=0, label="hybrid_engine RNG state")
    accelerator.set_rng_state(state.cpu())


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

    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """The module's `generate(*inputs, **kwargs)`, the model gathered once for the call at stage 3 (with
        `pin_parameters`)."""
        if self.strategy is not None:  # [Note: offloaded states]
            self.strategy.refuse_away("generate", (PARAMS,))
        own = self._own_generate()
        if own is None:
            raise ZeroshardError(
                f"hybrid_engine: {type(self.module).__name__} has no generate(); the hybrid engine generates with "
                "the module's own generate (a transformers model's, for example)"
            )
        settings = self.config.hybrid_engine
        if self._latency.batch is None:
            prompt = inputs[0] if inputs else kwargs.get("input_ids")
            if isinstance(prompt, torch.Tensor):
                self._latency.batch = int(prompt.shape[0]) * self.world_size
        start = time.perf_counter()
        with torch.profiler.record_function("zeroshard.generate"), self._gathered(settings.pin_parameters):
            gathered = time.perf_counter()
            out = own(*inputs, **self._generate_kwargs(own, kwargs))  # [Note: generation at stage 3]
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

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        super().step(lr_kwargs)
        started = self._latency.training_since
        if started is not None:
            now = time.perf_counter()
            self._latency.training += now - started
            self._latency.training_since = now
