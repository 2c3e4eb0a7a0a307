"""Process-group topology and the single collectives call site; `api` is `deepspeed.comm` for user scripts.

`init_distributed` here is DeepSpeed's (returns None); the strategies' set-up is `topology.init_distributed`,
which returns a `Topology`.
"""

from zeroshard.comm.api import *  # noqa: F403 - DeepSpeed's deepspeed.comm names, listed in api.__all__
from zeroshard.comm.api import __all__ as _api_names
from zeroshard.comm.collectives import Collectives, CommStats, Handle
from zeroshard.comm.topology import Topology

__all__ = ["Collectives", "CommStats", "Handle", "Topology", *_api_names]
