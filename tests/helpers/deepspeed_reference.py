"""DeepSpeed as the reference of the parity tests: import it, or fail saying how to install it.

DeepSpeed is a test reference only (the `compat` extra, which `make test` installs); src/ never imports it.
A missing DeepSpeed fails the parity tests instead of skipping them, so a run cannot pass green without the
comparison. On a machine that cannot have DeepSpeed, `ZEROSHARD_ALLOW_NO_DEEPSPEED=1` turns that failure
into a skip; a DeepSpeed that is installed but does not import fails either way.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import pytest

ALLOW_MISSING = "ZEROSHARD_ALLOW_NO_DEEPSPEED"
PINNED = "0.19.8"  # the version pyproject.toml's `compat` extra pins; the parity expectations are its behaviour
INSTALL = f"DS_BUILD_OPS=0 pip install -e '.[compat]' (DeepSpeed {PINNED}, ops unbuilt), or `make install-compat`"


def import_deepspeed(module: str = "deepspeed") -> ModuleType:
    """Import `module` of DeepSpeed; fail the test if DeepSpeed is absent (skip only when allowed)."""
    if importlib.util.find_spec("deepspeed") is None:
        message = f"DeepSpeed is the reference of this test and is not installed: {INSTALL}"
        if os.environ.get(ALLOW_MISSING) == "1":
            pytest.skip(f"{message} ({ALLOW_MISSING}=1)")
        pytest.fail(f"{message}; or set {ALLOW_MISSING}=1 to skip the DeepSpeed-parity tests", pytrace=False)
    return importlib.import_module(module)
