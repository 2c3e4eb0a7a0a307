"""Small shared helpers, and `deepspeed.utils`'s names for scripts run with `import zeroshard as deepspeed`:
`logger`, `log_dist`, `RepeatingLoader`, `groups`, and `safe_get_full_*` / `safe_set_full_*` (every stage)."""

from zeroshard.utils import groups
from zeroshard.utils.logging import log_dist, logger
from zeroshard.utils.repeating import RepeatingLoader
from zeroshard.utils.tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)

__all__ = [
    "RepeatingLoader",
    "groups",
    "log_dist",
    "logger",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
]
