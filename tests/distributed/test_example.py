"""The example runs as a plain single process (no launcher variables): `python examples/train_gpt.py`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_example_single_process_trains():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"}
    }
    out = subprocess.run(
        [
            sys.executable,
            "examples/train_gpt.py",
            "--model",
            "tiny",
            "--steps",
            "20",
            "--corpus-bytes",
            "200000",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("step")]
    first, last = float(lines[0].split()[3]), float(lines[-1].split()[3])
    assert last < first, out.stdout
    assert "done: 20 steps" in out.stdout
