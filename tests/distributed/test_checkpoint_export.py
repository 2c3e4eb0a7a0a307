"""Streaming export of a large checkpoint: the converter's peak RSS is bounded by a chunk, not the model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers.harness import run_on_ranks

LAYERS, ROWS, COLS = 4, 8192, 4096  # 4 x 128 MiB fp32 tensors: a 512 MiB model


def _save_big(rank: int, world_size: int, root: str) -> None:
    import zeroshard

    torch.manual_seed(0)
    model = torch.nn.ModuleList(torch.nn.Linear(COLS, ROWS, bias=False) for _ in range(LAYERS))
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    config["zero_optimization"] = {"stage": 1}
    engine, *_ = zeroshard.initialize(model=model, config=config)
    engine.save_checkpoint(root)
    engine.destroy()


# The converter's own high-water mark, as the OS counts it: /proc/self/status's VmHWM as it exits. (The rusage that
# wait4 returns is no measure: a child spawned by vfork takes its parent's high-water mark at exec, so it grew with
# whatever the pytest process had loaded before: 570 MiB after the slow suite's earlier tests, 263 alone.)
_EXPORT_REPORTING_VMHWM = """
import runpy, sys
sys.argv = ["zeroshard.checkpoint.export", *sys.argv[1:]]
try:
    runpy.run_module("zeroshard.checkpoint.export", run_name="__main__")
finally:
    print(next(line for line in open("/proc/self/status") if line.startswith("VmHWM:")), file=sys.stderr)
"""


@pytest.mark.slow
def test_export_peak_rss_is_bounded(tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    run_on_ranks(_save_big, 1, ckpt)
    command = [sys.executable, "-c", _EXPORT_REPORTING_VMHWM, ckpt, out, "--max-shard-size", "300MB"]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    peak = int(done.stderr.split("VmHWM:")[-1].split()[0]) * 1024  # kB
    largest = ROWS * COLS * 4
    print(f"converter peak RSS {peak / 2**20:.0f} MiB, largest tensor {largest / 2**20:.0f} MiB")
    assert peak < 1.5 * largest + 300 * 2**20, f"peak RSS {peak / 2**20:.0f} MiB"
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert index["metadata"]["total_size"] == LAYERS * largest and len(set(index["weight_map"].values())) == 2
    from safetensors import safe_open

    torch.manual_seed(0)
    first = torch.nn.Linear(COLS, ROWS, bias=False).weight  # the first layer's initial weights
    with safe_open(os.path.join(out, index["weight_map"]["0.weight"]), "pt") as f:
        assert torch.equal(f.get_tensor("0.weight"), first.detach())
