"""DeepSpeed's monitors (`tensorboard`, `csv_monitor`, `wandb`, `comet`) and its FLOPs profiler (`flops_profiler`).

`initialize` opens the monitors before it touches the model (opening.py); the engine holds one `Telemetry`
(telemetry.py) over them and tells it what happened: a backward, a step, a forward.
"""

from zeroshard.monitor.base import Event, Monitor
from zeroshard.monitor.opening import open_monitors
from zeroshard.monitor.telemetry import Telemetry

__all__ = ["Event", "Monitor", "Telemetry", "open_monitors"]
