"""Process-group topology and the single collectives call site."""

from zeroshard.comm.collectives import Collectives, CommStats, Handle
from zeroshard.comm.topology import Topology, init_distributed

__all__ = ["Collectives", "CommStats", "Handle", "Topology", "init_distributed"]
