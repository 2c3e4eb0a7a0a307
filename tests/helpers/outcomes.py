"""What a call on one rank came to, for tests whose subject is the error each rank sees."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def outcome(call: Callable[[], Any]) -> tuple[str, str, float]:
    """(the zeroshard error's class name, its message, seconds taken); ("", "", seconds) when `call` returned."""
    import zeroshard

    start = time.monotonic()
    try:
        call()
    except zeroshard.ZeroshardError as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return "", "", time.monotonic() - start
