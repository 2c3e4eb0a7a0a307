"""Small shared helpers, and `deepspeed.utils`'s names for scripts run with `import zeroshard as deepspeed`:
`logger`, `log_dist`, `instrument_w_nvtx`, `OnDevice`, `RepeatingLoader`, `groups`, `safe_get_full_*` /
`safe_set_full_*` and `safe_update_full_grad_vectorized` (every stage), `safe_*_local_*` (stage 3), and the ZeRO-3
leaf-module marks (`set_z3_leaf_modules` and its relatives). `zero_to_fp32` and `zero_to_torch` (the checkpoint
consolidation under DeepSpeed's module paths) and `timer` (`SynchronizedWallClockTimer`, `ThroughputTimer`) are
submodules, imported on first use."""

from zeroshard.utils import groups
from zeroshard.utils.init_on_device import OnDevice
from zeroshard.utils.logging import log_dist, logger
from zeroshard.utils.nvtx import instrument_w_nvtx
from zeroshard.utils.repeating import RepeatingLoader
from zeroshard.utils.tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)
from zeroshard.utils.z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
)

__all__ = [
    "OnDevice",
    "RepeatingLoader",
    "get_z3_leaf_modules",
    "groups",
    "instrument_w_nvtx",
    "log_dist",
    "logger",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "timer",
    "unset_z3_leaf_modules",
    "zero_to_fp32",
    "zero_to_torch",
    "z3_leaf_module",
]


def __getattr__(name: str) -> object:
    # `deepspeed.utils.zero_to_fp32.get_...`, `deepspeed.utils.timer....`, without importing the checkpoint and
    # monitor code early
    if name in ("zero_to_fp32", "zero_to_torch", "timer"):
        import importlib

        return importlib.import_module(f"zeroshard.utils.{name}")
    raise AttributeError(f"module 'zeroshard.utils' has no attribute {name!r}")
