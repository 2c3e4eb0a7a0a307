"""A fixture for in-process tests that call `zeroshard.initialize` (which starts a one-process group)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def own_process_group() -> Iterator[None]:
    """Imported into a test module, every test there leaves no process group behind it that it found none before."""
    import torch.distributed as dist

    had = dist.is_initialized()
    yield
    if not had and dist.is_initialized():
        dist.destroy_process_group()
