"""`from_pretrained` under `deepspeed.linear.Init`: the base weights of `LoRAOptimizedLinear` layers read from the
model's safetensors files, each rank reading its shard's rows only.

[Note: base weights from pretrained files]
DeepSpeed's layers take their base weights through `_load_from_state_dict` (a whole weight narrowed to the rank's
shard, or quantized), which Transformers 4 called. Transformers 5 sets each parameter itself and refuses a tensor
whose shape differs from the parameter's, which a shard (`base_weight_sharding` > 1) and quantized bytes always do:
the model is built with those sizes let through (`ignore_mismatched_sizes`, any other mismatch is still refused,
naming it), and the layers whose weights it skipped read them here. A layer a loaded state dict names outside
`target_mods` becomes a plain layer (`disable`) with the file's whole weight, as under Transformers 4.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from zeroshard.linear.optimized_linear import LoRAOptimizedLinear
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)


def from_pretrained(pretrained: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """`AutoModelForCausalLM.from_pretrained(*args, **kwargs)` with the layers' base weights read here."""
    wants_info = bool(kwargs.pop("output_loading_info", False))
    asked_ignore = bool(kwargs.pop("ignore_mismatched_sizes", False))
    model, info = pretrained(*args, ignore_mismatched_sizes=True, output_loading_info=True, **kwargs)
    layers = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, LoRAOptimizedLinear)}
    skipped = {
        str(entry[0] if isinstance(entry, (tuple, list)) else entry) for entry in info.get("mismatched_keys", [])
    }
    others = sorted(skipped - set(layers))
    if others and not asked_ignore:
        raise RuntimeError(
            f"from_pretrained under deepspeed.linear.Init: {', '.join(others[:3])} in the checkpoint do not match the "
            "model's sizes; pass ignore_mismatched_sizes=True to leave them initialised"
        )
    path = args[0] if args else kwargs["pretrained_model_name_or_path"]
    reader = _SafetensorsFiles(_folder(path, kwargs))
    for key, layer in layers.items():
        _load_layer(layer, key, reader, key in skipped)
    if skipped & set(layers):
        log_rank(
            logger,
            logging.INFO,
            f"deepspeed.linear.Init: {len(skipped & set(layers))} base weights read from the checkpoint's files as "
            "this rank's shard or quantized (the sizes Transformers reports as mismatched above)",
        )
    return (model, info) if wants_info else model


def _load_layer(layer: LoRAOptimizedLinear, key: str, reader: _SafetensorsFiles, skipped: bool) -> None:
    prefix = key[: -len("weight")]
    target = any(name in prefix for name in layer.lora_config.target_mods)
    if not skipped:  # Transformers loaded it whole (no shard, not quantized)
        if not target:  # the same parameter object: a weight Transformers tied (lm_head to the embeddings) stays tied
            whole = layer.weight
            layer.disable()
            layer.weight = whole
        return
    rows = None
    if target and layer.zero_shards > 1 and layer.output_dim % layer.zero_shards == 0:
        import torch.distributed as dist

        per = layer.output_dim // layer.zero_shards
        rows = (dist.get_rank() * per, (dist.get_rank() + 1) * per)  # the rank's flat range is whole rows
    tensor = reader.read(key, rows)
    errors: list[str] = []
    with torch.no_grad():
        layer._load_from_state_dict({key: tensor}, prefix, {}, False, [], [], errors)
    if errors:
        raise RuntimeError(f"from_pretrained under deepspeed.linear.Init: {key}: {'; '.join(errors)}")


def _folder(path: Any, kwargs: dict[str, Any]) -> str:
    if os.path.isdir(str(path)):
        return os.path.join(str(path), str(kwargs.get("subfolder") or ""))
    from huggingface_hub import snapshot_download  # the files from_pretrained just fetched, from its cache

    folder = snapshot_download(str(path), revision=kwargs.get("revision"), allow_patterns=["*.safetensors", "*.json"])
    return os.path.join(folder, str(kwargs.get("subfolder") or ""))


class _SafetensorsFiles:
    """The tensors of a model folder's safetensors files (one file, or an index over several), read by key."""

    def __init__(self, folder: str):
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                self.files = {k: os.path.join(folder, v) for k, v in json.load(f)["weight_map"].items()}
        else:
            single = os.path.join(folder, "model.safetensors")
            if not os.path.exists(single):
                raise FileNotFoundError(
                    f"from_pretrained under deepspeed.linear.Init reads the base weights from safetensors files; "
                    f"{folder} has neither model.safetensors nor model.safetensors.index.json"
                )
            from safetensors import safe_open

            with safe_open(single, "pt") as f:
                self.files = dict.fromkeys(f.keys(), single)

    def read(self, key: str, rows: tuple[int, int] | None) -> torch.Tensor:
        """Tensor `key` (only rows [begin, end) when `rows` is given: a shard of whole rows, flat)."""
        if key not in self.files:
            raise KeyError(f"from_pretrained under deepspeed.linear.Init: {key} is not in the checkpoint's files")
        from safetensors import safe_open

        with safe_open(self.files[key], "pt") as f:
            if rows is None:
                return f.get_tensor(key)
            return f.get_slice(key)[rows[0] : rows[1]].reshape(-1)
