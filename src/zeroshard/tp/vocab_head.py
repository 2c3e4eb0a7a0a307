"""DeepSpeed's no-gather vocabulary-parallel LM head: `"tensor_parallel": {"vocab_parallel_lm_head": true}`.

[Note: vocabulary-parallel LM head]
DeepSpeed 0.19.8's AutoTP can leave the column-split output head's logits sharded over the vocabulary (its
`VocabParallelLinear`) and make the model's `loss_function` the vocabulary-parallel causal-LM loss
([Note: vocabulary-parallel cross entropy] in sequence/cross_entropy.py), so no rank ever holds batch x sequence x
vocabulary logits. zeroshard does the same: the head's plan entry keeps `output_layouts=Shard(-1)` but hands the
model a local tensor (`use_local_output`), and `model.loss_function` becomes a `VocabParallelCausalLMLoss` over the
engine's tensor-parallel collectives (counted with the engine's bytes). The model's `outputs.logits` are then this
rank's vocabulary slice, as in DeepSpeed (code that argmaxes them, generation among it, needs them gathered);
`outputs.loss` is the whole loss. The hook is checked before anything is split: a model without a writable
`loss_function` is refused in one line, as is a model with no column-split `lm_head`/`embed_out` (or more than one).
zeroshard's own `loss_parallel` keeps DTensor logits under torch's `loss_parallel()` instead; the two exclude each
other. `vocab_parallel_ce_backend: "liger"` runs the PyTorch loss with a warning (no Liger kernel here; DeepSpeed's
fallback where Liger cannot run).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from zeroshard.comm.collectives import Collectives
from zeroshard.errors import ConfigError
from zeroshard.sequence.cross_entropy import (
    VocabParallelCausalLMLoss,
    install_loss_function,
    validate_vocab_parallel_loss,
)

HEADS = ("lm_head", "embed_out")


def local_logits(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """`plan` with its vocabulary-sharded output head handing the model local logits; refuses a model whose loss
    hook cannot be replaced, and a plan without exactly one such head ([Note: vocabulary-parallel LM head])."""
    heads = [
        name
        for name, style in plan.items()
        if isinstance(style, ColwiseParallel) and style.output_layouts == (Shard(-1),) and not style.use_local_output
    ]  # the head the plan leaves vocabulary-sharded (other column layers hand on local tensors)
    if len(heads) != 1:
        found = f"found {heads}" if heads else "found none"
        raise ConfigError(
            "tensor_parallel.vocab_parallel_lm_head=true needs one column-split nn.Linear output head "
            f"({' or '.join(HEADS)}) with its logits left sharded, {found}; set vocab_parallel_lm_head false"
        )
    try:
        validate_vocab_parallel_loss(model)
    except ValueError as error:
        raise ConfigError(f"tensor_parallel.vocab_parallel_lm_head=true: {error}") from error
    out = dict(plan)
    out[heads[0]] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=True)
    return out


def install_vocab_parallel_loss(model: nn.Module, tp_comm: Collectives, block: Mapping[str, Any]) -> None:
    """Make `model.loss_function` the vocabulary-parallel causal-LM loss over the engine's tensor-parallel group
    (equal shards in rank order, as the column split makes them); the stock loss stays reachable as
    `model._deepspeed_original_loss_function`, as DeepSpeed keeps it."""
    loss_fn = VocabParallelCausalLMLoss(tp_group=tp_comm, backend=str(block.get("vocab_parallel_ce_backend", "torch")))
    previous = install_loss_function(model, loss_fn)
    if not hasattr(model, "_deepspeed_original_loss_function"):
        model._deepspeed_original_loss_function = previous
