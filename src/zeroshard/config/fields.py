"""Building blocks of the ds_config schema: the AUTO sentinel, value checkers and field helpers.

Every block of the schema is a frozen dataclass deriving from `ConfigBlock`. Each field is declared
with `option` (a scalar checked by a checker), `block` (a nested block), `params` (a free mapping
such as optimizer params) or `opaque` (an accepted block we keep as plain JSON). The doc of a field
lives in `field.metadata["doc"]`; what the parser needs lives in `field.metadata["spec"]`.

[Note: auto and the two phases]
`parse_config` validates the user's mapping and keeps every "auto" value as the `AUTO` sentinel.
`resolve_config` replaces each `AUTO` with, in order: the caller's `known[path]`, a rule of
`resolve.py` (the Hugging Face Trainer's rules), or the DeepSpeed default where DeepSpeed itself
treats "auto" as "use the default" (its pydantic blocks). Field annotations give the type after
`resolve_config`; between the two phases a field whose user value was "auto" holds `AUTO`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from zeroshard.errors import ConfigError


class Auto(enum.Enum):
    """The ds_config string "auto": a value that `resolve_config` fills in."""

    AUTO = "auto"

    def __repr__(self) -> str:
        return "AUTO"


AUTO: Final = Auto.AUTO


class AutoPolicy(enum.Enum):
    """What the string "auto" means for a field (see [Note: auto and the two phases])."""

    FORBID = "forbid"  # an error: neither DeepSpeed nor the HF integration give this key a value
    DEFAULT = "default"  # known[path], else the DeepSpeed default (DeepSpeed drops "auto" in its pydantic blocks)
    RESOLVE = "resolve"  # known[path], else a rule of resolve.py, else ConfigError
    LITERAL = "literal"  # "auto" is an ordinary value of this key


class Kind(enum.Enum):
    """How the parser treats a field's value."""

    SCALAR = "scalar"
    BLOCK = "block"
    PARAMS = "params"
    OPAQUE = "opaque"


Check = Callable[[object, str], object]


def show(value: object) -> str:
    """Render a value as it is written in JSON, for messages."""
    if value is AUTO:
        return '"auto"'
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def join(path: str, key: str) -> str:
    """The dotted path of `key` inside the block at `path` ("" is the top level)."""
    return f"{path}.{key}" if path else key


def _one_of(items: Sequence[object]) -> str:
    shown = [show(item) for item in items]
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"


# --------------------------------------------------------------------------- checkers


@dataclass(frozen=True)
class Bool:
    """true or false; 0 and 1 are not accepted."""

    def __call__(self, value: object, path: str) -> bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: {show(value)} is not a bool; use true or false")


def _as_int(value: object, path: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    # Sizes are commonly written as 5e8; an integral float is the integer it spells.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ConfigError(f"{path}: {show(value)} is not an int")


def _check_range(number: float, value: object, path: str, low: float | None, high: float | None) -> None:
    if low is not None and number < low:
        raise ConfigError(f"{path}: {show(value)} is out of range; expected >= {low}")
    if high is not None and number > high:
        raise ConfigError(f"{path}: {show(value)} is out of range; expected <= {high}")


@dataclass(frozen=True)
class Int:
    """An integer (an integral float such as 5e8 counts), optionally bounded or from a fixed set."""

    minimum: int | None = None
    maximum: int | None = None
    choices: tuple[int, ...] = ()

    def __call__(self, value: object, path: str) -> int:
        number = _as_int(value, path)
        if self.choices and number not in self.choices:
            raise ConfigError(f"{path}: {show(value)} is out of range; expected {_one_of(self.choices)}")
        _check_range(number, value, path, self.minimum, self.maximum)
        return number


@dataclass(frozen=True)
class Float:
    """A finite number (ints accepted), optionally bounded."""

    minimum: float | None = None
    maximum: float | None = None
    positive: bool = False

    def __call__(self, value: object, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: {show(value)} is not a number")
        number = float(value)
        if not math.isfinite(number):
            raise ConfigError(f"{path}: {show(value)} is not a finite number")
        if self.positive and number <= 0:
            raise ConfigError(f"{path}: {show(value)} is out of range; expected > 0")
        _check_range(number, value, path, self.minimum, self.maximum)
        return number


@dataclass(frozen=True)
class Str:
    """A string, optionally from a fixed set (compared after `fold`, e.g. str.upper)."""

    choices: tuple[str, ...] = ()
    fold: Callable[[str], str] | None = None

    def __call__(self, value: object, path: str) -> str:
        if isinstance(value, str):
            text = self.fold(value) if self.fold else value
            if not self.choices or text in self.choices:
                return text
            raise ConfigError(f"{path}: {show(value)} is not one of {', '.join(map(show, self.choices))}")
        raise ConfigError(f"{path}: {show(value)} is not a string")


_DTYPE_SPELLINGS: Final[Mapping[str, str]] = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "torch.float": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "torch.half": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
}


@dataclass(frozen=True)
class DType:
    """A floating dtype in any DeepSpeed spelling ("float32", "torch.bfloat16", ...), normalised to
    "fp32", "fp16" or "bf16". A torch.dtype object is accepted too (by its name; torch is not imported)."""

    def __call__(self, value: object, path: str) -> str:
        text = value if isinstance(value, str) else str(value)
        if not isinstance(value, str) and not text.startswith("torch."):
            raise ConfigError(f'{path}: {show(value)} is not a dtype; expected "fp32", "fp16" or "bf16"')
        normal = _DTYPE_SPELLINGS.get(text.strip().lower())
        if normal is None:
            raise ConfigError(f'{path}: {show(value)} is not a dtype; expected "fp32", "fp16" or "bf16"')
        return normal


@dataclass(frozen=True)
class Path:
    """A filesystem path (a string or an os.PathLike), kept as a string."""

    def __call__(self, value: object, path: str) -> str:
        if isinstance(value, str):
            return value
        fspath = getattr(value, "__fspath__", None)
        if callable(fspath):
            return str(fspath())
        raise ConfigError(f"{path}: {show(value)} is not a path")


@dataclass(frozen=True)
class Nullable:
    """null, or a value that `inner` accepts."""

    inner: Check

    def __call__(self, value: object, path: str) -> object:
        return None if value is None else self.inner(value, path)


@dataclass(frozen=True)
class NeverIfInfinite:
    """A positive infinity read as null ("never": accelerate's DeepSpeed plugin sets steps_per_print to inf, which
    DeepSpeed takes as never printing), else what `inner` accepts."""

    inner: Check

    def __call__(self, value: object, path: str) -> object:
        return None if isinstance(value, float) and value == math.inf else self.inner(value, path)


@dataclass(frozen=True)
class ListOf:
    """A JSON list whose items `item` accepts; kept as a tuple."""

    item: Check

    def __call__(self, value: object, path: str) -> tuple[object, ...]:
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise ConfigError(f"{path}: {show(value)} is not a list")
        return tuple(self.item(entry, f"{path}[{index}]") for index, entry in enumerate(value))


def json_value(value: object, path: str) -> Any:
    """A deep copy of a JSON-like value (mappings with string keys, lists, scalars)."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, entry in value.items():
            if not isinstance(key, str):
                raise ConfigError(f"{path or 'ds_config'}: key {key!r} is not a string")
            out[key] = json_value(entry, join(path, key))
        return out
    if isinstance(value, list | tuple):
        return [json_value(entry, f"{path}[{index}]") for index, entry in enumerate(value)]
    return value


def json_mapping(value: object, path: str) -> dict[str, Any]:
    """A deep copy of a JSON object; anything else is an error."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path or 'ds_config'}: {show(value)} is not an object (a mapping of keys to values)")
    copied: dict[str, Any] = json_value(value, path)
    return copied


# --------------------------------------------------------------------------- field declarations


@dataclass(frozen=True)
class FieldSpec:
    """What the parser needs to know about one field (kept in `field.metadata["spec"]`)."""

    kind: Kind
    check: Check | None = None
    aliases: tuple[str, ...] = ()
    auto: AutoPolicy | None = None  # None: the block's AUTO_POLICY
    block_type: type[ConfigBlock] | None = None
    optional: bool = False


def option(
    default: object,
    doc: str,
    check: Check,
    *,
    aliases: Sequence[str] = (),
    auto: AutoPolicy | None = None,
) -> Any:
    """Declare a scalar (or list) field with its DeepSpeed default and a one-line doc."""
    if isinstance(default, list | dict | set):
        raise TypeError("use an immutable default (a tuple) for list fields")
    spec = FieldSpec(Kind.SCALAR, check=check, aliases=tuple(aliases), auto=auto)
    return field(default=default, metadata={"doc": doc, "spec": spec})


def block(block_type: type[ConfigBlock], doc: str, *, optional: bool = False) -> Any:
    """Declare a nested block; `optional` blocks are None when the user leaves them out."""
    spec = FieldSpec(Kind.BLOCK, block_type=block_type, optional=optional)
    metadata = {"doc": doc, "spec": spec}
    if optional:
        return field(default=None, metadata=metadata)
    return field(default_factory=block_type, metadata=metadata)


def params(doc: str) -> Any:
    """Declare a free mapping of keyword arguments (optimizer/scheduler params); "auto" is allowed
    in its values and is resolved by `resolve_config`."""
    return field(default_factory=dict, metadata={"doc": doc, "spec": FieldSpec(Kind.PARAMS)})


def opaque(doc: str, *, any_json: bool = False) -> Any:
    """Declare a block that is accepted and kept as plain JSON (None when absent): a JSON object, or
    any JSON value with `any_json`. Its "auto" strings stay strings, because several such blocks use
    "auto" as an ordinary value."""
    spec = FieldSpec(Kind.OPAQUE, check=json_value if any_json else json_mapping)
    return field(default=None, metadata={"doc": doc, "spec": spec})


def internal(default_factory: Callable[[], object], doc: str) -> Any:
    """Declare bookkeeping that is not a ds_config key (no spec: the parser never sees it)."""
    return field(default_factory=default_factory, repr=False, compare=False, metadata={"doc": doc})


def keep(value: object, path: str) -> object:
    """The identity conversion, for a renamed key."""
    return value


@dataclass(frozen=True)
class Moved:
    """A deprecated key of a block: its value, converted by `convert`, now lives at each of `new`
    (dotted paths relative to the block, in canonical spelling)."""

    old: str
    new: tuple[str, ...]
    convert: Callable[[object, str], object] = keep


def spec_of(f: dataclasses.Field[Any]) -> FieldSpec | None:
    """The parser spec of a field, or None for internal bookkeeping fields."""
    spec = f.metadata.get("spec")
    return spec if isinstance(spec, FieldSpec) else None


def default_of(f: dataclasses.Field[Any]) -> object:
    """A field's default value (calling its factory when it has one)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"field {f.name} has no default")


def to_json(value: object) -> Any:
    """A JSON-able copy of a field value (AUTO becomes "auto", tuples become lists)."""
    if value is AUTO:
        return "auto"
    if isinstance(value, ConfigBlock):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {key: to_json(entry) for key, entry in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(entry) for entry in value]
    return value


@dataclass(frozen=True)
class ConfigBlock:
    """Base of every schema block: a frozen dataclass whose field names are ds_config keys."""

    AUTO_POLICY: ClassVar[AutoPolicy] = AutoPolicy.FORBID
    MOVED: ClassVar[tuple[Moved, ...]] = ()
    REQUIRED: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def dynamic_defaults(cls, given: Mapping[str, object]) -> dict[str, object]:
        """Defaults that depend on other keys, for keys the user did not give."""
        return {}

    @classmethod
    def key_fields(cls) -> dict[str, dataclasses.Field[Any]]:
        """The ds_config keys of this block (canonical names), with their dataclass fields."""
        return {f.name: f for f in dataclasses.fields(cls) if spec_of(f) is not None}

    @classmethod
    def spellings(cls) -> dict[str, str]:
        """Every accepted spelling of a key (names and aliases) mapped to its canonical name."""
        out: dict[str, str] = {}
        for name, f in cls.key_fields().items():
            out[name] = name
            spec = spec_of(f)
            for alias in spec.aliases if spec else ():
                out[alias] = name
        return out

    def to_dict(self, *, include_defaults: bool = True) -> dict[str, Any]:
        """A JSON-able dict of this block (canonical key names). With include_defaults=False only
        values that differ from the DeepSpeed default are kept."""
        out: dict[str, Any] = {}
        for name, f in self.key_fields().items():
            value = getattr(self, name)
            if isinstance(value, ConfigBlock):
                sub = value.to_dict(include_defaults=include_defaults)
                if include_defaults or sub:
                    out[name] = sub
            elif include_defaults or value is AUTO or value != default_of(f):
                out[name] = to_json(value)
        return out
