"""`flops_profiler`: per-module parameters, FLOPs and forward latency of one training step, DeepSpeed's report.

[Note: flops profile] DeepSpeed patches torch.nn.functional to count FLOPs; we count them with PyTorch's
`FlopCounterMode` (matmul, convolution, attention: the operations that dominate; element-wise ones count 0) and time
each module with forward pre/post hooks whose handles are removed after the step. MACs are FLOPs / 2, which is exact
for the operations FlopCounterMode counts. Parameters are counted from their full shapes (`shapes`, the strategy's
record of what each shard belongs to): under stage 3 a parameter outside its forward is an empty placeholder. The
first forward (one micro-batch, as "batch size per GPU" says) of step `profile_step` is profiled and the report
written at that step's boundary, on rank 0, to `output_file` or the log. With `wall_clock_breakdown` the report
takes its latencies from the engine's timers of that step's last micro-step (its flops are the first forward's, the
micro-batches alike; DeepSpeed
counts every forward of the window and prints the window's summed times, gradient_accumulation_steps times these,
with the same FLOPS), and adds DeepSpeed's backward, step and iteration lines: a backward counted as 2 forwards plus
`recompute_fwd_factor` (the forwards activation checkpointing recomputes: 1 where every layer is checkpointed); a
pipeline engine times neither forward nor backward, so its report keeps the hooks' forward latency alone.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from zeroshard.config.monitor import FlopsProfilerConfig

_LINE = "{:<70}  {:<8}"


@dataclass
class ModuleProfile:
    """What one module (with its children) cost in the profiled forwards."""

    params: int = 0
    flops: int = 0
    duration: float = 0.0  # seconds, summed over calls

    @property
    def macs(self) -> int:
        return self.flops // 2


@dataclass
class Profile:
    """The measured step: `modules` by qualified name ("" is the model)."""

    step: int
    modules: dict[str, ModuleProfile] = field(default_factory=dict)

    @property
    def total(self) -> ModuleProfile:
        return self.modules[""]


class FlopsProfiler:
    """Profiles the forwards of one step of `model`; `shapes` gives full shapes by `id(param)` where they differ."""

    def __init__(
        self,
        config: FlopsProfilerConfig,
        model: nn.Module,
        shapes: Callable[[], dict[int, tuple[int, ...]]],
        world_size: int,
        micro_batch_size: int,
    ):
        self.config = config
        self.model = model
        self._shapes = shapes
        self.world_size = world_size
        self.micro_batch_size = micro_batch_size
        self.profile: Profile | None = None  # the last finished profile

    @contextlib.contextmanager
    def forward(self, step: int) -> Iterator[None]:
        """Wrap one forward; counts only the first at `profile_step` ([Note: flops profile])."""
        if step != int(self.config.profile_step) or (self.profile is not None and self.profile.step == step):
            yield
            return
        self.profile = Profile(step)
        durations: dict[str, float] = {}
        started: dict[str, list[float]] = {}
        handles = []
        for name, module in self.model.named_modules():
            handles.append(module.register_forward_pre_hook(_start(started, name)))
            handles.append(module.register_forward_hook(_stop(started, durations, name)))
        counter = FlopCounterMode(display=False)
        try:
            with counter:
                yield
        finally:
            for h in handles:
                h.remove()
        self._record(counter, durations)

    def report(self, step: int, timings: dict[str, float] | None = None) -> str | None:
        """At `profile_step`'s boundary: the report text, written to `output_file` or returned for the log.
        `timings`: the wall-clock breakdown's milliseconds ([Note: wall clock breakdown]), which add DeepSpeed's
        backward, step and iteration lines."""
        if self.profile is None or self.profile.step != step:
            return None
        text = format_profile(
            self.profile, self.config, self.world_size, self.micro_batch_size, self.model, timings or {}
        )
        if self.config.output_file:
            path = os.path.abspath(str(self.config.output_file))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text + "\n")
            return None
        return text

    def _record(self, counter: FlopCounterMode, durations: dict[str, float]) -> None:
        assert self.profile is not None
        root = type(self.model).__name__
        counts = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
        shapes = self._shapes()
        for name, module in self.model.named_modules():
            self.profile.modules[name] = ModuleProfile(
                params=_params(module, shapes),
                flops=int(counts.get(f"{root}.{name}" if name else root, 0)),
                duration=durations.get(name, 0.0),
            )


def _now() -> float:
    """Wall time after the device's queued work (DeepSpeed synchronizes in its timing hooks too)."""
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()
    return time.perf_counter()


def _start(started: dict[str, list[float]], name: str) -> Callable[..., None]:
    def hook(module: nn.Module, args: object) -> None:
        started.setdefault(name, []).append(_now())

    return hook


def _stop(started: dict[str, list[float]], durations: dict[str, float], name: str) -> Callable[..., None]:
    def hook(module: nn.Module, args: object, output: object) -> None:
        durations[name] = durations.get(name, 0.0) + _now() - started[name].pop()

    return hook


def _params(module: nn.Module, shapes: dict[int, tuple[int, ...]]) -> int:
    total = 0
    for p in module.parameters():
        shape = shapes.get(id(p))
        total += int(torch.Size(shape).numel()) if shape is not None else p.numel()
    return total


# -- the report, in DeepSpeed's words and number formats -------------------------------------------------------


def number_to_string(num: float, precision: int = 2) -> str:
    for magnitude, units in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if num >= magnitude:
            return f"{round(num / magnitude, precision):g} {units}"
    if num >= 1 or num == 0:
        return f"{round(num, precision):g} "
    if num >= 1e-3:
        return f"{round(num / 1e-3, precision):g} m"
    return f"{round(num / 1e-6, precision):g} u"


def params_to_string(n: float) -> str:
    return number_to_string(n).replace("G", "B").strip()


def macs_to_string(n: float) -> str:
    return f"{number_to_string(n)}MACs"


def flops_to_string(n: float) -> str:
    return f"{number_to_string(n)}FLOPS"


def duration_to_string(seconds: float) -> str:
    return f"{number_to_string(seconds)}s"


def format_profile(
    profile: Profile,
    config: FlopsProfilerConfig,
    world_size: int,
    micro_batch_size: int,
    model: nn.Module,
    timings: dict[str, float] | None = None,
) -> str:
    total = profile.total
    timed = _timed_micro_step(timings or {})
    latency = timed[0] if timed is not None else total.duration
    lines = [
        "",
        "-------------------------- DeepSpeed Flops Profiler --------------------------",
        f"Profile Summary at step {profile.step}:",
        "Notations:\n"
        "data parallel size (dp_size), model parallel size(mp_size),\n"
        "number of parameters (params), number of multiply-accumulate operations(MACs),\n"
        "number of floating-point operations (flops), floating-point operations per second (FLOPS),\n"
        "fwd latency (forward propagation latency), bwd latency (backward propagation latency),\n"
        "step (weights update latency), iter latency (sum of fwd, bwd and step latency)\n",
        _LINE.format("world size: ", world_size),
        _LINE.format("data parallel size: ", world_size),
        _LINE.format("model parallel size: ", 1),
        _LINE.format("batch size per GPU: ", micro_batch_size),
        _LINE.format("params per GPU: ", params_to_string(total.params)),
        _LINE.format("params of model = params per GPU * mp_size: ", params_to_string(total.params)),
        _LINE.format("fwd MACs per GPU: ", macs_to_string(total.macs)),
        _LINE.format("fwd flops per GPU: ", number_to_string(total.flops)),
        _LINE.format("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(total.flops)),
        _LINE.format("fwd latency: ", duration_to_string(latency)),
        _LINE.format(
            "fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ",
            flops_to_string(total.flops / latency if latency else 0.0),
        ),
        *(_backward_lines(total.flops, timed, float(config.recompute_fwd_factor), micro_batch_size * world_size)),
        "",
        "----------------------------- Aggregated Profile per GPU -----------------------------",
        *_aggregated(profile, model, int(config.module_depth), int(config.top_modules)),
    ]
    if config.detailed:
        lines += [
            "",
            "------------------------------ Detailed Profile per GPU ------------------------------",
            "Each module profile is listed after its name in the following order: ",
            "params, percentage of total params, MACs, percentage of total MACs, fwd latency, "
            "percentage of total fwd latency, fwd FLOPS",
            *_detailed(profile, model, "", "", 0),
        ]
    lines.append("------------------------------------------------------------------------------")
    return "\n".join(lines)


def _timed_micro_step(timings: dict[str, float]) -> tuple[float, float, float] | None:
    """(fwd, bwd, step) seconds of the profiled step's last micro-step (the one whose step updates the weights), from
    the wall-clock breakdown; None without it, or where forward and backward are not timed (a pipeline engine)."""
    fwd, bwd = timings.get("fwd_microstep", 0.0), timings.get("bwd_microstep", 0.0)
    if fwd <= 0.0 or bwd <= 0.0:
        return None
    return fwd / 1e3, bwd / 1e3, timings.get("step_microstep", 0.0) / 1e3


def _backward_lines(
    flops: int, timed: tuple[float, float, float] | None, recompute_fwd_factor: float, samples: int
) -> list[str]:
    """DeepSpeed's lines under wall_clock_breakdown: a backward costs 2 forwards, plus `recompute_fwd_factor` more
    where activation checkpointing recomputes forwards ([Note: flops profile])."""
    if timed is None:
        return []
    fwd, bwd, step = timed
    factor = 2 + recompute_fwd_factor
    iteration = fwd + bwd + step
    return [
        _LINE.format("bwd latency: ", duration_to_string(bwd)),
        _LINE.format(
            f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency: ", flops_to_string(factor * flops / bwd)
        ),
        _LINE.format(
            f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
            flops_to_string((factor + 1) * flops / (fwd + bwd)),
        ),
        _LINE.format("step latency: ", duration_to_string(step)),
        _LINE.format("iter latency: ", duration_to_string(iteration)),
        _LINE.format(
            f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / iter latency: ",
            flops_to_string((factor + 1) * flops / iteration),
        ),
        _LINE.format("samples/second: ", round(samples / iteration, 2)),
    ]


def _aggregated(profile: Profile, model: nn.Module, module_depth: int, top_modules: int) -> list[str]:
    """Per depth, the module classes with the most params, MACs and latency (DeepSpeed's aggregated profile)."""
    by_depth: dict[int, dict[str, list[float]]] = {}
    for name in profile.modules:
        depth = 0 if name == "" else name.count(".") + 1
        m = profile.modules[name]
        row = by_depth.setdefault(depth, {}).setdefault(type(model.get_submodule(name)).__name__, [0, 0, 0.0])
        row[0] += m.macs
        row[1] += m.params
        row[2] += m.duration
    depth = len(by_depth) - 1 if module_depth == -1 else module_depth
    lines = [f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    for d in range(min(depth, len(by_depth))):
        rows = by_depth[d]

        def top(col: int, fmt: Callable[[float], str]) -> dict[str, str]:
            ranked = sorted(rows.items(), key=lambda kv: kv[1][col], reverse=True)[:top_modules]  # noqa: B023
            return {k: fmt(v[col]) for k, v in ranked}

        lines += [
            f"depth {d}:",
            f"    params      - {top(1, params_to_string)}",
            f"    MACs        - {top(0, macs_to_string)}",
            f"    fwd latency - {top(2, duration_to_string)}",
        ]
    return lines


def _detailed(profile: Profile, module: nn.Module, name: str, key: str, indent: int) -> list[str]:
    """The model's repr with each module's profile in place of (before) its extra_repr."""
    total = profile.total
    m = profile.modules[name]

    def pct(part: float, whole: float) -> str:
        return f"{round(100 * part / whole, 2) if whole else 0:g}%"

    items = [
        f"{params_to_string(m.params)} = {pct(m.params, total.params)} Params",
        f"{macs_to_string(m.macs)} = {pct(m.macs, total.macs)} MACs",
        f"{duration_to_string(m.duration)} = {pct(m.duration, total.duration)} latency",
        flops_to_string(round(m.flops / m.duration, 2) if m.duration else 0),
    ]
    if module.extra_repr():
        items.append(module.extra_repr())
    head = " " * indent + (f"({key}): " if key else "") + f"{type(module).__name__}({', '.join(items)}"
    children = list(module.named_children())
    if not children:
        return [head + ")"]
    lines = [head]
    for child_key, child in children:
        lines += _detailed(profile, child, f"{name}.{child_key}" if name else child_key, child_key, indent + 2)
    return lines + [" " * indent + ")"]
