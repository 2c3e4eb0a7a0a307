"""`csv_monitor`: one CSV file per event name, DeepSpeed's layout and columns."""

from __future__ import annotations

import csv
import os

from zeroshard.config.monitor import CSVMonitorConfig
from zeroshard.monitor.base import Event, log_dir


class CSVMonitor:
    """`Train/Samples/lr` goes to `<output_path>/<job_name>/Train_Samples_lr.csv` with the header
    `step,lr` (the last part of the name), one `samples,value` row per event, as DeepSpeed's csvMonitor."""

    def __init__(self, config: CSVMonitorConfig):
        self.log_dir = log_dir(config.output_path, config.job_name, "csv_monitor")
        self._started: set[str] = set()  # files given their header by this run (DeepSpeed appends to old ones)

    def write_events(self, events: list[Event]) -> None:
        for name, value, step in events:
            filename = name.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.log_dir, f"{filename}.csv"), "a+", newline="") as f:
                writer = csv.writer(f)
                if filename not in self._started:
                    self._started.add(filename)
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        pass  # every event is written with its file closed


csvMonitor = CSVMonitor  # noqa: N816 - DeepSpeed's name (deepspeed.monitor.csv_monitor.csvMonitor)
