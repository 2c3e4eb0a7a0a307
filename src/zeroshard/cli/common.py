"""What every subcommand shares: the error type, exit codes, output and byte formatting."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Final

EXIT_OK: Final = 0
EXIT_FAILURE: Final = 1
EXIT_CONFIG: Final = 2  # a bad ds_config or bad arguments (argparse uses 2 too)


class CLIError(Exception):
    """A user-facing error: printed as one line (no traceback unless --debug), then exit `code`."""

    def __init__(self, message: str, code: int = EXIT_FAILURE):
        super().__init__(message)
        self.code = code


def add_subcommand(
    sub: Any, name: str, parents: list[argparse.ArgumentParser], summary: str, doc: str | None
) -> argparse.ArgumentParser:
    """Register `zeroshard NAME`, its --help showing the module docstring `doc` with its examples' layout kept."""
    return sub.add_parser(
        name, parents=parents, help=summary, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def out(text: str = "") -> None:
    """The command's result, on stdout (diagnostics go through the logger, to stderr)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
