"""`deepspeed.sequence`: Ulysses sequence parallelism ([Note: sequence parallelism] in sequence/mesh.py)."""

from zeroshard.sequence.layer import DistributedAttention

__all__ = ["DistributedAttention"]
