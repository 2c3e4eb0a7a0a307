"""A folder this process can write to, found out by writing: permissions, read-only mounts and quotas all show."""

from __future__ import annotations

import os
import tempfile


def probe_writable(folder: str, prefix: str = ".zeroshard_probe_", make: bool = True) -> None:
    """Make `folder` (unless `make` is false) and create and remove one file in it; the OSError of what fails."""
    if make:
        os.makedirs(folder, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=prefix, dir=folder)
    os.close(fd)
    os.unlink(probe)
