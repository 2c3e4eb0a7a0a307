"""`deepspeed.runtime.activation_checkpointing`: its `checkpointing` module is `zeroshard.checkpointing` itself (one
module under both names, so the module globals DeepSpeed's tests save and restore are the same:
[Note: checkpointing module globals])."""

import sys

from zeroshard import checkpointing

sys.modules[__name__ + ".checkpointing"] = checkpointing

__all__ = ["checkpointing"]
