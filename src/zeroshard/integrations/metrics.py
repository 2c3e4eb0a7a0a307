"""Training metrics on rank 0: a CSV file, TensorBoard when it is installed, and a progress display.

The CSV has a fixed header (`COLUMNS`); a value a row does not have is left empty (evaluation runs
every `--eval-steps`, so most rows have no eval_loss).
"""

from __future__ import annotations

import csv
import importlib.util
import os
import sys
from typing import Any, Final, TextIO

from zeroshard.utils.logging import get_logger

logger = get_logger(__name__)

COLUMNS: Final = (
    "step",
    "epoch",
    "loss",
    "eval_loss",
    "lr",
    "grad_norm",
    "tokens",
    "tokens_per_s",
    "model_states_mib_max",
    "rss_mib_max",
    "elapsed_s",
)


class MetricsWriter:
    """Appends rows to `metrics.csv` and mirrors scalars to TensorBoard. A run resumed at step `resumed_at` keeps
    the file's rows up to that step and drops later ones (they are trained again), so no step appears twice."""

    def __init__(self, output_dir: str, enabled: bool, resumed_at: int):
        self.enabled = enabled
        self.path = os.path.join(output_dir, "metrics.csv")
        self._file: TextIO | None = None
        self._writer: csv.DictWriter[str] | None = None
        self._tb: Any = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        existing = resumed_at > 0 and os.path.exists(self.path)
        if existing:
            _truncate_after(self.path, resumed_at)
        self._file = open(self.path, "a" if existing else "w", newline="", encoding="utf-8")  # noqa: SIM115
        self._writer = csv.DictWriter(self._file, fieldnames=list(COLUMNS), extrasaction="ignore")
        if not existing:
            self._writer.writeheader()
        if importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))

    def write(self, row: dict[str, Any]) -> None:
        if self._writer is None or self._file is None:
            return
        self._writer.writerow({k: _fmt(v) for k, v in row.items()})
        self._file.flush()
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, int | float):
                    self._tb.add_scalar(key, value, row["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def _truncate_after(path: str, step: int) -> None:
    """Rewrite `path` (atomically) without the rows of steps after `step`."""
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    kept = [row for row in rows if not row.get("step") or int(float(row["step"])) <= step]
    tmp = path + ".tmp"
    with open(tmp, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(COLUMNS), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(kept)
    os.replace(tmp, path)


def _fmt(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else value


class Progress:
    """A tqdm bar on rank 0 when stderr is a terminal; log lines on stdout either way."""

    def __init__(self, total: int, initial: int, enabled: bool, bar: bool | None):
        self.enabled = enabled
        use_bar = sys.stderr.isatty() if bar is None else bar
        self._bar: Any = None
        if enabled and use_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)

    def advance(self, postfix: dict[str, str] | None = None) -> None:
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(1)

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def rss_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
