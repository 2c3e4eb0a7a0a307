"""ds_config presets in the shape of ms-swift's `swift/llm/ds_config/*.json`, with "auto" values.

The values a training command knows (micro batch, accumulation, learning rate, warm-up, total steps,
precision) are left "auto" and filled by `fill_auto`, as the Hugging Face Trainer's DeepSpeed
integration does; the bucket sizes stay "auto" for `initialize`, which knows the model's hidden size.
Unlike ms-swift's files every preset carries an AdamW + WarmupCosineLR block, because there is no
Trainer here to create them.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from zeroshard.config.batch import BATCH_KEYS
from zeroshard.config.parse import read_json_file
from zeroshard.config.resolve import canonical_path
from zeroshard.config.schema import ZeroshardConfig
from zeroshard.errors import ConfigError
from zeroshard.utils.logging import get_logger

_COMMON: Final[dict[str, Any]] = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupCosineLR",
        "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"},
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}

_BUCKETS_0_2: Final[dict[str, Any]] = {
    "allgather_partitions": True,
    "allgather_bucket_size": 2e8,
    "overlap_comm": True,
    "reduce_scatter": True,
    "reduce_bucket_size": 2e8,
    "contiguous_gradients": True,
}

_STAGE3: Final[dict[str, Any]] = {
    "stage": 3,
    "overlap_comm": True,
    "contiguous_gradients": True,
    "sub_group_size": 1e9,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
}

_CPU: Final[dict[str, Any]] = {"device": "cpu", "pin_memory": True}


def _preset(zero: dict[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType({**copy.deepcopy(_COMMON), "zero_optimization": zero})


DS_CONFIG_PRESETS: Final[Mapping[str, Mapping[str, Any]]] = MappingProxyType(
    {
        "zero0": _preset({"stage": 0, **_BUCKETS_0_2}),
        "zero1": _preset({"stage": 1, **_BUCKETS_0_2}),
        "zero2": _preset({"stage": 2, **_BUCKETS_0_2}),
        "zero2_offload": _preset({"stage": 2, "offload_optimizer": dict(_CPU), **_BUCKETS_0_2}),
        "zero3": _preset(dict(_STAGE3)),
        "zero3_offload": _preset({**_STAGE3, "offload_optimizer": dict(_CPU), "offload_param": dict(_CPU)}),
    }
)


def ds_config_preset(name: str) -> dict[str, Any]:
    """A fresh, mutable copy of the preset `name` (zero0, zero1, zero2, zero2_offload, zero3, zero3_offload)."""
    try:
        return copy.deepcopy(dict(DS_CONFIG_PRESETS[name]))
    except KeyError:
        raise ConfigError(f"unknown ds_config preset {name!r}; presets are {', '.join(DS_CONFIG_PRESETS)}") from None


def load_ds_config(name_or_path: str | os.PathLike[str]) -> dict[str, Any]:
    """A preset by name, or the JSON object in a file."""
    text = os.fspath(name_or_path)
    if text in DS_CONFIG_PRESETS:
        return ds_config_preset(text)
    if not os.path.exists(text):
        presets = ", ".join(DS_CONFIG_PRESETS)
        raise ConfigError(f"ds_config {text!r} is neither a file nor a preset; use a JSON file or one of {presets}")
    return read_json_file(text, get_logger("zeroshard.config"))


def fill_auto(config: Mapping[str, Any], known: Mapping[str, object]) -> dict[str, Any]:
    """A copy of `config` where every "auto" whose dotted path is in `known` takes that value.

    Paths are matched in their canonical spelling (`bfloat16.enabled` matches `bf16.enabled`). When
    the config gives no batch size as a number, missing batch keys are added from `known` too, so the
    batch triple can be completed. Values the config sets explicitly are never replaced; "auto" values
    not in `known` stay for `initialize` (bucket sizes from the model's hidden size, DeepSpeed defaults).
    """
    out = _fill(config, "", {canonical_ds_path(k): v for k, v in known.items() if v is not None})
    for key in missing_batch_keys(config):
        if known.get(key) is not None:
            out[key] = known[key]
    return out


def missing_batch_keys(config: Mapping[str, Any]) -> list[str]:
    """Batch keys absent from `config`, when it sets none of them to a number (else the config decides)."""
    if any(config.get(key) not in (None, "auto") for key in BATCH_KEYS):
        return []
    return [key for key in BATCH_KEYS if key not in config]


def canonical_ds_path(path: str) -> str:
    """`canonical_path`, plus DeepSpeed's renamed top-level blocks (`bfloat16` is `bf16`)."""
    head, sep, rest = path.partition(".")
    for moved in ZeroshardConfig.MOVED:
        if moved.old == head and len(moved.new) == 1:
            head = moved.new[0]
    return canonical_path(head + sep + rest)


def _fill(node: Mapping[str, Any], path: str, known: Mapping[str, object]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        here = f"{path}.{key}" if path else key
        if isinstance(value, Mapping):
            out[key] = _fill(value, here, known)
        elif value == "auto" and canonical_ds_path(here) in known:
            out[key] = known[canonical_ds_path(here)]
        else:
            out[key] = copy.deepcopy(value)
    return out
