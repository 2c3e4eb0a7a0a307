"""The monitor backends a config enables, opened before `initialize` touches the model, failing on every rank.

[Note: monitors open first]
DeepSpeed builds its monitors inside the engine, on rank 0, after the model was moved and partitioned: a wandb
without a login or an output_path that cannot be written is an exception from the backend, late, raised on rank 0
alone while the other ranks go on into the next collective and wait there until its timeout. Here `initialize`
opens them before any work on the model (right after the process group's collectives exist) and the engine is
handed what was opened:
- every rank checks that the packages the enabled blocks need import; rank 0 (DeepSpeed's one writer) then builds
  the backends, each of which turns what keeps it from starting into one `ConfigError` line naming its block and
  what to do: an output directory that cannot be created or written to (`<block>.output_path`, base.py), wandb
  without an API key or a `wandb.init` that fails, Comet online without an API key or a `comet_ml.start` that
  fails (value checks needing no environment, such as `comet.mode`, are the schema's: config/monitor.py);
- with more than one rank, and only when a monitor block is enabled (the config is every rank's), the ranks then
  learn whether any of them failed: one MIN all-reduce of "the first rank that failed" and, after a failure, that
  rank's message broadcast as bytes. The failing rank raises its own error, every other rank a `ConfigError` with
  the same line and the rank it came from, before any heavy collective;
- if `initialize` fails later on, the monitors opened stay open (their runs end when the process does).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from zeroshard.comm.collectives import Collectives
from zeroshard.errors import ConfigError
from zeroshard.monitor.base import Monitor, writable_file
from zeroshard.monitor.comet import CometMonitor
from zeroshard.monitor.csv_monitor import CSVMonitor
from zeroshard.monitor.tensorboard import TensorBoardMonitor
from zeroshard.monitor.wandb import WandbMonitor

MONITOR_BLOCKS = ("tensorboard", "csv_monitor", "wandb", "comet")
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}  # block -> the package it needs
_MESSAGE_BYTES = 1024  # of a failure's line sent to the other ranks (longer ones are cut)


def monitor_blocks_enabled(config: Any) -> bool:
    """Whether any monitor block of `config` (a ZeroshardConfig) is enabled: DeepSpeed's `monitor.enabled`."""
    return any(getattr(config, block).enabled for block in MONITOR_BLOCKS)


def monitors_enabled(config: Any) -> bool:
    """Whether `initialize` opens anything: a monitor block, or the FLOPs profiler's file (rank 0 writes it at
    `profile_step`: its folder is checked here too)."""
    flops = config.flops_profiler
    return monitor_blocks_enabled(config) or bool(flops.enabled and flops.output_file)


def check_packages(config: Any) -> None:
    """One line naming the block and the package it needs, for the first enabled block whose package is missing."""
    for block, package in _PACKAGES.items():
        if getattr(config, block).enabled and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{block}.enabled needs the {package} package: pip install {package}")


def build_monitors(config: Any) -> list[Monitor]:
    """The enabled backends of `config` (a ZeroshardConfig or a DeepSpeedMonitorConfig), in DeepSpeed's order
    (MonitorMaster's); those built are closed again if a later one fails."""
    builders = (
        (config.tensorboard, TensorBoardMonitor),
        (config.wandb, WandbMonitor),
        (config.csv_monitor, CSVMonitor),
        (config.comet, CometMonitor),
    )
    monitors: list[Monitor] = []
    try:
        for block, build in builders:
            if block.enabled:
                monitors.append(build(block))
    except BaseException:
        for monitor in monitors:
            monitor.close()
        raise
    return monitors


def open_monitors(config: Any, comm: Collectives, rank: int, device: torch.device) -> list[Monitor]:
    """The backends on global `rank` 0, none elsewhere; a failure on any rank of `comm` raises on all of them
    ([Note: monitors open first]). `device`: where the exchange's tensors go (the process group's device)."""
    if not monitors_enabled(config):
        return []
    monitors: list[Monitor] = []
    failure: BaseException | None = None
    try:
        check_packages(config)
        if rank == 0:
            flops = config.flops_profiler
            if flops.enabled and flops.output_file:
                writable_file(str(flops.output_file), "flops_profiler.output_file")
            monitors = build_monitors(config)
    except Exception as e:  # noqa: BLE001 - every rank hears of it below, then it is raised here
        failure = e
    shared = _first_failure(failure, comm, device)
    if shared is None:
        return monitors
    for monitor in monitors:  # another rank failed: this one stops too
        monitor.close()
    if failure is not None:
        raise failure
    raise shared


def _first_failure(failure: BaseException | None, comm: Collectives, device: torch.device) -> ConfigError | None:
    """The first failing rank's message, on every rank of `comm` (one small all-reduce when none failed)."""
    if comm.world_size == 1:
        return ConfigError(str(failure)) if failure is not None else None
    first = torch.tensor([comm.rank if failure is not None else comm.world_size], dtype=torch.int64, device=device)
    comm.all_reduce(first, op="min", label="monitors opened")
    source = int(first.item())
    if source == comm.world_size:
        return None
    text = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8, device=device)
    if failure is not None and source == comm.rank:
        raw = (str(failure) or type(failure).__name__).encode()[:_MESSAGE_BYTES]
        text[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    comm.broadcast(text, src=comm.global_rank(source), label="monitor failure")
    message = bytes(text.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
    return ConfigError(f"{message} (on rank {source}; every rank stops)")
