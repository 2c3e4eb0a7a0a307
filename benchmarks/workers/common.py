"""The part of a benchmark row every framework shares: model, data, the timed loop, the result file.

A framework module provides a `Trainer` (build it, take one step, say how many bytes of model state
this rank holds); `time_steps` and `summarize` do everything else identically for all of them.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from benchmarks.spec import RowSpec, TrainSettings
from benchmarks.workers.commcount import CommCounter
from zeroshard.data import ByteBlocks, stdlib_corpus
from zeroshard.models.gpt import GPT, PRESETS


class NotImplementedRow(Exception):
    """The framework cannot run this row yet (a zeroshard feature that has not landed)."""


@dataclass
class ModelState:
    """Bytes of model state on this rank; `source` says whether they were measured or are theory."""

    total: int
    parts: dict[str, int]
    source: str  # how the numbers were obtained, e.g. "measured" or "measured, gradients theory"


@dataclass
class RankResult:
    step_times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    peak_rss: int = 0
    model_state: dict[str, Any] = field(default_factory=dict)
    comm_counted: dict[str, float] = field(default_factory=dict)
    comm_engine: float | None = None
    minor_faults: float = 0.0  # per timed step (getrusage): fresh pages the allocator asked the kernel for


class Trainer(Protocol):
    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float: ...

    def model_state(self) -> ModelState: ...

    def engine_comm_bytes(self) -> float | None:
        """Bus bytes the framework itself counted since it was built (None where it does not count)."""
        ...


def seq_len(settings: TrainSettings) -> int:
    block = PRESETS[settings.size].block_size
    return min(settings.seq_len or block, block)


def build_model(settings: TrainSettings) -> GPT:
    """The same initial weights on every rank and in every framework; with `lora_rank`, peft's LoRA adapters on
    the blocks' linear layers (drawn from the same seed) and every other parameter frozen."""
    torch.manual_seed(settings.seed)
    model = GPT(PRESETS[settings.size])
    if settings.lora_rank > 0:
        from peft import LoraConfig, inject_adapter_in_model

        targets = ["qkv", "proj", "mlp.0", "mlp.2"]
        config = LoraConfig(r=settings.lora_rank, lora_alpha=2 * settings.lora_rank, target_modules=targets)
        inject_adapter_in_model(config, model)
        for name, param in model.named_parameters():
            param.requires_grad_("lora_" in name)
    return model


class Batches:
    """Step `i`'s global batch: `world_size x micro_batch` blocks of `seq_len` bytes of the stdlib corpus,
    picked by a generator seeded with the step (the same for every framework)."""

    def __init__(self, settings: TrainSettings, world_size: int):
        self.data = ByteBlocks(stdlib_corpus(1_000_000), seq_len(settings))
        self.settings = settings
        self.world_size = world_size

    def for_rank(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.settings.seed * 1000 + step)
        global_size = self.world_size * self.settings.micro_batch
        picks = torch.randint(len(self.data), (global_size,), generator=gen).tolist()
        mine = picks[rank * self.settings.micro_batch : (rank + 1) * self.settings.micro_batch]
        xs, ys = zip(*(self.data[i] for i in mine), strict=True)
        return torch.stack(xs), torch.stack(ys)


def train_steps(engine: Any, batches: Batches, rank: int, steps: int) -> list[float]:
    """`steps` DeepSpeed-style steps (forward, `backward`, `step`) of a zeroshard or DeepSpeed engine on this
    rank's batches; the losses."""
    losses = []
    for step in range(steps):
        x, y = batches.for_rank(step, rank)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of per-parameter state tensors (Adam's m and v; scalar step counters are left out)."""
    total = 0
    for state in optimizer.state.values():
        total += tensor_bytes(_local(v) for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def local_bytes(tensors: Any) -> int:
    return tensor_bytes(_local(t) for t in tensors if t is not None)


def time_steps(trainer: Trainer, spec: RowSpec, rank: int) -> RankResult:
    """Warm-up steps (the last one under the comm counter), then timed steps, each after a barrier."""
    settings = spec.settings
    batches = Batches(settings, spec.world_size)
    result = RankResult()
    engine_before: float | None = None
    for step in range(settings.steps):
        x, y = batches.for_rank(step, rank)
        dist.barrier()
        if step == settings.warmup - 1:
            counter = CommCounter(spec.world_size)
            with counter:
                loss = trainer.train_step(x, y)
            result.comm_counted = {**counter.bus_bytes, "total": counter.total_bus_bytes}
            engine_before = trainer.engine_comm_bytes()
        else:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            loss = trainer.train_step(x, y)
            elapsed = time.perf_counter() - start
            if step >= settings.warmup:
                result.step_times.append(elapsed)
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
                result.minor_faults += faults / settings.timed_steps
        result.losses.append(loss)
    engine_after = trainer.engine_comm_bytes()
    if engine_after is not None and engine_before is not None:
        result.comm_engine = (engine_after - engine_before) / settings.timed_steps
    result.peak_rss = peak_rss_bytes()
    state = trainer.model_state()
    result.model_state = {"total": state.total, "parts": state.parts, "source": state.source}
    return result


def summarize(spec: RowSpec, ranks: list[RankResult], numel: int, trainable: int) -> dict[str, Any]:
    """One row's JSON: step time over ranks (the slowest rank of each step), memory, bytes, loss."""
    per_step = [max(times) for times in zip(*(r.step_times for r in ranks), strict=True)]
    q = statistics.quantiles(per_step, n=4) if len(per_step) >= 2 else [per_step[0]] * 3
    tokens = spec.world_size * spec.settings.micro_batch * seq_len(spec.settings)
    median = statistics.median(per_step)
    losses = [statistics.fmean(step) for step in zip(*(r.losses for r in ranks), strict=True)]
    return {
        "status": "ok",
        "row_id": spec.row_id,
        "variant": spec.variant.key,
        "label": spec.variant.label,
        "framework": spec.variant.framework,
        "stage": spec.variant.stage,
        "offload": spec.variant.offload,
        "size": spec.settings.size,
        "world_size": spec.world_size,
        "params": numel,
        "trainable": trainable,
        "tokens_per_step": tokens,
        "step_times": per_step,
        "step_time_median": median,
        "step_time_p25": q[0],
        "step_time_p75": q[2],
        "step_time_min": min(per_step),
        "step_time_max": max(per_step),
        "tokens_per_s": tokens / median,
        "peak_rss": [r.peak_rss for r in ranks],
        "minor_faults_per_step": [r.minor_faults for r in ranks],
        "model_state": [r.model_state for r in ranks],
        "comm_counted": ranks[0].comm_counted,
        "comm_engine": ranks[0].comm_engine,
        "losses": losses,
        "final_loss": losses[-1],
        "threads": torch.get_num_threads(),
        "loadavg_1min": os.getloadavg()[0],  # other work on the machine while the row ran
    }


def write_json(path: str | os.PathLike[str], payload: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)
