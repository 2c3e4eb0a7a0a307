"""Check an `nvme_path` before training starts, so a bad path fails in seconds, not at the first swap."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from zeroshard.errors import ConfigError


def _size(nbytes: int) -> str:
    return f"{nbytes} bytes ({nbytes / 2**30:.2f} GiB)"


def preflight(path: str | Path | None, bytes_needed: int, key: str = "nvme_path") -> None:
    """Raise ConfigError naming `key`, `path` and the bytes needed unless `path` can hold the swap files.

    `path` must exist, be a directory, accept a new file, and have at least `bytes_needed` bytes free.
    `key` is the ds_config key the path came from, e.g. `zero_optimization.offload_optimizer.nvme_path`.

    >>> import tempfile
    >>> preflight(tempfile.gettempdir(), 1 << 20, key="zero_optimization.offload_param.nvme_path")
    """
    need = f"the NVMe swap files need {_size(bytes_needed)}"
    if path is None or str(path) == "":
        raise ConfigError(f"{key} is not set, but device 'nvme' needs a directory on a fast local drive; {need}")
    root = Path(path)
    if not root.exists():
        raise ConfigError(f"{key} = '{root}' does not exist; create it (on a fast local drive), {need}")
    if not root.is_dir():
        raise ConfigError(f"{key} = '{root}' is not a directory; point it at a directory, {need}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".zeroshard_preflight_", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ConfigError(
            f"{key} = '{root}' is not writable ({err.strerror or err}); choose a directory this process can "
            f"write to, {need}"
        ) from err
    free = shutil.disk_usage(root).free
    if free < bytes_needed:
        raise ConfigError(
            f"{key} = '{root}' has {_size(free)} free, but {need}; free {_size(bytes_needed - free)} "
            f"or choose another path"
        )
