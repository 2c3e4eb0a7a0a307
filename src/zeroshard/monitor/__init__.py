"""DeepSpeed's monitors (`tensorboard`, `csv_monitor`, `wandb`, `comet`) and its FLOPs profiler (`flops_profiler`).

The engine holds one `Telemetry` (telemetry.py) and tells it what happened: a backward, a step, a forward.
"""

from zeroshard.monitor.base import Event, Monitor
from zeroshard.monitor.telemetry import Telemetry

__all__ = ["Event", "Monitor", "Telemetry"]
