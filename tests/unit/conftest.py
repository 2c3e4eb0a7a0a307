"""Fixtures of the unit tests."""

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from helpers.config_checks import log  # noqa: F401  (the zeroshard-logger capture fixture)


@pytest.fixture(autouse=True)
def _no_process_group_left_behind() -> Iterator[None]:
    """A test that initialised torch.distributed (an in-process engine) destroys it, and the groups the engine
    published, so the next test's assumptions (no process group yet) do not depend on the order tests run in."""
    from zeroshard.utils import groups

    had = dist.is_initialized()
    yield
    if not had and dist.is_initialized():
        groups.publish(None)  # an engine left undestroyed: its groups go with the process group
        dist.destroy_process_group()
