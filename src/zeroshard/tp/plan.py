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
Models whose attention slices a fused projection by the config's sizes (Phi-3's qkv_proj, OLMo-2) say
"colwise_gather_output" (`ColwiseParallel(output_layouts=Replicate())`: the output slices all-gathered) and
"rowwise_split_input" (`RowwiseParallel(input_layouts=Replicate())`: each rank takes its slice of a whole input);
"colwise_rep" is transformers' older name of the first. GPT-NeoX's "embedding_rowwise" is the vocab-parallel
embedding above. Other styles (packed experts, `local_*`) are refused.

[Note: replicated with grad all-reduce]
Qwen3 and Gemma3 normalize each attention head's q and k (`q_norm`, `k_norm`: RMSNorm over head_dim) after the
column-parallel projections, so each tensor-parallel rank applies the whole norm weight to its own heads and gets a
partial gradient: "replicated_with_grad_allreduce". Left as plain parameters the ranks' weights would drift apart
after the first step (and ZeRO would reduce them over dp only). torch's DTensor does the sum: the weight becomes a
replicated DTensor and the norm's input a DTensor sharded on its heads dimension (-2 of `(..., heads, head_dim)`),
so the norm runs locally (it reduces over the last dimension only) and autograd sums the weight's gradient over tp,
as `SequenceParallel` does for a norm over sequence shards. The output goes back to a local tensor.

[Note: fused sub-parameters]
A fused weight (Phi-3's qkv_proj or gate_up_proj, ChatGLM's query_key_value) stacks equal parts along its output
features; a plain column split would give rank 0 all of `gate` and rank 1 all of `up`. DeepSpeed's layer specs say
`"shape": [k, -1]` (or `[[s, s, ...], -1]`): each rank holds its slice of every part, side by side, so the model's
own `chunk(k)` of the local output yields this rank's slice of each part. torch names that layout
`_StridedShard(0, split_factor=k)`: DTensor's matmul rules carry it to the output (`_StridedShard(-1, k)`) and to the
weight's gradient, `full_tensor()` rebuilds the weight in its own order (exports, accelerate's state dict), and
`gather_output` all-gathers the output back into the original order (for attention that slices q/k/v by the
config's sizes). Checkpoint slices record the parts (`extra["tensor_parallel_blocks"]`) so a load into another
autotp_size reassembles each part ([Note: tensor-parallel resharding]). Parts of unequal sizes (a grouped-query
q/k/v) have no such placement and are refused.

[Note: vocab-parallel loss]
With `"tensor_parallel": {"loss_parallel": true}` (ours; DeepSpeed has no such key) `lm_head` keeps its logits
sharded over the vocabulary (`output_layouts=Shard(-1)`, DTensors) and the engine enters torch's `loss_parallel()`
around every forward and backward, so the model's own cross-entropy runs on the local vocabulary slice (a max and
a sum all-reduced over tp instead of all-gathering batch x sequence x vocabulary logits). The loss and the logits
the model returns are then DTensors (`loss.item()` works; `logits.full_tensor()` gathers them). Off by default:
code that reads the logits as plain tensors keeps working.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from zeroshard.errors import ConfigError


class ReplicatedOverHeads(ParallelStyle):
    """[Note: replicated with grad all-reduce] A module whose parameters every tensor-parallel rank holds whole but
    applies to its own heads: the parameters become replicated DTensors and the input a DTensor sharded on dim -2,
    so its computation over the last dim runs locally and the parameters' gradients are summed over tp."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, _replicate_params, _heads_input, _local_output)  # type: ignore[arg-type]


def _replicate_params(name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
    for p_name, param in module.named_parameters(recurse=False):  # equal on every rank: built from one seed/file
        replicated = DTensor.from_local(param.detach(), device_mesh, [Replicate()], run_check=False)
        module.register_parameter(p_name, nn.Parameter(replicated, requires_grad=param.requires_grad))


def _heads_input(module: nn.Module, inputs: tuple[Any, ...], device_mesh: DeviceMesh) -> tuple[Any, ...]:
    x = inputs[0] if inputs else None  # (a keyword-only call brings no positional input)
    if not isinstance(x, torch.Tensor) or isinstance(x, DTensor) or x.dim() < 2:
        raise ConfigError(
            f"replicated_with_grad_allreduce: {type(module).__name__} got {type(x).__name__} "
            f"{tuple(getattr(x, 'shape', ()))}; zeroshard maps this style for norms over a rank's heads "
            "(..., heads, head_dim): set autotp_size to 1 for this model"
        )
    return (DTensor.from_local(x, device_mesh, [Shard(x.dim() - 2)], run_check=False), *inputs[1:])


def _local_output(module: nn.Module, output: Any, device_mesh: DeviceMesh) -> Any:
    return output.to_local() if isinstance(output, DTensor) else output


class BlockColwiseParallel(ColwiseParallel):
    """[Note: fused sub-parameters] A column-parallel layer whose output features are `blocks` equal parts (a fused
    q/k/v or gate/up weight): each rank holds its slice of every part, `_StridedShard(0, split_factor=blocks)`, and
    its output is its slices side by side (the layout the model's `chunk` expects), or the whole output in the
    original order with `gather`."""

    def __init__(self, blocks: int, gather: bool = False):
        super().__init__(output_layouts=Replicate() if gather else None)
        self.blocks, self.gather = blocks, gather

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        placement = _StridedShard(0, split_factor=self.blocks)
        for p_name, param in module.named_parameters(recurse=False):
            split = distribute_tensor(param.detach(), device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(p_name, nn.Parameter(split, requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        inputs = partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts)
        return distribute_module(module, device_mesh, self._partition_linear_fn, inputs, self._blocks_output)  # type: ignore[arg-type]

    def _blocks_output(self, module: nn.Module, output: DTensor, device_mesh: DeviceMesh) -> torch.Tensor:
        if self.gather:  # the parts' slices of every rank back in the weight's order
            return output.redistribute(placements=[Replicate()]).to_local()
        return output.to_local()  # (its strided placement already says what the rank holds)


STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": partial(ColwiseParallel, output_layouts=Replicate()),
    "colwise_rep": partial(ColwiseParallel, output_layouts=Replicate()),  # transformers' older name
    "rowwise_split_input": partial(RowwiseParallel, input_layouts=Replicate()),
    "embedding_rowwise": partial(RowwiseParallel, input_layouts=Replicate()),  # GPT-NeoX's vocab-parallel embed_in
    "replicated_with_grad_allreduce": ReplicatedOverHeads,
}
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


def model_plan(
    model: nn.Module, tp: int, block: Mapping[str, Any] | None = None, vocab_parallel_loss: bool = False
) -> dict[str, ParallelStyle]:
    """The plan of `model` under the `tensor_parallel` block: its layer specs where it has `partition_config` or
    `preset_model` ([Note: autotp layer specs] in tp/specs.py), else the Hugging Face plan ([Note: autotp plan])."""
    from zeroshard.tp.specs import partition_config_of, spec_plan

    specs = partition_config_of(dict(block or {}), tp)
    if specs is not None:
        return spec_plan(model, tp, specs, vocab_parallel_loss)
    return hf_plan(model, tp, vocab_parallel_loss)


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    vocab_parallel_loss: bool = False,
    plan: Mapping[str, ParallelStyle] | None = None,
) -> None:
    """Split `model`'s parameters into DTensors over `tp_mesh` in place, by `plan` (the Hugging Face plan when
    None, [Note: autotp plan])."""
    chosen = dict(plan) if plan is not None else hf_plan(model, tp_mesh.size(), vocab_parallel_loss)
    parallelize_module(model, tp_mesh, chosen)
