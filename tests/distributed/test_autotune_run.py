"""`zeroshard autotune` for real on this machine: trials in fresh 2-rank processes under a memory cap; the
winner fits under the cap and is the fastest finished trial; a rerun with --resume runs nothing again."""

from __future__ import annotations

import csv
import json

import pytest

from zeroshard.cli.main import main

CAP = 2**30  # bytes per rank; on CPU a rank's peak RSS above its RSS before the model is built


@pytest.mark.slow
def test_autotune_picks_the_fastest_trial_under_the_cap(tmp_path, capsys, monkeypatch):
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    ).save_pretrained(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    argv = ["autotune", "--model", "model", "--nproc-per-node", "2", "--max-memory-per-rank", str(CAP)]
    argv += ["--max-train-batch-size", "4", "--tuner-num-trials", "3", "--start-profile-step", "1"]
    argv += ["--end-profile-step", "2", "--seq-len", "32"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    with open(tmp_path / "autotuning_results" / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["name"] == "baseline" and len(rows) == 4
    finished = [r for r in rows[1:] if r["status"] == "ok"]
    assert finished, rows
    best = json.loads((tmp_path / "autotuning_results" / "ds_config_optimal.json").read_text())
    winner = max(finished, key=lambda r: float(r["samples_per_s"]))
    assert int(winner["peak_bytes"]) <= CAP
    assert best["train_micro_batch_size_per_gpu"] == int(winner["micro_batch"])
    assert best["zero_optimization"]["stage"] == int(winner["stage"])
    assert f"best (throughput): {winner['name']}" in text and "x the baseline" in text
    assert main([*argv, "--resume"]) == 0
    assert capsys.readouterr().out.count("(reused)") == 4


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by the autotuner:
# tests/unit/test_autotun*.py
@pytest.mark.slow
def test_a_trial_that_times_out_leaves_no_worker_behind(tmp_path):
    """torchrun starts its workers in sessions of their own: killing torchrun alone at a trial's timeout left them
    running (on a GPU, holding its memory through the next trials). It gets SIGTERM now and stops them."""
    import subprocess
    import time
    from dataclasses import dataclass

    from zeroshard.autotuning.trial import TrialRunner

    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import time\ntime.sleep(120)\n")

    @dataclass(frozen=True)
    class Sleeping(TrialRunner):  # a worker still busy at the timeout
        def program(self, job):
            return [str(sleeper), str(job)]

    runner = Sleeping(model="unused", nproc=1, seq_len=8, start_step=1, end_step=2, timeout_s=8)
    start = time.monotonic()
    result = runner(tmp_path / "trial", {"train_micro_batch_size_per_gpu": 1})
    assert result == {"status": "failed", "error": "timed out after 8 s"}, result
    assert time.monotonic() - start < 40  # (the orphaned worker held the pipes open until it ended: 120 s)
    time.sleep(0.5)
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert str(sleeper) not in ps, [line for line in ps.splitlines() if str(sleeper) in line]


DRIVER = """
import sys
from dataclasses import dataclass
from pathlib import Path

from zeroshard.autotuning.trial import TrialRunner


@dataclass(frozen=True)
class Sleeping(TrialRunner):
    def program(self, job):
        return [sys.argv[1], str(job)]


Sleeping(model="unused", nproc=1, seq_len=8, start_step=1, end_step=2, timeout_s=100)(Path(sys.argv[2]), {})
"""


# slow (CI budget: the default suite in 15 minutes on 2 AVX2 cores); covered by the autotuner's trials:
# test_a_trial_that_times_out_leaves_no_worker_behind
@pytest.mark.slow
def test_stopping_the_autotuner_stops_its_trial(tmp_path):
    """A trial runs in a session of its own (above): a SIGTERM of the autotuner (a scheduler, `timeout`; a terminal's
    Ctrl-C alike) ended it and left the trial's torchrun and worker running. It is passed on to the trial now."""
    import os
    import signal
    import subprocess
    import sys
    import time

    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import pathlib, sys, time\npathlib.Path(sys.argv[1] + '.started').touch()\ntime.sleep(120)\n")
    (tmp_path / "driver.py").write_text(DRIVER)
    driver = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), str(sleeper), str(tmp_path / "trial")])
    started = tmp_path / "trial" / "job.json.started"
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert started.exists()
    os.kill(driver.pid, signal.SIGTERM)
    assert driver.wait(timeout=60) != 0
    time.sleep(0.5)
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert str(sleeper) not in ps, [line for line in ps.splitlines() if str(sleeper) in line]
