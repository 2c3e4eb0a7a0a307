"""`deepspeed.sequence`: Ulysses sequence parallelism ([Note: sequence parallelism] in sequence/mesh.py) and the
losses over vocabulary-sharded logits ([Note: vocabulary-parallel cross entropy] in sequence/cross_entropy.py)."""

from zeroshard.sequence.cross_entropy import (
    VocabParallelCausalLMLoss,
    VocabParallelCrossEntropyLoss,
    configure_vocab_parallel_loss,
    vocab_parallel_cross_entropy,
)
from zeroshard.sequence.layer import DistributedAttention

__all__ = [
    "DistributedAttention",
    "VocabParallelCausalLMLoss",
    "VocabParallelCrossEntropyLoss",
    "configure_vocab_parallel_loss",
    "vocab_parallel_cross_entropy",
]
