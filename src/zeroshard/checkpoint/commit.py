"""A save's last steps on the committing rank: the tag checked, its folder renamed into place, `latest` and the
recovery script written beside it."""

from __future__ import annotations

import contextlib
import os
import stat

from zeroshard.checkpoint.atomic import commit_directory, fault_point, fsync_tree, replace_file_atomically, write_file
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import LATEST_FILE, METADATA_FILE
from zeroshard.utils.logging import get_logger, log_rank

logger = get_logger(__name__)


def validate_tag(tag: str, root: str) -> str:
    if not tag or tag in (".", "..") or "/" in tag or os.sep in tag or tag.startswith("."):
        raise CheckpointError(f"checkpoint tag {tag!r} must be a plain directory name (no '/', not hidden)")
    if tag in _RESERVED:  # the folder's own files: a tag named so replaced `latest` with itself
        raise CheckpointError(
            f"checkpoint tag {tag!r} is the name of the save folder's {_RESERVED[tag]}; choose another"
        )
    path = os.path.join(root, tag)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise CheckpointError(f"save_checkpoint: {path} exists and is not a checkpoint folder; choose another tag")
    return tag


_RESERVED = {
    LATEST_FILE: "pointer to its last tag",
    "latest_universal": "pointer to its universal checkpoint (ds_to_universal)",
    "zero_to_fp32.py": "recovery script",
    "zero_to_torch.py": "recovery script",
}


def commit_tag(save_dir: str, tmp_dir: str, tag: str, nonce: str, meta: str, save_latest: bool) -> str:
    write_file(os.path.join(tmp_dir, METADATA_FILE), meta.encode())
    fsync_tree(tmp_dir)
    fault_point("before_rename", 0)
    final = os.path.join(save_dir, tag)
    commit_directory(tmp_dir, final, nonce, 0)
    fault_point("before_latest", 0)
    try:
        if save_latest:
            replace_file_atomically(os.path.join(save_dir, LATEST_FILE), tag.encode())
    except OSError as e:
        raise CommittedWithoutLatest(
            f"checkpoint {final} was committed, but {os.path.join(save_dir, LATEST_FILE)} could not be written ({e}): "
            f"load it with tag={tag!r}, and fix the folder for the next save"
        ) from e
    try:
        write_recovery_script(save_dir)
    except OSError as e:  # a convenience beside the checkpoint (`zeroshard convert` does the same): not a failed save
        log_rank(logger, 30, f"checkpoint {final} saved, but its recovery script could not be written: {e}", None)
    return final


class CommittedWithoutLatest(CheckpointError):
    """The tag's folder is in place (loadable by its tag); the pointer beside it is not."""


def write_recovery_script(save_dir: str) -> None:
    """`zero_to_fp32.py` and `zero_to_torch.py` beside `latest`, as DeepSpeed copies its recovery scripts there at
    every save: `python zero_to_fp32.py . OUT` in a checkpoint folder consolidates it (`zeroshard.utils.zero_to_fp32.
    main`; `zero_to_torch.py . OUT --dtype bf16` in another dtype)."""
    from zeroshard.utils import zero_to_fp32, zero_to_torch

    failed: OSError | None = None
    for script in (zero_to_fp32, zero_to_torch):  # each on its own: one that cannot be written keeps the other
        path = os.path.join(save_dir, script.RECOVERY_SCRIPT)
        with contextlib.suppress(OSError):
            with open(path, encoding="utf-8") as f:
                if f.read() == script.RECOVERY_SOURCE:
                    continue
        try:
            replace_file_atomically(path, script.RECOVERY_SOURCE.encode())
        except OSError as e:
            failed = failed or e
            continue
        with contextlib.suppress(OSError):  # (a file share may refuse it; DeepSpeed goes on too)
            os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    if failed is not None:
        raise failed
