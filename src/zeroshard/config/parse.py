"""parse_config: read a ds_config (a JSON file, a mapping or base64-encoded JSON), check every key and value, apply
deprecated spellings, and keep "auto" values as AUTO (see [Note: auto and the two phases])."""

from __future__ import annotations

import base64
import binascii
import copy
import dataclasses
import difflib
import importlib.util
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from zeroshard.config.checks import check_consistency, warn_ignored
from zeroshard.config.fields import (
    AUTO,
    AutoPolicy,
    ConfigBlock,
    Kind,
    Moved,
    join,
    json_mapping,
    json_value,
    show,
    spec_of,
)
from zeroshard.config.schema import ZeroshardConfig
from zeroshard.config.support import warn_unimplemented
from zeroshard.errors import ConfigError
from zeroshard.utils.logging import get_logger

ConfigSource = str | os.PathLike[str] | Mapping[str, Any]
B = TypeVar("B", bound=ConfigBlock)
_BASE64 = re.compile(r"[A-Za-z0-9_\-+/]+={0,2}")  # what a string read as base64 may hold (whitespace left out)


def parse_config(source: ConfigSource | ZeroshardConfig) -> ZeroshardConfig:
    """Validate a ds_config and return it as a ZeroshardConfig; "auto" values stay AUTO.

    `source` is a path to a JSON file, a mapping, or a string of urlsafe-base64-encoded JSON as DeepSpeed's autotuner
    passes it (a ZeroshardConfig is returned as it is).
    Raises ConfigError naming the key for unknown keys, wrong types, out-of-range values and
    contradictions; logs one warning per deprecated key, per key ignored as DeepSpeed ignores it (offload_param
    below stage 3) and per set-but-unimplemented key.

    Example:
        >>> from zeroshard.config import parse_config
        >>> cfg = parse_config({"zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8}})
        >>> cfg.zero_optimization.reduce_bucket_size
        200000000
    """
    if isinstance(source, ZeroshardConfig):
        return source
    logger = get_logger("zeroshard.config")
    user = load_source(source, logger)
    working = _legacy_zero_switch(json_mapping(user, ""), logger)
    cfg = build_block(ZeroshardConfig, working, "", logger)
    cfg = dataclasses.replace(cfg, raw=copy.deepcopy(dict(user)))
    check_consistency(cfg)
    warn_ignored(cfg, logger)
    warn_unimplemented(cfg, logger)
    vocabulary = cfg.vocabulary_size
    if isinstance(vocabulary, int) and vocabulary % 8:  # DeepSpeed's hint (its config's _do_warning_check)
        logger.warning(
            f"zeroshard: vocabulary_size {vocabulary} is not a multiple of 8: an embedding padded to one uses "
            "tensor cores better (the key changes nothing else, as in DeepSpeed)"
        )
    return cfg


def load_source(source: object, logger: logging.Logger) -> Mapping[str, Any]:
    """The user's mapping: `source` itself, or the JSON object in the file it names."""
    if isinstance(source, Mapping):
        return source
    if isinstance(source, str) and not os.path.exists(source) and _BASE64.fullmatch(packed := "".join(source.split())):
        return parse_json_text(
            _base64_text(source, packed), f"ds_config {_shown(source)} (no existing file; read as base64)", logger
        )
    if isinstance(source, str | os.PathLike):
        return read_json_file(os.fsdecode(source), logger)
    raise ConfigError(
        f"a ds_config is a path to a JSON file, a mapping or base64-encoded JSON, not a {type(source).__name__}"
    )


def _base64_text(source: str, packed: str) -> str:
    """The text a string of the base64 alphabet that names no file encodes: DeepSpeed's autotuner passes a trial's
    config to the script as `--deepspeed_config <urlsafe base64>` and DeepSpeed's `DeepSpeedConfig` decodes such a
    string (whitespace, as `base64` wraps its lines, is left out, as DeepSpeed's decoder leaves it out)."""
    try:
        return base64.urlsafe_b64decode(packed).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError) as e:
        reason = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else str(e).rstrip(".").lower()
        raise ConfigError(
            f"ds_config {_shown(source)} is no existing file, nor urlsafe-base64-encoded JSON ({reason}); pass the "
            "path of a JSON file, a dict, or the config's JSON encoded with base64.urlsafe_b64encode"
        ) from None


def _shown(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def read_json_file(path: str, logger: logging.Logger) -> dict[str, Any]:
    """Read a JSON object from `path`; duplicate keys with different values are an error."""
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        hint = " (to pass JSON text, json.loads it and pass the dict)" if path.lstrip().startswith("{") else ""
        raise ConfigError(f"ds_config file {path} does not exist{hint}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"ds_config file {path} is not UTF-8 text: {err.reason}") from None
    except OSError as err:
        raise ConfigError(f"ds_config file {path} cannot be read: {err.strerror or err}") from None
    return parse_json_text(text, f"ds_config file {path}", logger)


def parse_json_text(text: str, source: str, logger: logging.Logger) -> dict[str, Any]:
    """The JSON (or hjson) object in `text`; `source` names where it came from in errors ("ds_config file x")."""
    hook = lambda pairs: _unique_keys(pairs, source, logger)  # noqa: E731
    try:
        data = json.loads(text, object_pairs_hook=hook)
    except json.JSONDecodeError as err:
        data = _hjson(text, hook)  # DeepSpeed reads its config files with hjson (comments, unquoted keys)
        if data is None:
            hjson = (
                "nor hjson, which DeepSpeed also reads"
                if importlib.util.find_spec("hjson") is not None
                else "hjson, which DeepSpeed also reads, is not installed: `pip install hjson` for files written in it"
            )
            raise ConfigError(
                f"{source} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno} ({hjson})"
            ) from None
        if data == {} and "{" not in text:  # hjson reads nothing at all as {}: a truncated or unwritten file
            raise ConfigError(
                f"{source} is empty (or holds only comments); write the config as a JSON object ({{}} "
                "for DeepSpeed's defaults)"
            ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source} holds a JSON {type(data).__name__}, not an object")
    return data


def _hjson(text: str, hook: Any) -> Any:
    """`text` read as hjson, a superset of JSON (None when it is not hjson either, or hjson is not installed)."""
    try:
        import hjson
    except ImportError:
        return None
    try:
        return hjson.loads(text, object_pairs_hook=hook)
    except hjson.HjsonDecodeError:
        return None


def _unique_keys(pairs: list[tuple[str, Any]], source: str, logger: logging.Logger) -> dict[str, Any]:
    # DeepSpeed rejects every duplicate; a repeated key with the same value is harmless, so it only warns.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out and out[key] != value:
            raise ConfigError(f'{source}: key "{key}" appears twice, with {show(out[key])} and {show(value)}; keep one')
        if key in out:
            logger.warning(f'zeroshard: key "{key}" appears twice in {source} with the same value')
        out[key] = value
    return out


def _legacy_zero_switch(mapping: dict[str, Any], logger: logging.Logger) -> dict[str, Any]:
    """DeepSpeed still reads `"zero_optimization": true` (stage 1, bucket from `allgather_size`)."""
    switch = mapping.get("zero_optimization")
    if not isinstance(switch, bool):
        return mapping
    logger.warning("zeroshard: zero_optimization=true/false is deprecated; use zero_optimization.stage instead")
    zero: dict[str, Any] = {"stage": 1 if switch else 0}
    allgather = mapping.pop("allgather_size", None)
    if switch and allgather is not None:
        zero["allgather_bucket_size"] = allgather
    elif allgather is not None:
        logger.warning(
            "zeroshard: allgather_size is ignored with zero_optimization=false, as DeepSpeed ignores it: it sizes "
            "stage 1's buckets"
        )
    return {**mapping, "zero_optimization": zero}


def build_block(cls: type[B], value: object, path: str, logger: logging.Logger) -> B:
    """Check `value` against block `cls` and build it; `path` is the block's dotted key."""
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path or 'ds_config'}: {show(value)} is not an object (a mapping of keys to values)")
    olds = {moved.old for moved in cls.MOVED}
    given = _canonical_keys(cls, {key: val for key, val in value.items() if key not in olds}, path)
    for moved in cls.MOVED:
        if moved.old in value:
            _apply_moved(moved, value[moved.old], given, path, logger)
    for name in cls.REQUIRED:
        if name not in given:
            raise ConfigError(f"{join(path, name)}: missing; every {path or 'ds_config'} block needs a {name}")
    fields = cls.key_fields()
    kwargs = {name: _convert(cls, fields[name], raw, join(path, name), logger) for name, raw in given.items()}
    for name, default in cls.dynamic_defaults(kwargs).items():
        kwargs.setdefault(name, default)
    return cls(**kwargs)


def _canonical_keys(cls: type[ConfigBlock], mapping: Mapping[Any, Any], path: str) -> dict[str, Any]:
    """The mapping with every key in its canonical spelling; unknown keys and conflicting spellings
    of one key are errors."""
    spellings = cls.spellings()
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise ConfigError(f"{path or 'ds_config'}: key {key!r} is not a string")
        name = spellings.get(key)
        if name is None:
            raise ConfigError(unknown_key_message(cls, key, path))
        if name in out and out[name] != value:
            raise ConfigError(
                f"{join(path, spelled[name])} and {join(path, key)} are the same key, given different values "
                f"({show(out[name])} and {show(value)}); keep one"
            )
        out[name], spelled[name] = value, key
    return out


def unknown_key_message(cls: type[ConfigBlock], key: str, path: str) -> str:
    """`path.key: unknown key; did you mean ...?`, or the list of valid keys when nothing is close."""
    close = difflib.get_close_matches(key, list(cls.spellings()), n=1)
    if close:
        return f"{join(path, key)}: unknown key; did you mean {close[0]}?"
    where = f" of {path}" if path else ""
    return f"{join(path, key)}: unknown key; valid keys{where} are: {', '.join(sorted(cls.key_fields()))}"


def misspelt(path: str, keys: Iterable[str], known: Iterable[str]) -> str | None:
    """`path.key: unknown key; did you mean ...?` for the first of `keys` (of an opaque block, which its reader checks)
    close to one of `known`; None when none is."""
    for key in sorted(keys):
        close = difflib.get_close_matches(key, sorted(known), n=1)
        if close:
            return f"{join(path, key)}: unknown key; did you mean {close[0]}?"
    return None


def _apply_moved(moved: Moved, value: object, given: dict[str, Any], path: str, logger: logging.Logger) -> None:
    old_path = join(path, moved.old)
    new_value = moved.convert(value, old_path)
    targets = [join(path, target) for target in moved.new]
    logger.warning(f"zeroshard: {old_path} is deprecated; use {' and '.join(targets)} instead")
    for target, target_path in zip(moved.new, targets, strict=True):
        _put(given, target.split("."), new_value, old_path, target_path)


def _put(mapping: dict[str, Any], parts: list[str], value: object, old_path: str, new_path: str) -> None:
    head, rest = parts[0], parts[1:]
    if not rest:
        if head in mapping and mapping[head] != value:
            raise ConfigError(
                f"{old_path} (deprecated) and {new_path} are both set, to different values "
                f"({show(value)} and {show(mapping[head])}); keep only {new_path}"
            )
        mapping[head] = value
        return
    child = mapping.get(head)
    if child is None:
        child = {}
    if not isinstance(child, Mapping):
        return  # building the block reports its wrong type
    child = dict(child)
    mapping[head] = child
    _put(child, rest, value, old_path, new_path)


def _is_auto(value: object) -> bool:
    return value is AUTO or (isinstance(value, str) and value == "auto")


def _convert(
    cls: type[ConfigBlock], f: dataclasses.Field[Any], raw: object, path: str, logger: logging.Logger
) -> object:
    spec = spec_of(f)
    assert spec is not None  # key_fields only lists fields with a spec
    policy = spec.auto or cls.AUTO_POLICY
    if spec.kind is Kind.SCALAR and _is_auto(raw) and policy is not AutoPolicy.LITERAL:
        if policy is AutoPolicy.FORBID:
            raise ConfigError(f'{path}: "auto" is not accepted for this key; set a value')
        return AUTO
    if spec.kind is Kind.BLOCK:
        assert spec.block_type is not None
        if raw is None and spec.optional:
            return None
        return build_block(spec.block_type, raw, path, logger)
    if spec.kind is Kind.PARAMS:
        return _params(raw, path)
    if spec.kind is Kind.OPAQUE and raw is None:
        return None
    assert spec.check is not None
    return spec.check(raw, path)


def _params(raw: object, path: str) -> dict[str, Any]:
    """Free keyword arguments: any JSON values, with top-level "auto" kept as AUTO."""
    if raw is None:
        return {}
    return {
        key: AUTO if _is_auto(value) else json_value(value, join(path, key))
        for key, value in json_mapping(raw, path).items()
    }
