"""ZeRO strategies (layout, flat buffers, stage 1/2 optimizer, stage3/), and `deepspeed.zero`'s public names:
`Init`, `GatheredParameters`, `register_external_parameter`, `unregister_external_parameter`, `ZeroParamStatus`,
`unwrap_model_for_generation`.

The names are loaded on first use: the strategies import this package, and the public names import them.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "Init": "zeroshard.zero.deepspeed_api",
    "register_external_parameter": "zeroshard.zero.deepspeed_api",
    "unregister_external_parameter": "zeroshard.zero.deepspeed_api",
    "GatheredParameters": "zeroshard.zero.stage3.gathered",
    "ZeroParamStatus": "zeroshard.zero.stage3.ds_param",
    "unwrap_model_for_generation": "zeroshard.zero.deepspeed_api",
}


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'zeroshard.zero' has no attribute {name!r}")


__all__ = sorted(_PUBLIC)
