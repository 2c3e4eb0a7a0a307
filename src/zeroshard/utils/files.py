"""A folder this process can write to, found out by writing: permissions, read-only mounts and quotas all show."""

from __future__ import annotations

import contextlib
import os
import tempfile


def probe_writable(folder: str, prefix: str = ".zeroshard_probe_", make: bool = True, keep: bool = True) -> None:
    """Make `folder` (unless `make` is false) and create and remove one file in it; the OSError of what fails.

    With `keep` false the folders the probe made are removed again (a check before work that may be refused
    leaves nothing behind); those that existed stay."""
    folder = os.path.abspath(folder)  # (what makedirs makes of "a/../b" is what _missing lists)
    made = _missing(folder) if make and not keep else []
    try:
        if make:
            os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=prefix, dir=folder)
        os.close(fd)
        os.unlink(probe)
    finally:
        for path in made:  # deepest first
            with contextlib.suppress(OSError):
                os.rmdir(path)


def _missing(folder: str) -> list[str]:
    """The folders `os.makedirs(folder)` would make, deepest first."""
    missing = []
    path = os.path.abspath(folder)
    while not os.path.exists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing
