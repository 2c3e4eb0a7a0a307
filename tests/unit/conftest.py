"""Fixtures of the unit tests."""

from helpers.config_checks import log  # noqa: F401  (the zeroshard-logger capture fixture)
