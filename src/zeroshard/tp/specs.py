"""DeepSpeed's AutoTP layer specs: `tensor_parallel.partition_config` and `tensor_parallel.preset_model`.

[Note: autotp layer specs]
For a model without (or against) a Hugging Face `base_model_tp_plan`, DeepSpeed's AutoTP takes regex patterns over
parameter names: `{"patterns": [".*\\.o_proj\\.weight$"], "partition_type": "row"}`. Each module with a 2-D weight
is matched by `<module name>.weight` against the specs in order (the first match wins; `re.match`, so a pattern
names the whole prefix, usually `.*`), restricted to `model_types` (the model's `config.model_type`) where given:
- "column": `ColwiseParallel` (output features split; `gather_output`: the output slices all-gathered);
- "row": `RowwiseParallel` (input features split, partial outputs all-reduced; an output head named in
  `lm_head_patterns` takes a whole input and splits it, DeepSpeed's row-parallel head);
- "skip": left whole; with `grad_allreduce` (any parameter it matches, 1-D too) the module is a norm over the rank's
  heads and its gradients are summed over tp ([Note: replicated with grad all-reduce] in tp/plan.py): all of that
  module's own parameters (DeepSpeed sums only the matched ones; a norm has one).
Modules no spec matches stay whole (`strict_mode`: refused instead, for `nn.Linear`); specs that split nothing are
refused, and an empty `partition_config` is none (DeepSpeed's reading). transformers' Phi-3 attention reads q/k/v at
the config's full sizes, so its qkv_proj split without `gather_output` (DeepSpeed's phi3 preset) is refused. A
split output head must gather its logits (`gather_output`) or keep them vocabulary-sharded under `loss_parallel`. A
column spec's `shape` of k equal parts splits a fused weight part by part ([Note: fused sub-parameters] in
tp/plan.py). A split embedding, a split tied weight, sizes tp does not divide and the other sub-parameter layouts
(unequal parts, row layers, 3-D views) are refused before the model is touched, naming the parameter.
`preset_model` is DeepSpeed's spec list for a model family; with `partition_config` and `use_default_specs`
(default true) the custom specs come first, then the preset's. Either one replaces the Hugging Face plan, as in
DeepSpeed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from zeroshard.config.parse import misspelt
from zeroshard.errors import ConfigError

PARTITION_KEYS = {"layer_specs", "use_default_specs", "strict_mode", "lm_head_patterns", "embedding_partition_dim"}
PARTITION_KEYS |= {"tp_size"}
SPEC_KEYS = {"patterns", "partition_type", "gather_output", "grad_allreduce", "shape", "partition_dim", "model_types"}
TYPES = ("column", "row", "skip")
LM_HEADS = ("lm_head", "embed_out")


@dataclass(frozen=True)
class LayerSpec:
    """One entry of `layer_specs` ([Note: autotp layer specs]), checked."""

    patterns: tuple[re.Pattern[str], ...]
    partition_type: str
    gather_output: bool = False
    grad_allreduce: bool = False
    model_types: tuple[str, ...] | None = None
    blocks: int = 1  # equal parts of the output features split one by one ([Note: fused sub-parameters])
    rows: int | None = None  # the rows the parts add up to, where the shape names their sizes

    def matches(self, name: str, model_type: str | None) -> bool:
        if self.model_types is not None and (model_type or "").lower() not in self.model_types:
            return False
        return any(p.match(name) for p in self.patterns)


@dataclass(frozen=True)
class PartitionConfig:
    specs: tuple[LayerSpec, ...]
    strict_mode: bool = False
    lm_head_patterns: tuple[str, ...] = LM_HEADS
    custom: bool = False  # from partition_config (else preset_model alone)

    def find(self, name: str, model_type: str | None) -> LayerSpec | None:
        return next((s for s in self.specs if s.matches(name, model_type)), None)


def _col(*patterns: str, **extra: Any) -> dict[str, Any]:
    return {"patterns": list(patterns), "partition_type": "column", **extra}


def _row(*patterns: str) -> dict[str, Any]:
    return {"patterns": list(patterns), "partition_type": "row"}


def _skip(*patterns: str) -> dict[str, Any]:
    return {"patterns": list(patterns), "partition_type": "skip"}


_ATTN = [_row(r".*\.self_attn\.o_proj\.weight$"), _col(r".*\.self_attn\.[qkv]_proj\.weight$")]
_MLP = [_row(r".*\.mlp\.down_proj\.weight$"), _col(r".*\.mlp\.(up|gate)_proj\.weight$")]
_FUSED = {"partition_dim": 0}
# DeepSpeed's presets (module_inject/autotp_config.py): the module names of each family's Hugging Face models
PRESETS: dict[str, list[dict[str, Any]]] = {
    "llama": _ATTN + _MLP,
    "qwen2": _ATTN + _MLP,
    "bloom": [
        _row(r".*\.self_attention\.dense\.weight$"),
        _col(r".*\.self_attention\.query_key_value\.weight$"),
        _row(r".*\.mlp\.dense_4h_to_h\.weight$"),
        _col(r".*\.mlp\.dense_h_to_4h\.weight$"),
    ],
    "chatglm": [
        _row(r".*\.self_attention\.dense\.weight$"),
        _col(r".*\.self_attention\.query_key_value\.weight$", shape=[3, -1], **_FUSED),
        _row(r".*\.mlp\.dense_4h_to_h\.weight$"),
        _col(r".*\.mlp\.dense_h_to_4h\.weight$", shape=[2, -1], **_FUSED),
    ],
    "mixtral": _ATTN
    + [
        _row(r".*\.block_sparse_moe\.experts\.\d+\.w2\.weight$"),
        _col(r".*\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$"),
        _skip(r".*\.block_sparse_moe\.gate\.weight$"),
    ],
    "deepseek_v2": [
        _row(r".*\.self_attn\.o_proj\.weight$"),
        _skip(r".*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$"),
        _col(r".*\.self_attn\.(q_b_proj|kv_b_proj)\.weight$"),
        _row(r".*\.mlp\.experts\.\d+\.down_proj\.weight$"),
        _col(r".*\.mlp\.experts\.\d+\.(up|gate)_proj\.weight$"),
        _skip(r".*\.mlp\.gate\.weight$"),
        _row(r".*\.mlp\.shared_experts\.down_proj\.weight$"),
        _col(r".*\.mlp\.shared_experts\.(up|gate)_proj\.weight$"),
    ],
    "phi3": [
        _row(r".*\.self_attn\.o_proj\.weight$"),
        _col(r".*\.self_attn\.qkv_proj\.weight$", shape=[3, -1], **_FUSED),
        _row(r".*\.mlp\.down_proj\.weight$"),
        _col(r".*\.mlp\.gate_up_proj\.weight$", shape=[2, -1], **_FUSED),
    ],
}


def partition_config_of(block: Mapping[str, Any], tp: int) -> PartitionConfig | None:
    """The specs of `tensor_parallel`'s `partition_config` and `preset_model` (None: neither, the Hugging Face plan
    applies), every key checked."""
    # an empty partition_config is none, as DeepSpeed reads it (`if partition_config:`)
    preset, custom = block.get("preset_model"), block.get("partition_config") or None
    if preset is None and custom is None:
        return None
    if preset is not None and (not isinstance(preset, str) or preset.lower() not in PRESETS):
        raise ConfigError(f"tensor_parallel.preset_model={preset!r}: expected one of {sorted(PRESETS)} or null")
    preset_specs = PRESETS[preset.lower()] if preset is not None else []
    if custom is None:
        return PartitionConfig(_specs(preset_specs, f"tensor_parallel.preset_model={preset!r}"))
    if not isinstance(custom, Mapping):
        raise ConfigError(f"tensor_parallel.partition_config: expected an object, got {type(custom).__name__}")
    path = "tensor_parallel.partition_config"
    unknown = sorted(set(custom) - PARTITION_KEYS)
    if unknown:
        raise ConfigError(misspelt(path, unknown, PARTITION_KEYS) or f"{path}: unknown keys {unknown}")
    if custom.get("embedding_partition_dim", 1) != 1:
        raise ConfigError(
            f"{path}.embedding_partition_dim={custom['embedding_partition_dim']!r}: DeepSpeed reads but never uses it "
            "(embeddings are split only by a layer spec); remove it"
        )
    if custom.get("tp_size", tp) not in (1, tp):
        raise ConfigError(f"{path}.tp_size={custom['tp_size']!r} differs from autotp_size={tp}; remove it")
    given = custom.get("layer_specs", [])
    if not isinstance(given, Sequence) or isinstance(given, str):
        raise ConfigError(f"{path}.layer_specs: expected a list of specs, got {type(given).__name__}")
    merged = list(given) + (preset_specs if _flag(custom, "use_default_specs", True, path) else [])
    heads = custom.get("lm_head_patterns", list(LM_HEADS))
    if not isinstance(heads, Sequence) or isinstance(heads, str) or not all(isinstance(h, str) for h in heads):
        raise ConfigError(f"{path}.lm_head_patterns={heads!r}: expected a list of module names")
    strict = _flag(custom, "strict_mode", False, path)
    return PartitionConfig(_specs(merged, f"{path}.layer_specs"), strict, tuple(heads) or LM_HEADS, custom=True)


def _flag(block: Mapping[str, Any], key: str, default: bool, path: str) -> bool:
    value = block.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{path}.{key}={value!r}: expected true or false")
    return value


def _specs(given: Sequence[Any], path: str) -> tuple[LayerSpec, ...]:
    return tuple(_spec(entry, f"{path}[{i}]") for i, entry in enumerate(given))


def _spec(entry: Any, path: str) -> LayerSpec:
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{path}: expected an object with patterns and partition_type, got {type(entry).__name__}")
    unknown = sorted(set(entry) - SPEC_KEYS)
    if unknown:
        raise ConfigError(misspelt(path, unknown, SPEC_KEYS) or f"{path}: unknown keys {unknown}")
    kind = str(entry.get("partition_type", "column")).lower()
    if kind not in TYPES:
        raise ConfigError(f"{path}.partition_type={entry.get('partition_type')!r}: expected one of {list(TYPES)}")
    patterns = entry.get("patterns")
    if not isinstance(patterns, Sequence) or isinstance(patterns, str) or not patterns:
        raise ConfigError(f"{path}.patterns: expected a non-empty list of regular expressions over parameter names")
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except (re.error, TypeError) as e:
            raise ConfigError(f"{path}.patterns: {pattern!r} is not a regular expression ({e})") from e
    blocks, rows = _blocks(entry.get("shape"), kind, entry.get("partition_dim"), path)
    default_dim = {"column": 0, "row": 1}.get(kind)
    if entry.get("partition_dim") not in (None, default_dim):
        raise ConfigError(
            f"{path}.partition_dim={entry['partition_dim']!r}: a {kind} layer splits dim {default_dim} of its 2-D "
            "weight; other dims need a shape, which is not implemented"
        )
    gather, grad_allreduce = _flag(entry, "gather_output", False, path), _flag(entry, "grad_allreduce", False, path)
    if gather and kind != "column" or grad_allreduce and kind != "skip":
        raise ConfigError(f"{path}: gather_output belongs to column specs and grad_allreduce to skip specs")
    types = entry.get("model_types")
    if types is not None and (isinstance(types, str) or not isinstance(types, Sequence)):
        raise ConfigError(f"{path}.model_types={types!r}: expected a list of config.model_type names")
    lowered = tuple(str(t).lower() for t in types) if types else None  # [] restricts nothing, as in DeepSpeed
    return LayerSpec(tuple(compiled), kind, gather, grad_allreduce, lowered, blocks, rows)


def _blocks(shape: Any, kind: str, partition_dim: Any, path: str) -> tuple[int, int | None]:
    """The equal parts a column spec's `shape` cuts the output features into ([Note: fused sub-parameters]): `[n,
    -1]` or `[[s, s, ...], -1]` (then also the rows they add up to); 1 without a shape. Other shapes are refused."""
    if shape is None:
        return 1, None
    first = shape[0] if isinstance(shape, Sequence) and not isinstance(shape, str) and len(shape) == 2 else None
    ok = isinstance(first, int) and not isinstance(first, bool) and first > 0 and shape[1] == -1
    sizes = list(first) if isinstance(first, Sequence) and not isinstance(first, str) else None
    if kind != "column" or partition_dim not in (None, 0) or not (ok or sizes and shape[1] == -1):
        raise ConfigError(
            f"{path}.shape={shape!r}: zeroshard splits a column layer's output features into equal parts ([n, -1] or "
            "[[s, s, ...], -1] with partition_dim 0); other sub-parameter layouts (row layers, 3-D views) are not "
            "implemented"
        )
    valid = sizes is not None and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes)
    if sizes is not None and (not valid or len(set(sizes)) != 1):
        raise ConfigError(
            f"{path}.shape={shape!r}: parts of unequal sizes (a grouped-query q/k/v) are not implemented; split such "
            "a layer by the model's Hugging Face plan (colwise_gather_output) or skip it"
        )
    if sizes is not None:
        return len(sizes), sum(sizes)
    return int(first), None  # type: ignore[arg-type]


def spec_plan(
    model: nn.Module, tp: int, config: PartitionConfig, vocab_parallel_loss: bool = False
) -> dict[str, ParallelStyle]:
    """The `parallelize_module` plan the specs give `model` ([Note: autotp layer specs]); refuses what it cannot
    split."""
    from zeroshard.tp.plan import ReplicatedOverHeads

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    plan: dict[str, ParallelStyle] = {}
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        spec = config.find(f"{name}.weight", model_type) if isinstance(weight, torch.Tensor) else None
        if weight is not None and weight.dim() == 2 and spec is not None and spec.partition_type != "skip":
            if owners[id(weight)] > 1:
                raise ConfigError(
                    f"tensor_parallel.partition_config: {name}.weight is shared with another module (tied "
                    "embeddings): splitting it would split the other too; skip it or untie the weights"
                )
            if model_type == "phi3" and name.endswith("self_attn.qkv_proj") and not spec.gather_output:
                raise ConfigError(  # (DeepSpeed's phi3 preset: it fails at the first forward)
                    f"tensor_parallel.partition_config: {name}.weight: transformers' Phi-3 attention reads q, k and v "
                    "at the config's full sizes, so a split qkv_proj needs gather_output true (o_proj then whole); "
                    "or split Phi-3 by its own tp_plan (no partition_config or preset_model)"
                )
            plan[name] = _style(name, module, weight, spec, tp, config, vocab_parallel_loss)
            continue
        if weight is not None and weight.dim() == 2 and spec is None and config.strict_mode:
            if isinstance(module, nn.Linear):
                raise ConfigError(
                    f"tensor_parallel.partition_config.strict_mode: no layer spec matches {name}.weight; add one "
                    '(partition_type "skip" keeps it whole) or set strict_mode false'
                )
        own = [f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False)]
        specs = [config.find(p, model_type) for p in own]
        if any(s is not None and s.grad_allreduce for s in specs):
            plan[name] = ReplicatedOverHeads()
    vocab_heads = [
        n for n, s in plan.items() if _is_head(n, config) and getattr(s, "output_layouts", ()) == (Shard(-1),)
    ]
    if vocab_parallel_loss and not vocab_heads:
        raise ConfigError(
            "tensor_parallel.loss_parallel (or vocab_parallel_lm_head) true needs the output head split "
            "column-wise with its logits left sharded; add a column spec for it without gather_output, or set the key "
            "false"
        )
    if not any(isinstance(s, ColwiseParallel | RowwiseParallel) for s in plan.values()):
        given = "preset_model" if not config.custom else "partition_config.layer_specs"
        raise ConfigError(
            f"tensor_parallel.{given}: no layer of this {model_type or type(model).__name__} model matches a column or "
            f"row spec, so nothing would be split over autotp_size={tp}; fix the patterns (module names + '.weight')"
        )
    return plan


def _is_head(name: str, config: PartitionConfig) -> bool:
    return name.rsplit(".", 1)[-1] in config.lm_head_patterns


def _style(
    name: str,
    module: nn.Module,
    weight: torch.Tensor,
    spec: LayerSpec,
    tp: int,
    config: PartitionConfig,
    vocab_parallel_loss: bool,
) -> ParallelStyle:
    from zeroshard.tp.plan import BlockColwiseParallel

    where = f"tensor_parallel.partition_config: {name}.weight ({spec.partition_type})"
    if not isinstance(module, nn.Linear):
        raise ConfigError(
            f"{where} is a {type(module).__name__}: zeroshard splits nn.Linear layers by spec (embeddings by the "
            'Hugging Face plan); use partition_type "skip" for it'
        )
    dim = 0 if spec.partition_type == "column" else 1
    if spec.rows is not None and spec.rows != weight.shape[0]:
        raise ConfigError(f"{where}: its shape's parts add up to {spec.rows} rows, the weight has {weight.shape[0]}")
    if weight.shape[dim] % (tp * spec.blocks):
        parts = f" into {spec.blocks} parts each divisible" if spec.blocks > 1 else ""
        raise ConfigError(
            f"{where}: its {('output', 'input')[dim]} features ({weight.shape[dim]}) do not divide{parts} by "
            f"autotp_size={tp}"
        )
    head = _is_head(name, config)
    if spec.blocks > 1:
        if head:
            raise ConfigError(f"{where}: an output head split in parts is not implemented; drop its shape")
        return BlockColwiseParallel(spec.blocks, spec.gather_output)
    if spec.partition_type == "row":
        return RowwiseParallel(input_layouts=Replicate()) if head else RowwiseParallel()
    if spec.gather_output:
        return ColwiseParallel(output_layouts=Replicate())
    if head and not vocab_parallel_loss:
        raise ConfigError(
            f"{where}: a column-split output head leaves each rank a slice of the logits; set gather_output true "
            "(or tensor_parallel.vocab_parallel_lm_head or loss_parallel true for a vocabulary-parallel loss)"
        )
    if head:
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return ColwiseParallel()
