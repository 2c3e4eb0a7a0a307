"""A monitor block that cannot start (tensorboard, csv_monitor, wandb, comet) is one ConfigError line naming the block,
raised by `initialize` before it touches the model, on every rank ([Note: monitors open first])."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import time

import pytest
import torch
from torch import nn

import zeroshard
from helpers.harness import run_on_ranks
from helpers.process_group import own_process_group  # noqa: F401 (an autouse fixture)
from zeroshard.config import parse_config
from zeroshard.errors import ConfigError

BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},  # would shard every parameter
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _refused(blocks: dict, monkeypatch: pytest.MonkeyPatch) -> str:
    """The error initialize raised; asserts that no strategy was built and the model is as it was."""
    built = sys.modules["zeroshard.initialize"]

    def no_strategy(*args: object, **kwargs: object) -> None:
        raise AssertionError("a strategy was built before the monitor error")

    monkeypatch.setattr(built, "make_strategy", no_strategy)
    model = _model()
    before = {name: (p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters()}
    with pytest.raises(ConfigError) as caught:
        zeroshard.initialize(model=model, config={**BASE, **blocks})
    for name, p in model.named_parameters():  # not moved, cast or sharded
        assert p.data_ptr() == before[name][0] and torch.equal(p.detach(), before[name][1]), name
    message = str(caught.value)
    assert "\n" not in message
    return message


def _no_login(monkeypatch: pytest.MonkeyPatch, home: pathlib.Path) -> None:
    """No W&B or Comet credentials anywhere they are looked for, and no offline mode."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED", "COMET_API_KEY", "COMET_START_ONLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(home / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "wandb-config"))
    monkeypatch.setenv("WANDB_DIR", str(home))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.setenv("COMET_CONFIG", str(home / "comet.config"))
    monkeypatch.chdir(home)


@pytest.mark.parametrize("block", ["tensorboard", "csv_monitor"])
def test_an_output_path_the_logs_cannot_go_to_names_the_key(
    block: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if block == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        pytest.skip("tensorboard is not installed")
    message = _refused({block: {"enabled": True, "output_path": "/proc/nope"}}, monkeypatch)
    assert message == (
        f"{block}.output_path is '/proc/nope', and the logs cannot be written to /proc/nope/DeepSpeedJobName (No "
        f"such file or directory); set {block}.output_path to a directory this process can write to"
    )
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    message = _refused({block: {"enabled": True, "output_path": str(a_file), "job_name": "run"}}, monkeypatch)
    assert message.startswith(f"{block}.output_path is '{a_file}', and the logs cannot be written to {a_file}/run (")


def test_a_flops_report_file_that_cannot_be_written_names_the_key(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 writes it at profile_step, after training started: its folder is checked with the monitors."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    blocks = {"flops_profiler": {"enabled": True, "output_file": str(a_file / "flops.txt")}}
    message = _refused(blocks, monkeypatch)
    assert message.startswith(
        f"flops_profiler.output_file is '{a_file}/flops.txt', and {a_file} cannot be written to ("
    )


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_wandb_without_an_api_key(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb

    _no_login(monkeypatch, tmp_path)
    wandb.teardown()  # wandb keeps the settings it first read (another test's environment) for the process
    try:
        assert _refused({"wandb": {"enabled": True}}, monkeypatch) == (
            "wandb.enabled is true but wandb has no API key: run `wandb login`, set WANDB_API_KEY, or set "
            "WANDB_MODE=offline to keep the run in a local folder"
        )
    finally:
        wandb.teardown()  # nor keep this test's


@pytest.mark.skipif(importlib.util.find_spec("comet_ml") is None, reason="comet_ml is not installed")
def test_comet_online_without_an_api_key_and_a_start_that_fails(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_login(monkeypatch, tmp_path)
    monkeypatch.setenv("COMET_OFFLINE_DIRECTORY", str(tmp_path / "comet"))
    monkeypatch.setenv("COMET_DISABLE_AUTO_LOGGING", "1")
    assert _refused({"comet": {"enabled": True}}, monkeypatch) == (
        "comet.enabled is true but Comet has no API key: set comet.api_key, set COMET_API_KEY or run `comet login`, "
        "or set comet.online to false to store an offline experiment"
    )
    # whatever comet_ml.start raises (stood in for: a real failed start is reported to Comet's error tracker online)
    import comet_ml

    def refuse(**kwargs: object) -> None:
        raise comet_ml.exceptions.InvalidExperimentMode("Can not use mode 'get' without\n'experiment_key'.")

    monkeypatch.setattr(comet_ml, "start", refuse)
    assert _refused({"comet": {"enabled": True, "online": False, "mode": "get"}}, monkeypatch) == (
        "comet.enabled is true but comet_ml.start failed: Can not use mode 'get' without 'experiment_key'; check the "
        "comet block (api_key, project, workspace, experiment_key, mode)"
    )


def test_value_checks_are_the_schemas() -> None:
    """What needs no environment is refused by parse_config (and so by `zeroshard validate-config`)."""
    comet = {"enabled": True, "online": False, "api_key": "x", "mode": "bogus"}
    with pytest.raises(ConfigError, match=r'^comet\.mode: "bogus" is not one of "get_or_create", "create", "get"$'):
        parse_config({"comet": comet})
    assert parse_config({"comet": {**comet, "mode": "create"}}).comet.mode == "create"
    with pytest.raises(ConfigError, match=r"^flops_profiler\.profile_step: -1 is out of range; expected >= 0$"):
        parse_config({"flops_profiler": {"enabled": True, "profile_step": -1}})


# --------------------------------------------------------------------------- 2 ranks


def _every_rank_stops(rank: int, world_size: int, out: str) -> list[dict]:
    """Two initialize calls that fail on one rank: rank 0 cannot write csv_monitor's logs (only it builds the
    monitors), then rank 1 lacks the tensorboard package. Each rank reports its error, how long initialize took and
    whether its model is as it was."""
    import importlib.util

    import torch

    import zeroshard
    from zeroshard.errors import ConfigError

    cases = [
        ({"csv_monitor": {"enabled": True, "output_path": "/proc/nope"}}, None),
        ({"tensorboard": {"enabled": True, "output_path": out}}, "tensorboard" if rank == 1 else None),
    ]
    real = importlib.util.find_spec
    reports = []
    for blocks, missing in cases:
        importlib.util.find_spec = lambda name, *a, gone=missing: None if name == gone else real(name, *a)  # type: ignore
        model = _model()
        before = [p.detach().clone() for p in model.parameters()]
        start = time.monotonic()
        try:
            zeroshard.initialize(model=model, config={**BASE, **blocks, "zeroshard": {"collective_timeout_s": 60}})
            error = None
        except ConfigError as e:
            error = str(e)
        finally:
            importlib.util.find_spec = real
        untouched = all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))
        reports.append({"error": error, "seconds": time.monotonic() - start, "untouched": untouched})
    return reports


def test_a_monitor_failing_on_one_rank_stops_every_rank_promptly(tmp_path: pathlib.Path) -> None:
    if importlib.util.find_spec("tensorboard") is None:
        pytest.skip("tensorboard is not installed")
    rank0, rank1 = run_on_ranks(_every_rank_stops, 2, str(tmp_path), timeout=120)
    csv_error = (
        "csv_monitor.output_path is '/proc/nope', and the logs cannot be written to /proc/nope/DeepSpeedJobName (No "
        "such file or directory); set csv_monitor.output_path to a directory this process can write to"
    )
    tb_error = "tensorboard.enabled needs the tensorboard package: pip install tensorboard"
    assert [rank0[0]["error"], rank1[0]["error"]] == [csv_error, f"{csv_error} (on rank 0; every rank stops)"]
    assert [rank0[1]["error"], rank1[1]["error"]] == [f"{tb_error} (on rank 1; every rank stops)", tb_error]
    for report in rank0 + rank1:
        assert report["untouched"]
        assert report["seconds"] < 15, report  # not the collective timeout (60 s)
