"""DeepSpeed's monitor classes built by a script (its `tests/unit/monitor/test_monitor.py`, with the import swapped),
`MonitorMaster`, and the rule that only an enabled block on global rank 0 writes."""

from __future__ import annotations

import csv
import pathlib
from unittest.mock import Mock, patch

import pytest

from zeroshard.monitor.comet import CometMonitor
from zeroshard.monitor.config import DeepSpeedMonitorConfig
from zeroshard.monitor.csv_monitor import csvMonitor
from zeroshard.monitor.monitor import MonitorMaster
from zeroshard.monitor.tensorboard import TensorBoardMonitor
from zeroshard.monitor.wandb import WandbMonitor
from zeroshard.runtime.config import DeepSpeedConfig

EVENTS = [("Train/Samples/lr", 1e-3, 8), ("Train/Samples/lr", 2e-3, 16)]


def _rows(path: pathlib.Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


@pytest.fixture
def rank_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as global rank 1 of a started process group."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)


def test_tensorboard_and_csv_as_deepspeeds_tests(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    block = {"enabled": True, "output_path": "test_output/ds_logs/", "job_name": "test"}
    config = DeepSpeedConfig({"train_batch_size": 2, "tensorboard": block, "csv_monitor": block})
    tb = TensorBoardMonitor(config.monitor_config.tensorboard)
    assert (tb.enabled, tb.output_path, tb.job_name) == (True, "test_output/ds_logs/", "test")
    assert tb.summary_writer is not None
    tb.close()
    monitor = csvMonitor(config.monitor_config.csv_monitor)
    assert (monitor.enabled, monitor.output_path, monitor.job_name) == (True, "test_output/ds_logs/", "test")
    monitor.write_events(EVENTS)
    assert _rows(tmp_path / "test_output/ds_logs/test/Train_Samples_lr.csv") == [
        ["step", "lr"],
        ["8", "0.001"],
        ["16", "0.002"],
    ]
    defaults = DeepSpeedMonitorConfig()
    empty = DeepSpeedConfig({"train_batch_size": 2, "tensorboard": {}, "csv_monitor": {}}).monitor_config
    tb, monitor = TensorBoardMonitor(empty.tensorboard), csvMonitor(empty.csv_monitor)
    for ours, default in ((tb, defaults.tensorboard), (monitor, defaults.csv_monitor)):
        assert (ours.enabled, ours.output_path, ours.job_name) == (False, default.output_path, default.job_name)
    assert tb.summary_writer is None and monitor.log_dir is None
    monitor.write_events(EVENTS)  # a disabled monitor writes nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test_output"]


def test_wandb_as_deepspeeds_tests() -> None:
    block = {"enabled": False, "group": "my_group", "team": "my_team", "project": "my_project"}
    monitor = WandbMonitor(DeepSpeedConfig({"train_batch_size": 2, "wandb": block}).monitor_config.wandb)
    assert (monitor.enabled, monitor.group, monitor.team, monitor.project) == (
        False,
        "my_group",
        "my_team",
        "my_project",
    )
    defaults = DeepSpeedMonitorConfig().wandb
    empty = WandbMonitor(DeepSpeedConfig({"train_batch_size": 2, "wandb": {}}).monitor_config.wandb)
    assert (empty.enabled, empty.group, empty.team, empty.project) == (
        defaults.enabled,
        defaults.group,
        defaults.team,
        defaults.project,
    )
    empty.write_events(EVENTS)  # no run: nothing is logged (wandb.log without a run would raise)
    assert empty.run is None


COMET = {
    "enabled": True,
    "samples_log_interval": 42,
    "workspace": "some-workspace",
    "project": "some-project",
    "api_key": "some-api-key",
    "experiment_name": "some-experiment-name",
    "experiment_key": "some-experiment-key",
    "mode": "get_or_create",
    "online": True,
}


def test_comet_as_deepspeeds_tests() -> None:
    import comet_ml

    experiment = Mock()
    start = Mock(return_value=experiment)
    config = DeepSpeedConfig({"train_batch_size": 2, "comet": COMET})
    with patch.object(comet_ml, "start", start):
        monitor = CometMonitor(config.monitor_config.comet)
    assert monitor.enabled is True and monitor.samples_log_interval == 42
    start.assert_called_once_with(
        api_key="some-api-key",
        project="some-project",
        workspace="some-workspace",
        experiment_key="some-experiment-key",
        mode="get_or_create",
        online=True,
    )
    experiment.set_name.assert_called_once_with("some-experiment-name")
    assert monitor.experiment is experiment
    monitor.write_events([("Train/Samples/lr", 1.0, 0), ("Train/Samples/lr", 2.0, 41), ("Train/Samples/lr", 3.0, 42)])
    logged = [c.args for c in experiment.log_metric.call_args_list]
    assert logged == [("Train/Samples/lr", 1.0), ("Train/Samples/lr", 3.0)]  # one per samples_log_interval
    start = Mock()
    with patch.object(comet_ml, "start", start):
        empty = CometMonitor(DeepSpeedConfig({"train_batch_size": 2, "comet": {}}).monitor_config.comet)
    defaults = DeepSpeedMonitorConfig().comet
    assert (empty.enabled, empty.samples_log_interval) == (defaults.enabled, defaults.samples_log_interval)
    start.assert_not_called()


def test_only_global_rank_0_writes(tmp_path: pathlib.Path, rank_one: None) -> None:
    """DeepSpeed's tests build the monitors on both ranks: on rank 1 an enabled block starts nothing."""
    import comet_ml
    import wandb

    block = {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}
    config = DeepSpeedConfig(
        {"train_batch_size": 2, "tensorboard": block, "csv_monitor": block, "comet": COMET, "wandb": {"enabled": True}}
    )
    start, init = Mock(), Mock()
    with patch.object(comet_ml, "start", start), patch.object(wandb, "init", init):
        comet = CometMonitor(config.monitor_config.comet)
        run = WandbMonitor(config.monitor_config.wandb)
    assert comet.enabled and comet.experiment is None and run.enabled and run.run is None
    start.assert_not_called()
    init.assert_not_called()
    monitor = csvMonitor(config.monitor_config.csv_monitor)
    monitor.write_events(EVENTS)
    assert TensorBoardMonitor(config.monitor_config.tensorboard).summary_writer is None
    master = MonitorMaster(config.monitor_config)
    assert master.enabled and master.monitors == []
    assert list(tmp_path.iterdir()) == []


def test_monitor_master_writes_to_every_enabled_block(tmp_path: pathlib.Path) -> None:
    block = {"enabled": True, "output_path": str(tmp_path), "job_name": "job"}
    config = DeepSpeedConfig({"train_batch_size": 2, "tensorboard": block, "csv_monitor": block}).monitor_config
    master = MonitorMaster(config)
    assert master.enabled
    assert isinstance(master.tb_monitor, TensorBoardMonitor) and isinstance(master.csv_monitor, csvMonitor)
    assert master.wandb_monitor is None and master.comet_monitor is None
    writer = master.tb_monitor.get_summary_writer()
    master.write_events(EVENTS)
    master.close()
    assert _rows(tmp_path / "job" / "Train_Samples_lr.csv")[1:] == [["8", "0.001"], ["16", "0.002"]]
    files = sorted(p.name for p in (tmp_path / "job").iterdir())
    assert len([name for name in files if name.startswith("events.out.tfevents")]) == 1 and writer is not None
    assert master.tb_monitor is None and master.monitors == []
    master.write_events(EVENTS)  # closed: nothing more is written (a closed SummaryWriter would open a new file)
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == files
    assert _rows(tmp_path / "job" / "Train_Samples_lr.csv")[1:] == [["8", "0.001"], ["16", "0.002"]]
    off = MonitorMaster(DeepSpeedMonitorConfig())
    assert not off.enabled and off.monitors == [] and off.tb_monitor is None
    off.write_events(EVENTS)


def test_a_scripts_own_monitor_class_keeps_its_config(tmp_path: pathlib.Path) -> None:
    """DeepSpeed's `Monitor` base only stores the config: a subclass may use any config object."""
    from zeroshard.monitor.monitor import Monitor

    class Printer(Monitor):
        def write_events(self, events: list) -> None:
            self.seen = events

    printer = Printer({"path": str(tmp_path)})
    printer.write_events(EVENTS)
    assert printer.monitor_config == {"path": str(tmp_path)} and not printer.enabled and printer.seen == EVENTS
