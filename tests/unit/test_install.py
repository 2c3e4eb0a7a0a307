"""The Makefile installs the DeepSpeed that pyproject's compat extra pins (the parity tests' reference)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_makefile_builds_the_deepspeed_the_compat_extra_pins() -> None:
    makefile = re.search(r"^DEEPSPEED = (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    extra = re.search(r'^compat = \["([^"]+)"\]$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert makefile and extra and makefile.group(1) == extra.group(1)
