"""A collective's handle whose wait also finishes the work that needs its result (dequantize, copy out)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from zeroshard.comm.collectives import Handle


class Then:
    """Waits for `inner`, then runs `finish` once (also when waited on again)."""

    def __init__(self, inner: Handle, finish: Callable[[], None]):
        self.inner = inner
        self.finish: Callable[[], None] | None = finish

    def wait(self, timeout: Any = None) -> bool:
        if timeout is None:
            self.inner.wait()
        else:
            self.inner.wait(timeout)  # type: ignore[call-arg]  # Work.wait's timeout (comm/divergence.py)
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()
        return True
