"""Crash-safe file operations: fsync, atomic replace, directory commit, and the fault-injection hook.

[Note: crash safety]
A save writes every file into `<save_dir>/.tmp.<tag>.<nonce>/`, fsyncs each file, and (rank 0, once
every rank has reported) writes `metadata.json` last, fsyncs the directories and renames the temporary
directory to `<save_dir>/<tag>`: a directory named after a tag is always complete. Re-saving an existing
tag first renames the old directory to `.old.<tag>.<nonce>`; if the process dies between the two renames,
`resolve_tag_dir` finds and uses that complete old copy. `latest` is replaced atomically (write a
temporary file, fsync, `os.replace`, fsync the directory) only after the rename. So a process killed at
any moment leaves the previous checkpoint intact and `latest` naming a complete checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import time
import zlib

from zeroshard.checkpoint.errors import CheckpointError

FAULT_ENV = "ZEROSHARD_CHECKPOINT_FAULT"
_NONCE = re.compile("[0-9a-f]{12}")  # a save's nonce (save.py: uuid4().hex[:12])
PROCESS_STARTED = time.time()  # (imported as the engine starts): what is older was left by an earlier run


def fault_point(name: str, rank: int) -> None:
    """Test hook: SIGKILL this process at `name` when ZEROSHARD_CHECKPOINT_FAULT is `name` or `name@rank`.

    The crash tests use it to kill a save at chosen moments; unset (always, outside tests) it does nothing.
    """
    wanted = os.environ.get(FAULT_ENV)
    if wanted and wanted in (name, f"{name}@{rank}"):
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: str, data: bytes) -> dict[str, object]:
    """Write and fsync `data`; returns its file record (`bytes`, `crc32`)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}


def replace_file_atomically(path: str, data: bytes) -> None:
    """`path` holds either its old content or `data`, never a mix, whatever happens."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    write_file(tmp, data)
    try:
        os.replace(tmp, path)
    except OSError:  # (`path` a directory, or not replaceable): no temporary file left beside it
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(directory)


def read_checked(path: str, record: dict[str, object] | None) -> bytes:
    """Read a small file and check its size and CRC against its metadata record."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: checkpoint file is missing") from None
    if record is not None:
        if len(data) != record["bytes"]:
            raise CheckpointError(
                f"{path}: file is {len(data)} bytes but the checkpoint metadata says {record['bytes']}; truncated"
            )
        if f"{zlib.crc32(data):08x}" != record["crc32"]:
            raise CheckpointError(f"{path}: checksum mismatch; the file is corrupted")
    return data


def fsync_tree(root: str) -> None:
    for dirpath, _, _ in os.walk(root):
        fsync_dir(dirpath)


def commit_directory(tmp: str, final: str, nonce: str, rank: int) -> None:
    """Rename the finished `tmp` to `final`, replacing an existing `final` (see [Note: crash safety])."""
    parent = os.path.dirname(final)
    tag = os.path.basename(final)
    old = None
    if os.path.exists(final):
        old = os.path.join(parent, f".old.{tag}.{nonce}")
        os.rename(final, old)
        fault_point("between_renames", rank)
    os.rename(tmp, final)
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    remove_leftovers(parent, keep=nonce)


def remove_leftovers(save_dir: str, keep: str) -> None:
    """Remove what interrupted saves left in `save_dir`, whatever their tag (a save interrupted at step 100 is not
    retried under that tag): temporary directories of saves older than this process (an earlier run's, which no one
    will finish; a save of this process other than this one, `keep`, may still be writing: another engine's, a
    decoupled one), and old copies a re-save set aside whose tag is in place again. An old copy whose tag is missing
    is what loading falls back to ([Note: crash safety]): kept."""
    for name in os.listdir(save_dir):
        kind = name[:5]
        left_tag, _, nonce = name[5:].rpartition(".")
        if kind not in (".tmp.", ".old.") or not left_tag or not _NONCE.fullmatch(nonce):
            continue
        if nonce == keep:  # this save's (an export commits two folders)
            continue
        path = os.path.join(save_dir, name)
        if kind == ".old." and os.path.isdir(os.path.join(save_dir, left_tag)):
            shutil.rmtree(path, ignore_errors=True)
        elif kind == ".tmp." and _older_than_this_process(path):
            shutil.rmtree(path, ignore_errors=True)


def _older_than_this_process(path: str) -> bool:
    try:
        return os.stat(path).st_mtime < PROCESS_STARTED
    except FileNotFoundError:
        return False
