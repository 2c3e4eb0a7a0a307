"""Check an `nvme_path` before training starts, so a bad path fails in seconds, not at the first swap."""

from __future__ import annotations

import shutil
from pathlib import Path

from zeroshard.errors import ConfigError
from zeroshard.offload.nvme_files import remove_stale_swap_directories
from zeroshard.utils.files import probe_writable
from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)


def _size(nbytes: int) -> str:
    return f"{nbytes} bytes ({nbytes / 2**30:.2f} GiB)"


def preflight(path: str | Path | None, bytes_needed: int, key: str = "nvme_path", sharing_ranks: int = 1) -> None:
    """Raise ConfigError naming `key`, `path` and the bytes needed unless `path` can hold the swap files.

    `path` must exist, be a directory, accept a new file, and have at least `bytes_needed` bytes free for each
    of the `sharing_ranks` processes of this node that put their swap files there. Swap directories left by
    processes of this host that no longer run are removed first ([Note: stale swap directories]).
    `key` is the ds_config key the path came from, e.g. `zero_optimization.offload_optimizer.nvme_path`.

    >>> import tempfile
    >>> preflight(tempfile.gettempdir(), 1 << 20, key="zero_optimization.offload_param.nvme_path")
    """
    sharing = f" for each of the {sharing_ranks} ranks of this node" if sharing_ranks > 1 else ""
    need = f"the NVMe swap files need {_size(bytes_needed)}{sharing}"
    bytes_needed *= max(sharing_ranks, 1)
    if path is None or str(path) == "":
        raise ConfigError(f"{key} is not set, but device 'nvme' needs a directory on a fast local drive; {need}")
    root = Path(path)
    if not root.exists():
        raise ConfigError(f"{key} = '{root}' does not exist; create it (on a fast local drive), {need}")
    if not root.is_dir():
        raise ConfigError(f"{key} = '{root}' is not a directory; point it at a directory, {need}")
    try:
        probe_writable(str(root), ".zeroshard_preflight_", make=False)
    except OSError as err:
        raise ConfigError(
            f"{key} = '{root}' is not writable ({err.strerror or err}); choose a directory this process can "
            f"write to, {need}"
        ) from err
    for directory, nbytes in remove_stale_swap_directories(root):
        logger.warning("removed %s (%s), left by a process of this host that no longer runs", directory, _size(nbytes))
    free = shutil.disk_usage(root).free
    if free < bytes_needed:
        raise ConfigError(
            f"{key} = '{root}' has {_size(free)} free, but {need}; free {_size(bytes_needed - free)} "
            f"or choose another path"
        )
