"""`zeroshard train --backend fsdp2` end to end on 2 processes: a LoRA run on FSDP2 saves an adapter, exports,
and its checkpoint resumes on the zero backend."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

TINY = ["--model", "tiny-llama", "--data-bytes", "60000", "--seq-len", "64", "--micro-batch", "4", "--log-steps", "1"]


def _train(output_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}}
    env["ZEROSHARD_LOG_LEVEL"] = "WARNING"
    command = [sys.executable, "-m", "zeroshard.cli.train", "--nproc-per-node", "2", *TINY, "--sample-tokens", "0"]
    done = subprocess.run(
        [*command, "--output-dir", str(output_dir), *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _losses(output_dir: Path) -> dict[int, float]:
    with open(output_dir / "metrics.csv", encoding="utf-8") as handle:
        return {int(row["step"]): float(row["loss"]) for row in csv.DictReader(handle) if row["loss"]}


@pytest.mark.slow  # two real `zeroshard train` launches (~130 s on 2 shared cores)
def test_train_backend_fsdp2_lora_then_resume_on_zero(tmp_path):
    from safetensors.torch import load_file

    lora = ("--lora-rank", "8", "--lr", "1e-2", "--max-steps", "4", "--save-steps", "2")
    first = _train(tmp_path, "--backend", "fsdp2", *lora, "--stop-after", "2", "--no-export")
    assert "ZeRO stage 3 on FSDP2" in first.stdout
    assert (tmp_path / "checkpoints" / "latest").exists()
    _train(tmp_path, "--backend", "zero", *lora, "--resume")
    assert sorted(_losses(tmp_path)) == [1, 2, 3, 4]
    saved = load_file(tmp_path / "final-adapter" / "adapter_model.safetensors")
    assert len(saved) > 0 and any("lora_B" in name and t.abs().sum() > 0 for name, t in saved.items())
