"""Config truth ([Note: config truth] in config/support.py): every ds_config key is read by the code, refused
unless default, a no-op by design with a reason, or warned about as unimplemented; never silently ignored."""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest

from zeroshard.config import ConfigBlock, ZeroshardConfig, parse_config, resolve_config
from zeroshard.config.fields import Kind, spec_of
from zeroshard.config.support import IMPLEMENTED, NO_OP_BY_DESIGN, ONLY_DEFAULT, is_unimplemented
from zeroshard.errors import ConfigError
from zeroshard.precision.policy import PrecisionPolicy

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "zeroshard"


def _leaf_keys(cls: type[ConfigBlock], path: str = "") -> Iterator[str]:
    """Every dotted key of the schema that holds a value (nested blocks are walked, not listed)."""
    for name, f in cls.key_fields().items():
        key = f"{path}.{name}" if path else name
        spec = spec_of(f)
        if spec is not None and spec.kind is Kind.BLOCK and spec.block_type is not None:
            yield from _leaf_keys(spec.block_type, key)
        else:
            yield key


LEAF_KEYS = sorted(_leaf_keys(ZeroshardConfig))


def _buckets(key: str) -> list[str]:
    found = [
        ("IMPLEMENTED", key in IMPLEMENTED),
        ("UNIMPLEMENTED", is_unimplemented(key)),
        ("ONLY_DEFAULT", key in ONLY_DEFAULT),
        ("NO_OP_BY_DESIGN", key in NO_OP_BY_DESIGN),
    ]
    return [name for name, listed in found if listed]


def test_every_key_is_in_exactly_one_bucket() -> None:
    assert len(LEAF_KEYS) > 200  # the walk reached the nested blocks
    nowhere = [key for key in LEAF_KEYS if not _buckets(key)]
    assert not nowhere, f"keys accepted and silently ignored; list each in config/support.py: {nowhere}"
    twice = {key: _buckets(key) for key in LEAF_KEYS if len(_buckets(key)) > 1}
    assert not twice, f"keys in more than one bucket: {twice}"


def test_lists_name_real_keys() -> None:
    for key in (*IMPLEMENTED, *ONLY_DEFAULT, *NO_OP_BY_DESIGN):
        assert key in LEAF_KEYS, key


# config modules that act on a block rather than describe it (elasticity sets the batch triple at resolve time)
CONFIG_APPLIERS = frozenset({"elasticity.py"})


def _attributes_read_outside_config() -> set[str]:
    """Attribute names read (not assigned) anywhere in src/zeroshard outside config/, plus getattr names."""
    names: set[str] = set()
    for source in SRC.rglob("*.py"):
        if source.relative_to(SRC).parts[0] == "config" and source.name not in CONFIG_APPLIERS:
            continue
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names.add(node.attr)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
                if (
                    len(node.args) > 1
                    and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str)
                ):
                    names.add(node.args[1].value)
    return names


def test_implemented_keys_are_read_outside_config() -> None:
    read = _attributes_read_outside_config()
    unread = sorted(key for key in IMPLEMENTED if key.rsplit(".", 1)[-1] not in read)
    assert not unread, f"listed as IMPLEMENTED but no code outside config/ reads them: {unread}"


def test_no_op_reasons_are_one_line() -> None:
    for key, reason in NO_OP_BY_DESIGN.items():
        assert reason.strip() and "\n" not in reason and len(reason) < 200, key
    for key, reason in ONLY_DEFAULT.items():
        assert reason.strip() and "\n" not in reason, key


# A config per ONLY_DEFAULT key that sets it to a value other than the default (and is valid otherwise).
REFUSED_SAMPLES: dict[str, dict[str, Any]] = {}  # none today (offload_optimizer.ratio left it: partial offload)


def test_only_default_keys_are_refused_otherwise() -> None:
    assert set(REFUSED_SAMPLES) == set(ONLY_DEFAULT)
    for key, sample in REFUSED_SAMPLES.items():
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            resolve_config(parse_config(sample), world_size=1)


@pytest.mark.parametrize(
    ("precision", "expected"),
    [
        ({}, False),
        ({"fp16": {"enabled": True}}, True),
        ({"bf16": {"enabled": True}}, True),  # DeepSpeed's default: check_grad_overflow true
        ({"bf16": {"enabled": True, "check_grad_overflow": False}}, False),
        ({"bf16": {"enabled": False, "check_grad_overflow": True}}, False),
    ],
)
def test_precision_policy_checks_overflow(precision: dict[str, Any], expected: bool) -> None:
    policy = PrecisionPolicy.from_config(parse_config(precision))
    assert policy.check_overflow is expected
    assert policy.fp16 is ("fp16" in precision)
