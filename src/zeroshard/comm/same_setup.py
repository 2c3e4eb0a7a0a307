"""Every rank given the same ds_config and the same model, found out before any work.

[Note: ranks given different setups]
A launcher that hands each rank its own config file, or a script whose config or model depends on the rank, gives
ranks that disagree on what to do: one at stage 2 and one at stage 3 waited out the collective deadline and failed
with gloo's raw timeout; different `gradient_accumulation_steps` waited out the deadline too; a parameter shape that
differs at stage 2 aborted the process inside gloo; a different `lr` trained on with replicas drifting apart. DeepSpeed
checks none of it. `initialize` digests the config as given (before "auto" values are resolved, so that a rank
refused by its own config is compared too) and the model's parameter names, shapes and dtypes, and all-gathers the
two digests once; where any rank differs, a second gather names the first keys (or parameters) that differ and every
rank raises the same `ConfigError`. Left out where ranks differ by design: `nvme_path` (one drive per GPU), what rank
0 alone reads (the monitors' paths and names, the flops profile's file), and the model of a `PipelineModule` (each
stage its own layers) or one an mpu split.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from zeroshard.config import check_world
from zeroshard.errors import ConfigError

# what rank 0 alone reads (the monitors and the flops profile are rank 0's, as DeepSpeed's: a job name with the time
# in it differs by a second between ranks); their `enabled` flags are compared (opening the monitors is collective)
_RANK_0 = frozenset(
    [f"{block}.{key}" for block in ("tensorboard", "csv_monitor") for key in ("output_path", "job_name")]
    + [f"wandb.{key}" for key in ("group", "team", "project")]
    + [f"comet.{key}" for key in ("project", "workspace", "api_key", "experiment_name", "experiment_key", "online")]
    + ["comet.mode", "comet.samples_log_interval", "flops_profiler.output_file"]
)


def check_launched_world(parsed: Any, model: nn.Module, mpu: Any, world_size: int) -> None:
    """What the launched world must satisfy before any work: `check_world`'s rules, and every rank given the same
    config and model ([Note: ranks given different setups]). Collective over the default group."""
    check_world(parsed, world_size)
    if world_size == 1:
        return
    from zeroshard.pipe.module import PipelineModule

    config = {k: v for k, v in _flat(parsed.raw or {}).items() if not k.endswith("nvme_path") and k not in _RANK_0}
    # whether the flops profile goes to a file decides whether opening the monitors exchanges a flag: compared
    config["flops_profiler.output_file is set"] = str(bool(parsed.flops_profiler.output_file))
    shapes = {} if mpu is not None or isinstance(model, PipelineModule) else _shapes(model)
    mine = (_digest(config), _digest(shapes))
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    if all(d == everyone[0] for d in everyone):
        return
    details: list[Any] = [None] * world_size
    dist.all_gather_object(details, (config, shapes))
    raise ConfigError(_difference(details, everyone))


def _flat(raw: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in raw.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value, sort_keys=True, default=_kind)
    return out


def _kind(value: Any) -> str:
    """A value JSON cannot hold, compared by its type: its text may name its address, another on every rank."""
    return f"<{type(value).__qualname__}>"


def _shapes(model: nn.Module) -> dict[str, str]:
    return {name: f"{tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}" for name, p in model.named_parameters()}


def _digest(values: Mapping[str, str]) -> int:
    return zlib.crc32(json.dumps(sorted(values.items())).encode())


def _difference(details: list[Any], digests: list[Any]) -> str:
    """The first rank that differs from rank 0, and up to three keys or parameters where."""
    other = next(r for r, d in enumerate(digests) if d != digests[0])
    kind = 0 if digests[other][0] != digests[0][0] else 1
    ours, theirs = details[0][kind], details[other][kind]
    keys = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    shown = "; ".join(
        f"{k}: {ours.get(k, '(absent)')} on rank 0, {theirs.get(k, '(absent)')} on rank {other}" for k in keys[:3]
    )
    more = f" (and {len(keys) - 3} more)" if len(keys) > 3 else ""
    what = "ds_config" if kind == 0 else "model (parameter name: shape dtype)"
    return (
        f"rank {other} was given another {what} than rank 0: {shown}{more}; every rank must be given the same "
        "(a launcher passing each rank its own file, or a config or model that depends on the rank)"
    )
