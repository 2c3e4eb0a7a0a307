"""Where swap files live on disk, and how they are created and opened.

[Note: file layout] One file per key, `<nvme_path>/zeroshard_swap_<pid>_<uid>/<n>_<key>.swp`, holding the
tensor's bytes padded with zeros to a multiple of 4096 (O_DIRECT lengths must be). Reading checks the file
is exactly that size, so a truncated or overwritten file fails with its name rather than returning garbage.
The directory is removed by `close()`, when the swapper is garbage collected, and at interpreter exit; a
SIGKILL leaves it behind (delete `zeroshard_swap_*` directories of processes that no longer run).
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

from zeroshard.offload.aio import ALIGNMENT, IoMode, align_up, open_flags
from zeroshard.offload.nvme_request import NvmeSwapError


def make_swap_directory(path: str | Path) -> Path:
    """A new directory for this process's swap files under `path` (readable by its owner only)."""
    directory = Path(path) / f"zeroshard_swap_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    directory.mkdir(mode=0o700)
    return directory


def remove_swap_directory(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


def swap_file_path(directory: Path, serial: int, key: str) -> Path:
    """The file of the `serial`-th key swapped out; the key is kept, sanitised, to tell files apart."""
    return directory / f"{serial:06d}_{re.sub(r'[^A-Za-z0-9._-]', '_', key)[:64]}.swp"


def open_for_write(path: Path, nbytes: int, mode: IoMode) -> int:
    """A descriptor on `path` sized for `nbytes` padded to 4096; an existing file is rewritten in place."""
    fd = os.open(path, open_flags(mode, write=True), 0o600)
    try:
        os.ftruncate(fd, align_up(nbytes))
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_for_read(path: Path, key: str, nbytes: int, mode: IoMode) -> int:
    """A descriptor on `path`, checked to hold `nbytes` padded to 4096 (see [Note: file layout])."""
    try:
        fd = os.open(path, open_flags(mode, write=False))
    except FileNotFoundError as err:
        raise NvmeSwapError(f"swap file {path} for key {key!r} is missing (deleted?)") from err
    padded = align_up(nbytes)
    try:
        size = os.fstat(fd).st_size
        if size != padded:
            raise NvmeSwapError(
                f"swap file {path} for key {key!r} has {size} bytes, expected {padded} "
                f"({nbytes} tensor bytes padded to {ALIGNMENT}): truncated or overwritten"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd
