"""Autotuning without running trials: the block's keys and defaults, the estimator-pruned space, the search's
bookkeeping (failures recorded, the memory cap, early stopping, resume) with a stand-in runner, and the message
for a cap nothing meets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from zeroshard.autotuning import build_space, from_block, run_search
from zeroshard.autotuning.report import write
from zeroshard.autotuning.space import Experiment
from zeroshard.cli.estimate.formulas import Cluster, Precision
from zeroshard.cli.estimate.shapes import from_model_arg, from_params
from zeroshard.cli.main import main
from zeroshard.errors import ConfigError

FP32 = Precision(4, 4, 8)


def test_block_has_deepspeeds_keys_and_defaults():
    s = from_block(None)
    assert (s.metric, s.start_profile_step, s.end_profile_step, s.tuner_type) == ("throughput", 3, 5, "gridsearch")
    assert (s.tuner_num_trials, s.tuner_early_stopping, s.overwrite) == (50, 5, True)
    assert (s.results_dir, s.exps_dir, s.mp_size, s.max_train_batch_size) == (
        "autotuning_results",
        "autotuning_exps",
        1,
        None,
    )
    assert from_block({"enabled": True, "metric": "latency"}, tuner_type="random").tuner_type == "random"
    with pytest.raises(ConfigError, match="unknown key"):
        from_block({"tuner": "x"})
    with pytest.raises(ConfigError, match="mp_size"):
        from_block({"mp_size": 2})


def test_space_is_pruned_by_the_estimate_and_the_batch_bound():
    model = from_model_arg("tiny-llama")
    cluster = Cluster(gpus_per_node=2)
    full, _ = build_space(model, cluster, FP32, 128, None, 16, "gridsearch")
    assert max(e.micro_batch for e in full) == 8  # 8 x 2 ranks = max_train_batch_size
    cap = sorted({e.estimated_bytes for e in full})[len(full) // 4]
    pruned, smallest = build_space(model, cluster, FP32, 128, cap, 16, "gridsearch")
    assert pruned and len(pruned) < len(full) and all(e.estimated_bytes <= cap for e in pruned)
    assert smallest[0].estimated_bytes == min(e.estimated_bytes for e in smallest)
    ranked, _ = build_space(model, cluster, FP32, 128, None, 16, "model_based")
    assert ranked[0].micro_batch == 8 and sorted(map(str, ranked)) == sorted(map(str, full))


def _experiments(n: int) -> list[Experiment]:
    return [Experiment(n % 4, "none", "none", 2**i, 50_000_000, 1000 * i) for i in range(n)]


class _Runner:
    """Samples/s rise with the micro-batch; memory too; micro-batch 4 fails (as an OOM would)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, folder: Path, config: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(folder.name)
        mb = config["train_micro_batch_size_per_gpu"]
        if mb == 4:
            return {"status": "failed", "error": "torch.OutOfMemoryError: CUDA out of memory"}
        return {"status": "ok", "step_s": 1.0, "samples_per_s": float(mb), "peak_bytes": 100 * mb}


def test_search_records_failures_respects_the_cap_and_resumes(tmp_path):
    space = _experiments(6)  # micro-batch 1 .. 32
    settings = from_block({"exps_dir": str(tmp_path / "exps"), "results_dir": str(tmp_path / "res")})
    runner = _Runner()
    search = run_search(space, space[0], {}, runner, settings, cap=1000)
    status = {t.experiment.micro_batch: t.result["status"] for t in search.trials}
    assert status == {1: "ok", 2: "ok", 4: "failed", 8: "ok", 16: "over_cap", 32: "over_cap"}
    assert search.best is not None and search.best.experiment.micro_batch == 8  # fastest that fits
    assert all(t.score("throughput") <= search.best.score("throughput") for t in search.trials if t.ok)
    written = write(search, {}, tmp_path / "res")
    rows = (tmp_path / "res" / "results.csv").read_text().splitlines()
    assert len(rows) == 1 + 1 + 6 and "OutOfMemoryError" in rows[4]  # header, baseline, trials
    assert json.loads(written["ds_config"].read_text())["train_micro_batch_size_per_gpu"] == 8
    again = _Runner()
    resumed = run_search(space, space[0], {}, again, from_block({**settings.__dict__, "overwrite": False}), cap=1000)
    assert again.calls == [] and all(t.reused for t in resumed.trials)
    assert resumed.best is not None and resumed.best.experiment.micro_batch == 8


def test_early_stopping_and_trial_budget(tmp_path):
    space = _experiments(6)
    settings = from_block({"exps_dir": str(tmp_path), "tuner_early_stopping": 1, "tuner_num_trials": 50})
    search = run_search(space, space[0], {}, _Runner(), settings, cap=1000)
    assert search.stopped_early and [t.experiment.micro_batch for t in search.trials] == [1, 2, 4]
    settings = from_block({"exps_dir": str(tmp_path / "b"), "tuner_num_trials": 2})
    assert len(run_search(space, space[0], {}, _Runner(), settings, cap=None).trials) == 2


def test_an_impossible_cap_names_the_smallest_memory_option(tmp_path, capsys, monkeypatch):
    """...and leaves no empty results/experiments folders behind (the writable check made them in the cwd)."""
    monkeypatch.chdir(tmp_path)
    config = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "model_type": "llama",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = main(["autotune", "--model", str(tmp_path), "--nproc-per-node", "2", "--max-memory-per-rank", "1000"])
    err = capsys.readouterr().err
    assert code == 3 and "no configuration fits under the cap of 1000 B per rank" in err
    assert "stage 3, offload_optimizer=cpu, offload_param=cpu" in err and "(estimated)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_an_experiment_keeps_the_users_offload_block_where_it_keeps_its_device():
    """pin_memory, nvme_path and partial offload's ratio survive into the trials that offload to the same device;
    the ratio only where it applies (stage 3 on the CPU), a fresh block elsewhere."""
    base = {
        "zero_optimization": {
            "offload_optimizer": {"device": "cpu", "pin_memory": False, "ratio": 0.5},
            "offload_param": {"device": "nvme", "nvme_path": "/scratch"},
        }
    }

    def zero(stage: int, optimizer: str, param: str) -> dict[str, Any]:
        return Experiment(stage, optimizer, param, 1, 10**6, 0).ds_config(base)["zero_optimization"]

    three = zero(3, "cpu", "nvme")
    assert three["offload_optimizer"] == {"device": "cpu", "pin_memory": False, "ratio": 0.5}
    assert three["offload_param"] == {"device": "nvme", "nvme_path": "/scratch"}
    assert zero(2, "cpu", "none")["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert zero(3, "nvme", "cpu")["offload_optimizer"] == {"device": "nvme"}
    assert "offload_optimizer" not in zero(3, "none", "none") and "offload_param" not in zero(3, "none", "none")


def test_bf16_master_weights_leave_out_stage_0_and_count_two_byte_masters():
    """[Note: bf16 master weights]: DeepSpeed (and zeroshard) refuse them at stage 0, so no stage-0 trial is built;
    the memory pruning counts 2-byte masters and gradients (and 2-byte moments with bf16_optimizer_states)."""
    from zeroshard.cli.autotune import _precision

    zero = {"zero_optimization": {"stage": 2}}  # the keys need stage 1-3 (a base without a stage is refused)
    base = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}, **zero}
    precision = _precision(base)
    assert precision == Precision(2, 2, 4, master_bytes=2)
    assert _precision({"bf16": {"enabled": True}}) == Precision(2, 4, 8) and _precision({}) == Precision(4, 4, 8)
    fp32_moments = {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}, **zero}
    assert _precision(fp32_moments) == Precision(2, 2, 8, master_bytes=2)
    space, _ = build_space(from_params(1e8), Cluster(gpus_per_node=2), precision, 256, None, None, "gridsearch")
    assert space and all(e.stage > 0 for e in space)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--seq-len", "0"], "--seq-len 0 must be >= 1"),
        (["--trial-timeout", "0"], "--trial-timeout 0 must be a positive number of seconds"),
        (["--trial-timeout", "nan"], "--trial-timeout nan must be a positive number of seconds"),
        (["--max-memory-per-rank", "0"], "--max-memory-per-rank 0 must be a positive number of bytes"),
        (["--tuner-num-trials", "0"], "autotuning.tuner_num_trials 0: a whole number >= 1"),
        (["--results-dir", "afile"], "autotuning.results_dir afile: cannot write there"),
        (["--exps-dir", "afile/x"], "autotuning.exps_dir afile/x: cannot write there"),
    ],
)
def test_what_no_trial_could_run_with_is_one_line_before_any_trial(extra, message, tmp_path, capsys, monkeypatch):
    """--seq-len 0 and a results folder that is a file were found after every trial had run (or by each trial);
    --max-memory-per-rank 0 meant no cap."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    assert main(["autotune", "--model", "tiny-llama", "--nproc-per-node", "1", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "autotuning_exps").exists()


def test_a_built_in_model_name_builds_in_the_trial_worker():
    """`--model tiny-llama` passed the estimate and then failed in every trial (the worker listed it as a folder)."""
    from zeroshard.autotuning.worker import _model
    from zeroshard.presets import model_preset

    model = _model("tiny-llama")
    assert model.config.hidden_size == model_preset("tiny-llama").hidden_size and model.config.vocab_size == 259


def test_the_writable_probe_removes_every_folder_it_made(tmp_path, monkeypatch):
    """`res/../out/sub`: makedirs makes `res` too, which the list of folders to remove (of the absolute path) missed."""
    from zeroshard.utils.files import probe_writable

    monkeypatch.chdir(tmp_path)
    probe_writable("res/../out/sub", keep=False)
    assert list(tmp_path.iterdir()) == []
    probe_writable("kept/sub")  # keep=True (the default): made and left
    assert (tmp_path / "kept" / "sub").is_dir()


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"enabeld": True}, "autotuning.enabeld: unknown key"),
        ({"enabled": "true"}, "autotuning.enabled 'true': true or false"),
        ({"start_profile_step": "1"}, "autotuning.start_profile_step '1': a whole number"),
        ({"start_profile_step": 6}, "start_profile_step must be below end_profile_step"),
    ],
)
def test_the_block_is_checked_wherever_a_config_is_resolved(block: dict, message: str) -> None:
    """`validate-config` and `initialize` refused nothing here: only `zeroshard autotune` read the block."""
    from zeroshard.config import parse_config, resolve_config

    with pytest.raises(ConfigError, match=message):
        resolve_config(parse_config({"train_micro_batch_size_per_gpu": 1, "autotuning": block}), world_size=1)


def test_an_engine_with_autotuning_enabled_says_it_trains_on(caplog) -> None:
    """DeepSpeed's engine would write autotuning_metric.json and exit after end_profile_step + 1 steps (its
    autotuner's trial protocol); here one warning says the engine trains on, and the steps go on."""
    import logging

    import torch

    import zeroshard

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 2},
    }
    logging.getLogger("zeroshard").propagate = True
    try:
        with caplog.at_level(logging.WARNING, logger="zeroshard"):
            engine, *_ = zeroshard.initialize(model=torch.nn.Linear(2, 1), config=config)
    finally:
        logging.getLogger("zeroshard").propagate = False
    assert "autotuning.enabled is true" in caplog.text and "zeroshard autotune" in caplog.text
    for _ in range(4):
        engine.backward(engine(torch.ones(1, 2)).sum())
        engine.step()
    assert engine.global_steps == 4
    engine.destroy()


@pytest.mark.parametrize(
    "block",
    [
        {"max_train_micro_batch_size_per_gpu": 64, "min_train_micro_batch_size_per_gpu": 1},
        {"num_tuning_micro_batch_sizes": 3, "min_train_batch_size": 2},
        {"metric": "flops"},
        {"mp_size": 2},
    ],
)
def test_what_deepspeeds_engine_accepts_resolves_and_the_tuner_refuses_in_one_line(block: dict) -> None:
    """DeepSpeed's autotuning keys load in a training config (DeepSpeed's engine accepts them; checking the block at
    resolve must not refuse them); `zeroshard autotune`, which does not act on them, says so."""
    from zeroshard.config import parse_config, resolve_config

    resolve_config(parse_config({"train_micro_batch_size_per_gpu": 1, "autotuning": block}), world_size=1)
    with pytest.raises(ConfigError, match=r"^autotuning\.(\w+)"):
        from_block(block)
