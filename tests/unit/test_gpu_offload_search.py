"""benchmarks/gpu_offload.py (issue 13 item 3): the largest-model search and its failure causes, without a GPU.
`-m slow` runs the real rows on the CPU (`--device cpu`, a 2-layer 256-wide Llama) as a smoke test, DeepSpeed's
too where it is installed (its CPU Adam JIT-builds on first use)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_offload

ROOT = Path(__file__).resolve().parents[2]


def test_failure_causes_name_the_resource() -> None:
    assert gpu_offload._cause(-signal.SIGKILL, "") == "killed by SIGKILL (host memory: the kernel's OOM killer)"
    assert gpu_offload._cause(1, "torch.OutOfMemoryError: CUDA out of memory. Tried") == "CUDA out of memory"
    assert gpu_offload._cause(1, "OSError: [Errno 28] No space left on device") == "disk full"
    assert gpu_offload._cause(1, "Traceback\nValueError: bad shape\n") == "ValueError: bad shape"


def test_search_stops_at_the_first_depth_that_trains_and_equals_follows_it(monkeypatch, capsys) -> None:
    tried = []

    def attempt(row: str, layers: int, args: argparse.Namespace) -> dict:
        tried.append((row, layers))
        ok = layers <= 16
        base = {"row": row, "layers": layers, "ok": ok}
        if not ok:
            return {**base, "cause": "CUDA out of memory"}
        return {
            **base,
            "params": layers * 2e8,
            "step_s": 1.0,
            "tokens_per_s": 1e4,
            "tflops": 12.0,
            "losses": [11.0, 10.0],
            "gpu_peak_bytes": 2**30,
            "vmhwm_bytes": 2**30,
            "nvme_bytes": 0,
        }

    monkeypatch.setattr(gpu_offload, "attempt", attempt)
    monkeypatch.setattr(sys, "argv", ["gpu_offload", "--try", "a:20,18,16,14", "b:=a", "c:=d"])
    gpu_offload.main()
    assert tried == [("a", 20), ("a", 18), ("a", 16), ("b", 16)]  # c: row d never trained, nothing to follow
    out = capsys.readouterr().out
    assert "failed: CUDA out of memory" in out and "| b ZeRO-3, optimizer offloaded to CPU | 16 |" in out


@pytest.mark.slow
def test_every_row_trains_on_the_cpu(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "benchmarks.gpu_offload", "--device", "cpu", "--hidden", "256", "--seq", "32"]
    command += ["--micro", "2", "--steps", "3", "--warmup", "1", "--nvme-path", str(tmp_path / "nvme")]
    command += ["--sub-group-size", "200000"]  # rows b+/c+: several sub-groups, some on each side
    rows = ["a", "b", "c", "d", "fsdp2", "b+", "c+", "a0", "so"]
    rows += ["ds"] if importlib.util.find_spec("deepspeed") else []
    command += ["--try", "a:2", "b:=a", "c:2", "d:2", "fsdp2:2", "b+:2", "c+:2", "a0:2", "so:=a0"]
    command += ["ds:2"] if "ds" in rows else []
    command += ["--json", str(report)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    subprocess.run(command, check=True, cwd=ROOT, env=env, timeout=600)
    tries = json.loads(report.read_text())["tries"]
    assert [t["row"] for t in tries] == rows and all(t["ok"] for t in tries), tries
    for t in tries:
        assert t["losses"][-1] < t["losses"][0] and t["params"] > 0
    for offloaded in (1, 5):  # offloading, whole or in part, changes no number
        assert tries[0]["losses"] == pytest.approx(tries[offloaded]["losses"], rel=1e-5)
    assert tries[7]["losses"] == pytest.approx(tries[8]["losses"], rel=1e-5)  # nor stepping during backward
    assert tries[3]["nvme_bytes"] > 0
