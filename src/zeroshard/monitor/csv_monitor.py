"""`csv_monitor`: one CSV file per event name, DeepSpeed's layout and columns."""

from __future__ import annotations

import csv
import os

from zeroshard.config.monitor import CSVMonitorConfig
from zeroshard.monitor.base import Event, Monitor, log_dir, writes_here


class CSVMonitor(Monitor):
    """`Train/Samples/lr` goes to `<output_path>/<job_name>/Train_Samples_lr.csv` with the header
    `step,lr` (the last part of the name), one `samples,value` row per event, as DeepSpeed's csvMonitor
    (`log_dir` None where it is inert: base.py).

    Example:
        >>> CSVMonitor(CSVMonitorConfig()).log_dir is None  # a disabled block writes nothing
        True
    """

    def __init__(self, config: CSVMonitorConfig):
        super().__init__(config)
        self.output_path, self.job_name = config.output_path, config.job_name
        self.filenames: list[str] = []  # files given their header by this run (DeepSpeed appends to old ones)
        self.log_dir = log_dir(config.output_path, config.job_name, "csv_monitor") if writes_here(config) else None

    def write_events(self, events: list[Event]) -> None:
        if self.log_dir is None:
            return
        for name, value, step in events:
            filename = name.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.log_dir, f"{filename}.csv"), "a+", newline="") as f:
                writer = csv.writer(f)
                if filename not in self.filenames:
                    self.filenames.append(filename)
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        self.log_dir = None  # every event was written with its file closed; later ones are not written


csvMonitor = CSVMonitor  # noqa: N816 - DeepSpeed's name (deepspeed.monitor.csv_monitor.csvMonitor)
