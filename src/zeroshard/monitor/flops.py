"""`flops_profiler`: per-module parameters, FLOPs and forward latency of one training step, DeepSpeed's report.

[Note: flops profile] DeepSpeed patches torch.nn.functional to count FLOPs; we count them with PyTorch's
`FlopCounterMode` (matmul, convolution, attention: the operations that dominate; element-wise ones, normalisation,
softmax and activations count 0, where DeepSpeed counts one per element or a few) and time each module with forward
pre/post hooks whose handles are removed when the count stops. MACs are FLOPs / 2, which is exact for the operations
FlopCounterMode counts, so MACs equal DeepSpeed's where FLOPs differ by the element-wise terms. torch 2.13's
FlopCounterMode has no formula for the CPU attention kernel (`_scaled_dot_product_flash_attention_for_cpu`), so
`_sdpa_flops` gives one from the shapes: Q K^T and the weights times V, DeepSpeed's count. Parameters are counted
from their full shapes (`shapes`, the strategy's record of what each shard belongs to): under stage 3 a parameter
outside its forward is an empty placeholder. `Recording` is that counting, shared by the engine's block (below) and
the standalone API (`zeroshard.profiling.flops_profiler`).

The engine's block: the first forward (one micro-batch, as "batch size per GPU" says) of the step taken when
`global_steps == profile_step` is profiled and the report written at that step's boundary, on rank 0, to
`output_file` or the log; its header names the step count after that step (profile_step + 1), as DeepSpeed's engine
prints `global_steps` once its step has counted. With `wall_clock_breakdown` the report takes its latencies from the
engine's timers of that step's last micro-step (its flops are the first forward's, the micro-batches alike; DeepSpeed
restarts its count at each forward of the profiled step and prints the window's summed times,
gradient_accumulation_steps times these), and adds DeepSpeed's backward, step and iteration lines: a backward counted
as 2 forwards plus `recompute_fwd_factor` (the forwards activation checkpointing recomputes: 1 where every layer is
checkpointed); a pipeline engine times neither forward nor backward, so its report keeps the hooks' forward latency.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, flop_registry
from torch.utils.hooks import RemovableHandle

from zeroshard.config.monitor import FlopsProfilerConfig
from zeroshard.monitor.flops_report import EngineSizes, ModuleProfile, Profile, ReportOptions, format_profile

Shapes = Callable[[], dict[int, tuple[int, ...]]]


def _sdpa_flops(
    query_shape: tuple[int, ...], key_shape: tuple[int, ...], value_shape: tuple[int, ...], *_: Any, **__: Any
) -> int:
    """Attention from its shapes ([Note: flops profile]): every query row against every key (d_q each), then the
    weights against the values (d_v each), 2 FLOPs per multiply-add."""
    rows, keys = math.prod(query_shape[:-1]), key_shape[-2]
    return 2 * rows * keys * (query_shape[-1] + value_shape[-1])


def _counter() -> FlopCounterMode:
    extra: dict[Any, Any] = {}
    cpu_attention = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if cpu_attention is not None and cpu_attention not in flop_registry:
        extra[cpu_attention] = _sdpa_flops
    return FlopCounterMode(display=False, custom_mapping=extra)


class Recording:
    """FLOPs and forward time of `model`'s modules from `start()` to `stop()`, and their parameters, read any time
    with `profile()`; what was counted stays until the next `start()` or `reset()`. Modules whose type is in
    `ignore` get no hooks and report only what their children count (DeepSpeed's `ignore_list`)."""

    def __init__(self, model: nn.Module, shapes: Shapes = dict):
        self.model = model
        self._shapes = shapes
        self._root = type(model).__name__  # FlopCounterMode names modules "<root class>.<qualified name>"
        self._counter: FlopCounterMode | None = None
        self._counts: dict[str, int] = {}
        self._durations: dict[str, float] = {}
        self._started: dict[str, list[float]] = {}
        self._params: dict[str, int] = {}
        self._ignore: tuple[type, ...] = ()
        self._handles: list[RemovableHandle] = []

    @property
    def running(self) -> bool:
        return self._counter is not None

    def start(self, ignore: tuple[type, ...] = ()) -> None:
        self.stop()
        self._ignore = ignore
        self.reset()
        for name, module in self.model.named_modules():
            if type(module) in ignore:
                continue
            self._handles.append(module.register_forward_pre_hook(self._start_hook(name)))
            self._handles.append(module.register_forward_hook(self._stop_hook(name)))
        self._counter = _counter()
        self._counter.__enter__()

    def stop(self) -> None:
        if self._counter is None:
            return
        self._counts = self._live_counts()
        self._counter.__exit__(None, None, None)
        self._counter = None
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def reset(self) -> None:
        """Zero the counts and times; count the parameters anew."""
        self._counts, self._durations, self._started = {}, {}, {}
        if self._counter is not None:
            self._counter.flop_counts.clear()
        shapes = self._shapes()
        self._params = {name: _params(module, shapes) for name, module in self.model.named_modules()}

    def profile(self, step: int = 0) -> Profile:
        """What was counted so far, by module; a module that was not timed (a ModuleList, an ignored module)
        reports its children's time, as DeepSpeed's does."""
        counts = self._live_counts() if self._counter is not None else self._counts
        modules = list(self.model.named_modules())
        result: dict[str, ModuleProfile] = {}
        for name, module in reversed(modules):  # children before their parents
            names = (f"{name}.{k}" if name else k for k, _ in module.named_children())
            children = [result[n] for n in names if n in result]  # a module met twice is counted once
            flops = counts.get(f"{self._root}.{name}" if name else self._root, 0)
            if type(module) in self._ignore:
                flops = sum(c.flops for c in children)
            duration = self._durations.get(name, 0.0) or sum(c.duration for c in children)
            result[name] = ModuleProfile(self._params.get(name, 0), int(flops), duration)
        return Profile(step, dict(reversed(result.items())))

    def _live_counts(self) -> dict[str, int]:
        assert self._counter is not None
        return {k: int(sum(v.values())) for k, v in self._counter.get_flop_counts().items()}

    def _start_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: object) -> None:
            self._started.setdefault(name, []).append(_now())

        return hook

    def _stop_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: object, output: object) -> None:
            self._durations[name] = self._durations.get(name, 0.0) + _now() - self._started[name].pop()

        return hook


class FlopsProfiler:
    """The engine's `flops_profiler` block: profiles the forwards of one step of `model`; `shapes` gives full shapes
    by `id(param)` where they differ."""

    def __init__(
        self,
        config: FlopsProfilerConfig,
        model: nn.Module,
        shapes: Shapes,
        world_size: int,
        micro_batch_size: int,
    ):
        self.config = config
        self.model = model
        self._recording = Recording(model, shapes)
        self.world_size = world_size
        self.micro_batch_size = micro_batch_size
        self.profile: Profile | None = None  # the last finished profile

    @contextlib.contextmanager
    def forward(self, step: int) -> Iterator[None]:
        """Wrap one forward; counts only the first at `profile_step` ([Note: flops profile])."""
        if step != int(self.config.profile_step) or (self.profile is not None and self.profile.step == step):
            yield
            return
        self._recording.start()
        try:
            yield
        finally:
            self._recording.stop()
            self.profile = self._recording.profile(step)

    def report(self, step: int, timings: dict[str, float] | None = None) -> str | None:
        """At the boundary of `step` (counted before it): the report text, written to `output_file` or returned for
        the log. `timings`: the wall-clock breakdown's milliseconds ([Note: wall clock breakdown])."""
        if self.profile is None or self.profile.step != step:
            return None
        options = ReportOptions(
            at_step=step + 1,  # DeepSpeed's header: global_steps after the profiled step ([Note: flops profile])
            module_depth=int(self.config.module_depth),
            top_modules=int(self.config.top_modules),
            detailed=bool(self.config.detailed),
            recompute_fwd_factor=float(self.config.recompute_fwd_factor),
            engine=EngineSizes(self.world_size, self.world_size, 1, self.micro_batch_size),
            timings=dict(timings or {}),
        )
        text = format_profile(self.profile, self.model, options)
        if self.config.output_file:
            write_report(str(self.config.output_file), text)
            return None
        return text


def write_report(path: str, text: str) -> None:
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text + "\n")


def _now() -> float:
    """Wall time after the device's queued work (DeepSpeed synchronizes in its timing hooks too)."""
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()
    return time.perf_counter()


def _params(module: nn.Module, shapes: dict[int, tuple[int, ...]]) -> int:
    total = 0
    for p in module.parameters():
        shape = shapes.get(id(p))
        total += int(torch.Size(shape).numel()) if shape is not None else p.numel()
    return total
