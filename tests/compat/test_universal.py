"""Resuming a DeepSpeed run from its universal checkpoint ([Note: universal checkpoints]).

`scripts/universal_resume.py` (a tied head among its weights) trains under DeepSpeed 0.19.8 on 2 gloo ranks, saves
at step 3 and trains 3 more steps; DeepSpeed's own `ds_to_universal` converts the step-3 checkpoint; zeroshard then
loads the converted checkpoint (`"checkpoint": {"load_universal": true}`, by tag and, with `-m slow`, through
`latest_universal`) at another ZeRO stage and trains steps 4-6. Its losses must be DeepSpeed's uninterrupted ones
(fp32 to 1e-6; they come out equal), with the step count, learning rate and client state restored. DeepSpeed runs
here (no recorded reference): the checkpoint is its output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from compat.test_scripts import FP32_RTOL, Case, assert_losses_match, losses_of, run_script

from helpers.deepspeed_reference import import_deepspeed


def _script(phase: str, stage: int, ckpt: Path, dtype: str = "fp32", tag: str | None = None) -> Case:
    args = ["--phase", phase, "--stage", str(stage), "--dtype", dtype, "--ckpt", str(ckpt)]
    return Case(f"universal-{phase}", "universal_resume.py", args=tuple(args + (["--tag", tag] if tag else [])))


def _convert(tag_dir: Path) -> Path:
    out = tag_dir.parent / f"{tag_dir.name}_universal"
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir)]
    command += ["--output_folder", str(out), "--inject_missing_state"]
    done = subprocess.run(
        command, env={**os.environ, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out


def _resume_matches(tmp_path: Path, ds_stage: int, stages: list[int], dtype: str = "fp32", rtol: float = FP32_RTOL):
    import_deepspeed()
    ckpt = tmp_path / "ckpt"
    done = run_script(_script("train", ds_stage, ckpt, dtype), "deepspeed", tmp_path / "ds")
    trained, at_save = losses_of(done, "DeepSpeed training"), _loaded(done)
    universal = _convert(ckpt / "global_step3")
    for k, stage in enumerate(stages):  # the first names the tag; the others read ds_to_universal's latest_universal
        case = _script("resume", stage, ckpt, dtype, universal.name if k == 0 else None)
        done = run_script(case, "zeroshard", tmp_path / f"zs{stage}")
        result = losses_of(done, f"zeroshard stage {stage} resuming DeepSpeed stage {ds_stage}")
        assert_losses_match(result, trained[3:], rtol)
        assert _loaded(done) == {**at_save, "epoch": 7}  # step count, WarmupLR's rate, the client state


def _loaded(done: subprocess.CompletedProcess[str]) -> dict:
    import json

    line = next(line for line in done.stdout.splitlines() if line.startswith("COMPAT_RESULT "))
    return json.loads(line[len("COMPAT_RESULT ") :])["loaded"]


# slow: 53-68 s here (three DeepSpeed/zeroshard processes, each importing DeepSpeed), the default suite's longest test
# when it kept the suite at its 15-minute budget (979 s measured 2026-11-24)
@pytest.mark.slow
def test_zeroshard_resumes_a_deepspeed_zero2_run_at_stage_3(tmp_path: Path) -> None:
    _resume_matches(tmp_path, 2, [3])


@pytest.mark.slow
def test_zeroshard_resumes_a_deepspeed_zero3_run_at_stages_1_and_2(tmp_path: Path) -> None:
    """ZeRO-3 checkpoints keep frozen parameters only as per-rank fragments (no universal file); the second resume
    finds the checkpoint through `latest_universal`."""
    _resume_matches(tmp_path, 3, [1, 2])


@pytest.mark.slow
def test_zeroshard_resumes_a_bf16_deepspeed_run(tmp_path: Path) -> None:
    _resume_matches(tmp_path, 2, [2], dtype="bf16", rtol=1e-2)
