"""Where swap files live on disk, and how they are created and opened.

[Note: file layout] One file per key, `<nvme_path>/zeroshard_swap_<pid>_<uid>/<n>_<key>.swp`, holding the
tensor's bytes padded with zeros to a multiple of 4096 (O_DIRECT lengths must be). Reading checks the file
is exactly that size, so a truncated or overwritten file fails with its name rather than returning garbage.
The directory is removed by `close()`, when the swapper is garbage collected, and at interpreter exit; a
process ended by a signal (SIGKILL, SIGTERM) leaves it behind. [Note: stale swap directories] Beside each directory,
`<directory>.owner` records the host, the pid and the process's start time (so a reused pid is not mistaken for its
owner); the next run's preflight removes the directories of processes of this host that no longer run, and says so.
Every rank of the node runs it at once: a rank takes a directory by renaming its record to `<record>.<pid>` (one
rename succeeds), and a claim whose rank died is put back first. A directory that cannot be removed whole keeps its
record, so that a later run retries.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import uuid
from pathlib import Path

from zeroshard.offload.aio import ALIGNMENT, IoMode, align_up, open_flags
from zeroshard.offload.nvme_request import NvmeSwapError
from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)


def make_swap_directory(path: str | Path) -> Path:
    """A new directory for this process's swap files under `path` (readable by its owner only)."""
    directory = Path(path) / f"zeroshard_swap_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    directory.mkdir(mode=0o700)
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}
    _owner_file(directory).write_text(json.dumps(owner), encoding="utf-8")
    return directory


def _owner_file(directory: Path) -> Path:
    return directory.with_name(directory.name + ".owner")


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc), None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the command name in parentheses may hold spaces


def remove_stale_swap_directories(path: str | Path) -> list[tuple[Path, int]]:
    """Remove the swap directories under `path` of this host's processes that no longer run ([Note: stale swap
    directories]); returns each removed directory and the bytes it held. Others' directories are left alone."""
    removed = []
    host = socket.gethostname()
    for claim in Path(path).glob("zeroshard_swap_*.owner.*"):  # a claim whose rank died removing it: back in play
        claimer = claim.name.rsplit(".", 1)[1]
        if claimer.isdigit() and not _alive(int(claimer), None):
            with contextlib.suppress(OSError):
                os.replace(claim, claim.with_name(claim.name.rsplit(".", 1)[0]))
    for record in Path(path).glob("zeroshard_swap_*.owner"):
        directory = record.with_name(record.name.removesuffix(".owner"))
        try:
            owner = json.loads(record.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # not ours to judge (or another rank of this node took it first)
        if owner.get("host") != host or _alive(int(owner["pid"]), owner.get("start")):
            continue
        # Every rank of the node runs this at once: the one whose rename of the record succeeds removes the
        # directory, the others leave it (they read sizes of files being deleted, and a rank died of it)
        claim = record.with_name(f"{record.name}.{os.getpid()}")
        try:
            os.rename(record, claim)
        except OSError:
            continue
        size = _bytes_in(directory)
        if remove_swap_directory(directory, claim):
            removed.append((directory, size))
    return removed


def _bytes_in(directory: Path) -> int:
    total = 0
    for entry in directory.iterdir() if directory.is_dir() else ():
        try:
            total += entry.stat().st_size if entry.is_file() else 0
        except OSError:  # (gone meanwhile)
            continue
    return total


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return start is None or _start_time(pid) == start  # the same pid, a new process: the owner is gone


def remove_swap_directory(directory: Path, record: Path | None = None) -> bool:
    """Remove `directory` and then its owner record (`record`: where it is, if not beside it under its own name);
    a directory that cannot be removed whole keeps its record, under its own name, so that a later run retries,
    and is named in a warning. Never raises (it runs at interpreter exit too)."""
    record = record or _owner_file(directory)
    shutil.rmtree(directory, ignore_errors=True)
    if directory.exists():
        with contextlib.suppress(OSError):
            os.replace(record, _owner_file(directory))
        logger.warning("swap directory %s could not be removed whole; a later run on this host retries", directory)
        return False
    try:
        record.unlink(missing_ok=True)
    except OSError as err:  # (the filesystem went read-only)
        logger.warning("swap directory %s removed, but not its owner record %s: %s", directory, record, err)
    return True


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
