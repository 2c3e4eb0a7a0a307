"""metrics.csv across a restart: the resumed run keeps the rows up to its step and writes the rest once."""

from __future__ import annotations

import csv

from zeroshard.integrations.metrics import MetricsWriter


def _steps(path: str) -> list[int]:
    with open(path, newline="", encoding="utf-8") as handle:
        return [int(row["step"]) for row in csv.DictReader(handle)]


def test_a_resumed_run_truncates_metrics_to_its_step(tmp_path):
    first = MetricsWriter(str(tmp_path), enabled=True, resumed_at=0)
    for step in range(1, 8):  # the run got to step 7, its last checkpoint was at step 4
        first.write({"step": step, "loss": 1.0 / step})
    first.close()
    resumed = MetricsWriter(str(tmp_path), enabled=True, resumed_at=4)
    for step in range(5, 9):
        resumed.write({"step": step, "loss": 0.5 / step})
    resumed.close()
    assert _steps(resumed.path) == list(range(1, 9))
    fresh = MetricsWriter(str(tmp_path), enabled=True, resumed_at=0)  # a new run starts a new file
    fresh.close()
    assert _steps(fresh.path) == []
