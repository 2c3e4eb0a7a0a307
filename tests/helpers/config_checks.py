"""Shared helpers of the ds_config unit tests (tests/unit/test_config_*.py)."""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest

import zeroshard.config as config_pkg
from zeroshard.config import parse_config
from zeroshard.errors import ConfigError
from zeroshard.utils.logging import get_logger

DATA = pathlib.Path(__file__).resolve().parents[1] / "unit" / "data"
CONFIG_DIR = pathlib.Path(config_pkg.__file__).parent


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Capture the zeroshard logger (it does not propagate to the root logger)."""
    logger = get_logger()
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="zeroshard")
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def error_of(source: Any) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(source)
    return str(info.value)
