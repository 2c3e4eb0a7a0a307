"""`from_pretrained` under `zero_init()`: a meta-device model whose weights `initialize` streams into shards.

[Note: from_pretrained under zero_init]
DeepSpeed users write `with deepspeed.zero.Init(): model = AutoModelForCausalLM.from_pretrained(path)`.
transformers 5 refuses `from_pretrained` inside a meta-device context (it would load weights only to drop
them), and its own ZeRO-3 path needs DeepSpeed. So, while `zero_init()` is active and only then, transformers'
`PreTrainedModel.from_pretrained` is replaced by `meta_from_pretrained`: the configuration is resolved as
transformers does, the model is built on the meta device with `_from_config`, and the checkpoint's tensors are
matched to the model's names (tied weights, the base-model prefix, the model's ignore lists) and attached to the
model ([Note: weights of a meta model]). Nothing is read yet: `initialize` reads each rank's part
([Note: streaming load]). The original method is restored when the context exits; torch and the user's modules
are not touched. `load_pretrained` is the same load without the context, for code that names it.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from zeroshard.errors import ConfigError
from zeroshard.loading.weights import LoadReport, SafetensorsFolder, StreamedWeights, attach
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)

# from_pretrained arguments that only steer downloads: a local folder needs none of them
_HUB_ONLY = ("cache_dir", "force_download", "local_files_only", "token", "revision", "proxies", "subfolder")
# arguments whose loads place or convert weights in ways a sharded load does not do: refused by name
_REFUSED = ("device_map", "quantization_config", "tp_plan", "tp_size", "gguf_file", "from_tf", "from_flax")


@contextmanager
def streaming_from_pretrained() -> Iterator[None]:
    """[Note: from_pretrained under zero_init] for as long as the context is active (a no-op without transformers)."""
    if "transformers" not in sys.modules:  # a script that imports transformers imports it before zero_init()
        yield
        return
    modeling = importlib.import_module("transformers.modeling_utils")  # transformers imports it lazily
    base = modeling.PreTrainedModel
    original = base.__dict__["from_pretrained"]
    base.from_pretrained = classmethod(meta_from_pretrained)
    try:
        yield
    finally:
        base.from_pretrained = original


def load_pretrained(cls: Any, path: str | os.PathLike[str], **kwargs: Any) -> Any:
    """`cls.from_pretrained(path, **kwargs)` (cls a transformers model or Auto class) as a meta-device model
    whose weights `zeroshard.initialize` streams into each rank's shards.

    Example:
        >>> from transformers import AutoModelForCausalLM  # doctest: +SKIP
        >>> model = load_pretrained(AutoModelForCausalLM, "path/to/llama")  # doctest: +SKIP
        >>> engine, *_ = zeroshard.initialize(model=model, config=cfg)  # doctest: +SKIP
    """
    with torch.device("meta"), streaming_from_pretrained():
        return cls.from_pretrained(path, **kwargs)


def meta_from_pretrained(cls: Any, pretrained_model_name_or_path: Any, *model_args: Any, **kwargs: Any) -> Any:
    """What `PreTrainedModel.from_pretrained` becomes under `zero_init()`."""
    from transformers import AutoConfig, GenerationConfig

    path = os.fspath(pretrained_model_name_or_path)
    if not os.path.isdir(path):
        raise ConfigError(
            f"from_pretrained({path!r}) under zeroshard.zero_init(): streaming load reads a local folder; "
            "download the model first (huggingface-cli download) and pass its folder"
        )
    if model_args:
        raise ConfigError("from_pretrained under zeroshard.zero_init() takes no positional model arguments")
    for key in _REFUSED:
        if kwargs.get(key) is not None:
            raise ConfigError(f"from_pretrained({key}=...) is not supported under zeroshard.zero_init(); drop it")
    if kwargs.pop("use_safetensors", None) is False:
        raise ConfigError("from_pretrained(use_safetensors=False) under zeroshard.zero_init(): only safetensors stream")
    for key in _HUB_ONLY:
        kwargs.pop(key, None)
    adapter = kwargs.pop("adapter_kwargs", None) or {}
    if "_adapter_model_path" in adapter:
        raise ConfigError(f"{path} holds a PEFT adapter; under zeroshard.zero_init() load its base model's folder")
    for key in [k for k in kwargs if k.startswith("_")]:  # what the Auto classes pass along (_from_auto, ...)
        kwargs.pop(key)
    build_kwargs = {k: kwargs.pop(k) for k in ("attn_implementation",) if k in kwargs}
    output_loading_info = bool(kwargs.pop("output_loading_info", False))
    ignore_mismatched = bool(kwargs.pop("ignore_mismatched_sizes", False))
    kwargs.pop("low_cpu_mem_usage", None)  # always true here
    trust = kwargs.pop("trust_remote_code", None)
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", "auto"))
    config = kwargs.pop("config", None)
    if config is None or isinstance(config, str | os.PathLike):
        config, kwargs = AutoConfig.from_pretrained(
            config or path, return_unused_kwargs=True, trust_remote_code=trust, **kwargs
        )
    else:
        for key in [k for k in kwargs if hasattr(config, k)]:  # configuration overrides, as transformers applies
            setattr(config, key, kwargs.pop(key))
    if kwargs:
        raise ConfigError(
            f"from_pretrained under zeroshard.zero_init(): unknown arguments {sorted(kwargs)}; "
            "they are neither configuration fields nor load options"
        )
    quantized = getattr(config, "quantization_config", None)
    if quantized is not None:  # transformers dequantizes (fp8 with scales, mxfp4 experts) while it loads
        method = (
            quantized.get("quant_method") if isinstance(quantized, dict) else getattr(quantized, "quant_method", "")
        )
        raise ConfigError(
            f"{path}: a quantized checkpoint (quantization_config, quant_method {method!r}); a streaming load under "
            "zeroshard.zero_init() reads unquantized weights only: use the model's bf16 checkpoint, or load this "
            "one without zeroshard.zero_init()"
        )
    model_dtype = _resolve_dtype(dtype, config)
    with torch.device("meta"):
        model = cls._from_config(config, dtype=model_dtype, **build_kwargs)
    _keep_in_fp32(model, model_dtype)
    model.eval()  # as transformers' from_pretrained leaves it
    if model.can_generate() and os.path.exists(os.path.join(path, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(path)
    weights = match_weights(model, SafetensorsFolder(path), ignore_mismatched)
    attach(model, weights)
    _log_report(type(model).__name__, path, weights.report)
    return (model, weights.report.as_dict()) if output_loading_info else model


def match_weights(model: nn.Module, folder: SafetensorsFolder, ignore_mismatched: bool = False) -> StreamedWeights:
    """Each of the model's parameters and persistent buffers, by every name it has, to a checkpoint key."""
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    names_of: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *_persistent_buffers(model)]:
        names_of.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    conversions = folder.convert_for(model)  # [Note: converted checkpoints in a streaming load]
    available = folder.names()
    keys: dict[int, str] = {}
    missing: list[str] = []
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    used: set[str] = set()
    for ident, names in names_of.items():
        key = next((k for n in names for k in _candidates(n, prefix) if k in available), None)
        shape = tuple(tensors[ident].shape)
        if key is None:
            missing.append(names[0])
            continue
        used.add(key)
        stored = available[key]
        _refuse_quantized(folder, key, tensors[ident])
        if stored != shape and key in conversions.unsupported:  # a conversion in place (a transpose) it needs
            _refuse_unconverted(conversions.unsupported, [key], "")
        if stored != shape:
            if not ignore_mismatched:
                raise ConfigError(
                    f"{folder.folder}: {key} has shape {list(stored)} but the model's {names[0]} is {list(shape)}; "
                    "the configuration does not match the checkpoint (or pass ignore_mismatched_sizes=True)"
                )
            mismatched.append((names[0], stored, shape))  # initialised; the model's name, apart from missing
            continue
        keys[ident] = key
    unexpected = [stored for k in available if k not in used for stored in folder.stored(k)]
    _refuse_unconverted(conversions.unsupported, missing, prefix)
    report = LoadReport(
        tuple(_unignored(missing, getattr(model, "_keys_to_ignore_on_load_missing", None))),
        tuple(_unignored(unexpected, getattr(model, "_keys_to_ignore_on_load_unexpected", None))),
        tuple(mismatched),
    )
    return StreamedWeights(folder, keys, tensors.values(), report)


def _keep_in_fp32(model: Any, dtype: torch.dtype) -> None:
    """The modules transformers keeps in fp32 at this dtype (`_keep_in_fp32_modules` for fp16, `..._strict` for
    fp16 and bf16) are fp32 here too; the engine then computes in its compute dtype as for every parameter."""
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    patterns = [re.compile(rf"(^|\.){re.escape(name)}(\.|$)") for name in plan]
    for name, param in model.named_parameters():
        if any(p.search(name) for p in patterns):
            param.data = torch.empty_like(param, dtype=torch.float32)


def _persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = []
    for module_name, module in model.named_modules():
        skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in skip:
                out.append((f"{module_name}.{name}" if module_name else name, buf))
    return out


def _candidates(name: str, prefix: str) -> list[str]:
    """A model name as checkpoints store it: as is, without the base-model prefix (a base model's checkpoint
    loaded into a head model) or with it (the other way round)."""
    if not prefix:
        return [name]
    if name.startswith(prefix + "."):
        return [name, name[len(prefix) + 1 :]]
    return [name, f"{prefix}.{name}"]


def _unignored(keys: list[str], patterns: Any) -> list[str]:
    compiled = [re.compile(p) for p in (patterns or [])]
    return [k for k in keys if not any(p.search(k) for p in compiled)]


_FLOAT8 = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz") if hasattr(torch, name)
)


def _refuse_quantized(folder: SafetensorsFolder, key: str, tensor: torch.Tensor) -> None:
    """A float8 stored tensor into a wider parameter needs its scales (transformers' fp8 dequantization): refused,
    not cast, whatever the config says."""
    if tensor.dtype in _FLOAT8:
        return
    stored = next((s for s in folder.stored(key) if folder.entry(s).dtype in _FLOAT8), None)
    if stored is not None:
        raise ConfigError(
            f"{folder.folder}: {stored} is stored as {folder.entry(stored).dtype} (a quantized checkpoint); a "
            "streaming load under zeroshard.zero_init() reads unquantized weights only: use the model's bf16 "
            "checkpoint, or load this one without zeroshard.zero_init()"
        )


def _refuse_unconverted(unsupported: dict[str, str], missing: list[str], prefix: str) -> None:
    """A parameter that only a conversion this load does not do would give (`unsupported`: target -> operation)
    is refused, rather than left to its initialisation ([Note: converted checkpoints in a streaming load])."""
    for name in missing:
        target = next((k for k in _candidates(name, prefix) if k in unsupported), None)
        if target is not None:
            raise ConfigError(
                f"the model's {name!r} needs transformers' weight conversion, which a streaming load does only by "
                f"stacking and concatenating stored tensors, here {unsupported[target]}; load this model without "
                "zeroshard.zero_init()"
            )


def _resolve_dtype(dtype: Any, config: Any) -> torch.dtype:
    """transformers' rule: "auto" (its default) is the configuration's dtype, else the default dtype."""
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.get_default_dtype()
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"from_pretrained(dtype={dtype!r}): not a torch dtype")
    return dtype


def _log_report(model_name: str, path: str, report: LoadReport) -> None:
    """transformers' warnings, once per job."""
    if report.unexpected_keys:
        log_rank(
            logger,
            30,
            f"Some weights of the checkpoint at {path} were not used when initializing {model_name}: "
            f"{list(report.unexpected_keys)}",
        )
    if report.missing_keys:
        log_rank(
            logger,
            30,
            f"Some weights of {model_name} were not initialized from the checkpoint at {path} and are newly "
            f"initialized: {list(report.missing_keys)}",
        )
    if report.mismatched_keys:
        shapes = [
            f"{key}: checkpoint {list(stored)}, model {list(shape)}" for key, stored, shape in report.mismatched_keys
        ]
        log_rank(
            logger,
            30,
            f"Some weights of {model_name} were not initialized from the checkpoint at {path} because the shapes did "
            f"not match, and are newly initialized: {shapes}",
        )
