"""Which modules of a Hugging Face decoder are split how, checked before anything is split.

[Note: autotp plan]
Hugging Face configs of Llama, Qwen2/3, Mistral (and others of the same shape) carry `base_model_tp_plan`, the
Megatron split of a decoder layer: q/k/v and gate/up projections "colwise" (output features sharded: each rank
computes num_heads / tp heads and intermediate_size / tp MLP features), o and down projections "rowwise" (input
features sharded, the partial outputs all-reduced). We map those names onto torch's `ColwiseParallel` /
`RowwiseParallel` and add the two vocabulary-sized tensors: the input embedding as a vocab-parallel embedding
(`RowwiseParallel(input_layouts=Replicate())`: rows of the table sharded, each rank looks up the tokens in its
range, the partial embeddings all-reduced) and `lm_head` column-parallel over the vocabulary, its logits gathered
(`output_layouts=Replicate()`) so the model's own loss runs unchanged. Attention reads its shapes from the
projections' outputs (`view(*input_shape, -1, head_dim)` in transformers 5), so local heads need no change. The
split needs every sharded size divisible by tp; anything else is refused before the model is touched.

[Note: vocab-parallel loss]
With `"tensor_parallel": {"loss_parallel": true}` (ours; DeepSpeed has no such key) `lm_head` keeps its logits
sharded over the vocabulary (`output_layouts=Shard(-1)`, DTensors) and the engine enters torch's `loss_parallel()`
around every forward and backward, so the model's own cross-entropy runs on the local vocabulary slice (a max and
a sum all-reduced over tp instead of all-gathering batch x sequence x vocabulary logits). The loss and the logits
the model returns are then DTensors (`loss.item()` works; `logits.full_tensor()` gathers them). Off by default:
code that reads the logits as plain tensors keeps working.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from zeroshard.errors import ConfigError

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
DIVIDED = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")


def hf_plan(model: nn.Module, tp: int, vocab_parallel_loss: bool = False) -> dict[str, ParallelStyle]:
    """The `parallelize_module` plan of a Hugging Face causal LM ([Note: autotp plan]); refuses what it cannot
    split."""
    config = getattr(model, "config", None)
    base_plan: dict[str, str] | None = getattr(config, "base_model_tp_plan", None)
    if not base_plan:
        raise ConfigError(
            f"tensor_parallel.autotp_size={tp}: {type(model).__name__} is not a Hugging Face model whose config has "
            "base_model_tp_plan (Llama, Qwen2/3, Mistral have one); pass such a model or set autotp_size to 1"
        )
    check_divisible(config, tp)
    if getattr(config, "tie_word_embeddings", False):
        raise ConfigError(
            f"tensor_parallel.autotp_size={tp} with tie_word_embeddings=True: the tied embedding and lm_head would "
            "be split twice; build the model with tie_word_embeddings=False or set autotp_size to 1"
        )
    unknown = sorted({style for style in base_plan.values() if style not in STYLES})
    if unknown:
        raise ConfigError(
            f"tensor_parallel.autotp_size={tp}: base_model_tp_plan uses {unknown}, which zeroshard does not map "
            f"(it maps {sorted(STYLES)}); set autotp_size to 1 for this model"
        )
    prefix = str(getattr(model, "base_model_prefix", "model"))
    base = model.get_submodule(prefix) if hasattr(model, prefix) else model
    head = f"{prefix}." if base is not model else ""
    plan: dict[str, ParallelStyle] = {f"{head}{key}": STYLES[style]() for key, style in base_plan.items()}
    if isinstance(getattr(base, "embed_tokens", None), nn.Embedding):
        plan[f"{head}embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
    if isinstance(getattr(model, "lm_head", None), nn.Linear):  # logits gathered, or vocab-sharded DTensors
        layout = Shard(-1) if vocab_parallel_loss else Replicate()
        plan["lm_head"] = ColwiseParallel(output_layouts=layout, use_local_output=not vocab_parallel_loss)
    return plan


def check_divisible(config: Any, tp: int) -> None:
    """Every size the plan shards divides by `tp` (one line naming the first that does not)."""
    for key in DIVIDED:
        value = getattr(config, key, None)
        if isinstance(value, int) and value % tp:
            raise ConfigError(
                f"tensor_parallel.autotp_size={tp} does not divide the model's {key}={value}: each tensor-parallel "
                f"rank needs a whole share; choose an autotp_size that divides {key}"
            )


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, vocab_parallel_loss: bool = False) -> None:
    """Split `model`'s parameters into DTensors over `tp_mesh` in place ([Note: autotp plan])."""
    parallelize_module(model, tp_mesh, hf_plan(model, tp_mesh.size(), vocab_parallel_loss))
