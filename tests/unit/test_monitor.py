"""Monitors and the FLOPs profiler at world size 1: what they wrote, read back against the engine's values."""

from __future__ import annotations

import csv
import importlib.util
import pathlib

import pytest
import torch
from torch import nn

import zeroshard
from helpers.process_group import own_process_group  # noqa: F401 (an autouse fixture)
from zeroshard.comm.comms_logger import CommsLogger, bandwidths
from zeroshard.config.monitor import CommsLoggerConfig
from zeroshard.errors import ConfigError
from zeroshard.monitor.comet import CometMonitor

MICRO, GAS, STEPS, K, N, OUT = 3, 2, 3, 8, 16, 4


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(K, N, bias=False)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(N, OUT, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x))).float().pow(2).mean()


def _config(out: pathlib.Path, **blocks: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-3}},
        "fp16": {"enabled": True, "initial_scale_power": 4},
        "zero_optimization": {"stage": 1},
        **blocks,
    }


def _train(cfg: dict) -> tuple[zeroshard.Engine, list[float], list[float], list[float], list[int]]:
    """STEPS optimizer steps; per step: the mean micro-batch loss, lr and loss scale after it, samples."""
    torch.manual_seed(0)
    engine, _, _, _ = zeroshard.initialize(model=MLP(), config=cfg)
    losses, lrs, scales, samples = [], [], [], []
    for _ in range(STEPS):
        step_losses = []
        for _ in range(GAS):
            loss = engine(torch.randn(MICRO, K, dtype=torch.float16))
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / GAS)
        lrs.append(engine.get_lr()[0])
        scales.append(engine.loss_scale)
        samples.append(engine.global_samples)
    return engine, losses, lrs, scales, samples


def _read_csv(path: pathlib.Path) -> tuple[list[str], list[tuple[int, float]]]:
    with open(path, newline="") as f:
        header, *rows = list(csv.reader(f))
    return header, [(int(s), float(v)) for s, v in rows]


def test_csv_tensorboard_and_flops_profile_read_back(tmp_path: pathlib.Path) -> None:
    tb = importlib.util.find_spec("tensorboard") is not None
    cfg = _config(
        tmp_path,
        csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "csv"},
        tensorboard={"enabled": tb, "output_path": str(tmp_path), "job_name": "tb"},
        flops_profiler={"enabled": True, "profile_step": 1, "output_file": str(tmp_path / "flops.txt")},
    )
    engine, losses, lrs, scales, samples = _train(cfg)
    assert engine.monitor.enabled
    engine.monitor.write_events([("Eval/Samples/accuracy", 0.5, 7)])  # DeepSpeed scripts log their own events
    assert engine.monitor.wandb_monitor is None and engine.monitor.comet_monitor is None
    assert engine.monitor.csv_monitor is not None and engine.monitor.csv_monitor.job_name == "csv"
    if tb:  # scripts write their own scalars through DeepSpeed's MonitorMaster attributes
        assert engine.monitor.tb_monitor is not None and engine.monitor.tb_monitor.output_path == str(tmp_path)
        engine.monitor.tb_monitor.summary_writer.add_scalar("train_auc", 0.75, 3)
    csv_monitor = engine.monitor.csv_monitor
    engine.destroy()
    assert engine.monitor.csv_monitor is None and engine.monitor.tb_monitor is None
    csv_monitor.write_events([("Eval/Samples/accuracy", 0.25, 9)])  # closed with the engine: not written
    assert _read_csv(tmp_path / "csv" / "Eval_Samples_accuracy.csv") == (["step", "accuracy"], [(7, 0.5)])
    before = [0, *samples[:-1]]  # train_loss is written at the boundary backward, before the step counts

    header, rows = _read_csv(tmp_path / "csv" / "Train_Samples_train_loss.csv")
    assert header == ["step", "train_loss"]
    assert [s for s, _ in rows] == before
    assert [v for _, v in rows] == pytest.approx(losses, rel=1e-6)
    header, rows = _read_csv(tmp_path / "csv" / "Train_Samples_lr.csv")
    assert header == ["step", "lr"] and rows == [(s, pytest.approx(v)) for s, v in zip(samples, lrs, strict=True)]
    header, rows = _read_csv(tmp_path / "csv" / "Train_Samples_loss_scale.csv")
    assert header == ["step", "loss_scale"] and rows == list(zip(samples, scales, strict=True))

    if tb:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "tb"))
        events.Reload()
        assert set(events.Tags()["scalars"]) - {"Eval/Samples/accuracy", "train_auc"} == {
            "Train/Samples/train_loss",
            "Train/Samples/lr",
            "Train/Samples/loss_scale",
            # the flops profiler turns the wall-clock breakdown on, as DeepSpeed's config does
            *(f"Train/Samples/elapsed_time_ms_{t}" for t in ("forward", "backward", "backward_inner")),
            *(f"Train/Samples/elapsed_time_ms_{t}" for t in ("backward_allreduce", "step")),
        }
        loss_events = events.Scalars("Train/Samples/train_loss")
        assert [e.step for e in loss_events] == before
        assert [e.value for e in loss_events] == pytest.approx(losses, rel=1e-6)
        assert [e.value for e in events.Scalars("Train/Samples/lr")] == pytest.approx(lrs)
        assert [e.step for e in events.Scalars("Train/Samples/loss_scale")] == samples

    # One micro-batch of step 1: fc1 is MICRO x K @ K x N, fc2 MICRO x N @ N x OUT, 2*M*N*K FLOPs each.
    profile = (tmp_path / "flops.txt").read_text()
    fc1, fc2 = 2 * MICRO * K * N, 2 * MICRO * N * OUT
    assert "Profile Summary at step 2:" in profile  # profile_step 1: global_steps after it, as DeepSpeed prints
    assert f"{(fc1 + fc2) // 2} MACs" in profile.split("fwd MACs per GPU:")[1].splitlines()[0]
    detailed = profile.split("Detailed Profile per GPU")[1]
    assert f"(fc1): Linear({K * N} = " in detailed and f"{fc1 // 2} MACs" in detailed
    assert f"(fc2): Linear({N * OUT} = " in detailed and f"{fc2 // 2} MACs" in detailed
    assert "params per GPU:" in profile and str(K * N + N * OUT) in profile


def test_flops_profile_under_wall_clock_breakdown_adds_deepspeeds_backward_lines(tmp_path: pathlib.Path) -> None:
    """With wall_clock_breakdown the profile takes the engine's timings of the profiled step's last micro-step and
    counts a backward as 2 + recompute_fwd_factor forwards, as DeepSpeed's does."""
    from zeroshard.monitor.flops_report import duration_to_string, flops_to_string

    last = STEPS - 1  # the snapshot read below is the profiled step's
    profiler = {"enabled": True, "profile_step": last, "output_file": str(tmp_path / "flops.txt")}
    cfg = _config(tmp_path, wall_clock_breakdown=True, flops_profiler={**profiler, "recompute_fwd_factor": 1.0})
    engine, *_ = _train(cfg)
    assert not engine.monitor.enabled  # DeepSpeed's MonitorMaster.enabled: a monitor block, not the profiler's file
    times = engine.get_wall_clock_timers()
    engine.destroy()
    lines = dict(
        line.rsplit(":  ", 1) if ":  " in line else (line, "")
        for line in (tmp_path / "flops.txt").read_text().splitlines()
    )
    fwd, bwd, step = (times[f"{name}_microstep"] / 1e3 for name in ("fwd", "bwd", "step"))
    flops = 2 * MICRO * K * N + 2 * MICRO * N * OUT
    assert lines["fwd latency"].strip() == duration_to_string(fwd)
    assert lines["bwd latency"].strip() == duration_to_string(bwd)
    assert lines["bwd FLOPS per GPU = 3 * fwd flops per GPU / bwd latency"].strip() == flops_to_string(3 * flops / bwd)
    iteration = fwd + bwd + step
    assert lines["iter latency"].strip() == duration_to_string(iteration)
    assert lines["FLOPS per GPU = 4 * fwd flops per GPU / iter latency"].strip() == flops_to_string(
        4 * flops / iteration
    )
    assert float(lines["samples/second"]) == round(MICRO / iteration, 2)
    # without the key: the same lines, as DeepSpeed's config turns the breakdown on with the profiler
    engine, *_ = _train(_config(tmp_path, flops_profiler=profiler))
    engine.destroy()
    assert "bwd latency: " in (tmp_path / "flops.txt").read_text()


def test_flops_profiler_totals_equal_the_matmul_count() -> None:
    from zeroshard.config.monitor import FlopsProfilerConfig
    from zeroshard.monitor.flops import FlopsProfiler

    model = MLP()
    profiler = FlopsProfiler(FlopsProfilerConfig(enabled=True, profile_step=0), model, dict, 1, MICRO)
    with profiler.forward(0):
        model(torch.randn(MICRO, K))
    with profiler.forward(0):  # only the first forward of the step is profiled
        model(torch.randn(MICRO, K))
    assert profiler.profile is not None
    total, fc1 = profiler.profile.total, profiler.profile.modules["fc1"]
    assert total.flops == 2 * MICRO * K * N + 2 * MICRO * N * OUT
    assert fc1.flops == 2 * MICRO * K * N and fc1.params == K * N and fc1.duration > 0
    assert total.params == K * N + N * OUT
    assert profiler.report(0) is not None and profiler.report(1) is None


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores: wandb starts a service process); covered by the
# CSV and TensorBoard read-backs above and the wandb monitor's construction tests (test_monitor_classes.py)
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_wandb_offline_logs_the_engine_values(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    engine, losses, lrs, scales, samples = _train(_config(tmp_path, wandb={"enabled": True, "project": "zs"}))
    engine.destroy()  # finishes the run
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    before = [0, *samples[:-1]]
    history = _wandb_history(run_file)
    rows = {row["_step"]: row for row in history}
    assert set(before + samples) <= set(rows), history
    assert [rows[s]["Train/Samples/train_loss"] for s in before] == pytest.approx(losses, rel=1e-6)
    assert [rows[s]["Train/Samples/lr"] for s in samples] == pytest.approx(lrs)
    assert [rows[s]["Train/Samples/loss_scale"] for s in samples] == scales


@pytest.mark.skipif(importlib.util.find_spec("comet_ml") is None, reason="comet_ml is not installed")
def test_comet_offline_logs_the_engine_values_thinned_by_samples(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json
    import zipfile

    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path / "comet"))
    monkeypatch.setenv("COMET_DISABLE_AUTO_LOGGING", "1")
    per_step = MICRO * GAS
    comet = {"enabled": True, "project": "zs", "online": False, "samples_log_interval": 2 * per_step}
    engine, losses, lrs, scales, samples = _train(_config(tmp_path, comet={**comet, "experiment_name": "run1"}))
    assert isinstance(engine.telemetry.monitors[0], CometMonitor)
    engine.destroy()  # ends the experiment: the offline archive is written
    (archive,) = (tmp_path / "comet").glob("*.zip")
    with zipfile.ZipFile(archive) as z:
        messages = [json.loads(line) for line in z.read("messages.json").decode().splitlines() if line.strip()]
        experiment = json.loads(z.read("experiment.json"))
    metrics: dict[str, dict[int, float]] = {}
    for message in messages:
        metric = message.get("payload", {}).get("metric")
        if message.get("type") == "metric_msg" and metric["metricName"].startswith("Train/"):
            metrics.setdefault(metric["metricName"], {})[metric["step"]] = metric["metricValue"]
    # one value per name every 2 steps' samples, the first always
    assert sorted(metrics["Train/Samples/lr"]) == samples[::2], metrics
    assert [metrics["Train/Samples/lr"][s] for s in samples[::2]] == pytest.approx(lrs[::2])
    before = [0, *samples[:-1]]
    assert [metrics["Train/Samples/train_loss"][s] for s in before[::2]] == pytest.approx(losses[::2], rel=1e-6)
    assert experiment.get("project_name") == "zs" and "run1" in json.dumps(messages), experiment


def _wandb_history(path: pathlib.Path, timeout_s: float = 60.0) -> list[dict]:
    """The history rows of an offline run file, once W&B's service has written its exit record (`run.finish()`
    returns before the service is done writing). The file is a LevelDB-style log (7-byte file header; 32 KiB
    blocks of records, each with a 7-byte header: crc32, length, type 1 full / 2 first / 3 middle / 4 last) of
    protobuf Records."""
    import json
    import struct
    import time

    from wandb.proto import wandb_internal_pb2

    deadline = time.monotonic() + timeout_s
    while True:
        raw, pos, pending, rows, done = path.read_bytes(), 7, b"", [], False
        while pos + 7 <= len(raw):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
            pending += raw[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                pending = b""
                kind_name = record.WhichOneof("record_type")
                done = done or kind_name == "exit"
                if kind_name == "history":
                    rows.append(
                        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                    )
        if done or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


@pytest.mark.parametrize(
    ("block", "package"), [("tensorboard", "tensorboard"), ("wandb", "wandb"), ("comet", "comet_ml")]
)
def test_missing_package_is_one_line_naming_the_key(block: str, package: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    with pytest.raises(ConfigError, match=rf"^{block}\.enabled needs the {package} package: pip install {package}$"):
        zeroshard.initialize(model=MLP(), config=_config(pathlib.Path("."), **{block: {"enabled": True}}))


def test_comms_logger_bandwidth_and_bad_prof_ops() -> None:
    # 1 MB in 1 ms over 4 ranks: all-gather of a 1 MB shard moves 4 MB (32 Gbps), bus 3/4 of it.
    assert bandwidths("all_gather_into_tensor", 10**6, 1.0, 4) == pytest.approx((32.0, 24.0))
    assert bandwidths("all_reduce", 10**6, 1.0, 4) == pytest.approx((16.0, 12.0))
    assert bandwidths("reduce_scatter_tensor", 10**6, 1.0, 4) == pytest.approx((8.0, 6.0))
    assert bandwidths("broadcast", 10**6, 1.0, 4) == pytest.approx((8.0, 8.0))
    with pytest.raises(ConfigError, match=r"^comms_logger.prof_ops: unknown collective\(s\) \['allreduce'\]"):
        CommsLogger(CommsLoggerConfig(enabled=True, prof_ops=("allreduce",)), 2, 0)
    logger = CommsLogger(CommsLoggerConfig(enabled=True, prof_all=False, prof_ops=("all_reduce",)), 2, 0)
    assert logger.should_profile("all_reduce") and not logger.should_profile("broadcast")
    logger.append("all_reduce", 2.0, 1024)
    logger.append("all_reduce", 4.0, 1024)
    out = logger.log_all(print_log=False, return_dict=True)
    assert out is not None
    row = out["summary"]["all_reduce"][1024]
    assert row["count"] == 2 and row["total_latency_ms"] == 6.0 and row["msg_size_str"] == "1.0 KB"
    debug = CommsLogger(CommsLoggerConfig(enabled=True, debug=True), 2, 0)
    debug.append("broadcast", 1.0, 8)
    assert debug.get_operation_names() == ["broadcast | [Caller Func: test_comms_logger_bandwidth_and_bad_prof_ops]"]


def test_csv_files_equal_deepspeeds_csv_monitor(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers.deepspeed_reference import import_deepspeed
    from zeroshard.config.monitor import CSVMonitorConfig
    from zeroshard.monitor.csv_monitor import CSVMonitor

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    theirs = import_deepspeed("deepspeed.monitor.csv_monitor")
    monkeypatch.setattr(theirs.dist, "get_rank", lambda group=None: 0)  # their monitor writes on rank 0 only
    events = [("Train/Samples/train_loss", 0.25, 0), ("Train/Samples/lr", 1e-3, 8), ("Train/Samples/lr", 2e-3, 16)]
    their_config = import_deepspeed("deepspeed.monitor.config")
    ds = theirs.csvMonitor(their_config.CSVConfig(enabled=True, output_path=str(tmp_path / "ds"), job_name="job"))
    ours = CSVMonitor(CSVMonitorConfig(enabled=True, output_path=str(tmp_path / "zs"), job_name="job"))
    for batch in (events[:2], events[2:]):
        ds.write_events(batch)
        ours.write_events(batch)
    names = sorted(p.name for p in (tmp_path / "ds" / "job").iterdir())
    assert names == ["Train_Samples_lr.csv", "Train_Samples_train_loss.csv"]
    assert sorted(p.name for p in (tmp_path / "zs" / "job").iterdir()) == names
    for name in names:
        assert (tmp_path / "zs" / "job" / name).read_bytes() == (tmp_path / "ds" / "job" / name).read_bytes()


def test_comms_table_equals_deepspeeds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], log: pytest.LogCaptureFixture
) -> None:
    from helpers.deepspeed_reference import import_deepspeed

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    theirs = import_deepspeed("deepspeed.utils.comms_logging")
    monkeypatch.setattr(import_deepspeed("deepspeed.comm"), "get_world_size", lambda group=None: 4)
    ds = theirs.CommsLogger()
    ours = CommsLogger(CommsLoggerConfig(enabled=True), 4, 0)
    calls = [("all_reduce", 2.0, 4096), ("all_reduce", 3.0, 4096), ("all_gather_into_tensor", 1.5, 1 << 20)]
    for op, ms, size in calls:  # reduce-scatter left out: its bandwidth is where we differ on purpose
        ds.append(op, op, ms, size)
        ours.append(op, ms, size)
    ds.log_all()
    ours.log_all()
    assert log.records[-1].getMessage().strip("\n") == capsys.readouterr().out.strip("\n")


def test_windows_the_script_ends_log_their_loss_at_their_step(tmp_path: pathlib.Path) -> None:
    """managed_gradient_accumulation false ([Note: caller-owned windows]): no backward is a boundary, so each window's
    mean loss is written when step() ends it, at the samples counted before it; samples grow by the window's
    micro-batches."""
    csv_monitor = {"enabled": True, "output_path": str(tmp_path), "job_name": "csv"}
    cfg = _config(tmp_path, fp16={"enabled": False}, managed_gradient_accumulation=False, csv_monitor=csv_monitor)
    torch.manual_seed(0)
    engine, _, _, _ = zeroshard.initialize(model=MLP(), config=cfg)
    losses, samples = [], [0]
    for window in (1, 3, 2):
        window_losses = []
        for _ in range(window):
            loss = engine(torch.randn(MICRO, K))
            engine.backward(loss)
            window_losses.append(loss.item())
        engine.step()
        losses.append(sum(window_losses) / window)
        samples.append(engine.global_samples)
    engine.destroy()
    assert samples == [0, MICRO, 4 * MICRO, 6 * MICRO]
    header, rows = _read_csv(tmp_path / "csv" / "Train_Samples_train_loss.csv")
    assert [s for s, _ in rows] == samples[:-1]
    assert [v for _, v in rows] == pytest.approx(losses, rel=1e-6)
    assert [s for s, _ in _read_csv(tmp_path / "csv" / "Train_Samples_lr.csv")[1]] == samples[1:]
