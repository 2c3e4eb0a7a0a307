"""Small shared helpers, and `deepspeed.utils`'s names for scripts run with `import zeroshard as deepspeed`:
`logger`, `log_dist`, `RepeatingLoader`, `groups`."""

from zeroshard.utils import groups
from zeroshard.utils.logging import log_dist, logger
from zeroshard.utils.repeating import RepeatingLoader

__all__ = ["RepeatingLoader", "groups", "log_dist", "logger"]
