"""Run one experiment in fresh processes (torchrun, `--nproc-per-node` ranks) and record what happened.

A trial that fails (an exception, out of memory, a timeout) is recorded with its reason and the search goes on.
Each trial's folder under `exps_dir` holds its ds_config.json and result.json, so a rerun can reuse it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zeroshard.launcher.runner import passing_stops_on, stop_group


@dataclass(frozen=True)
class TrialRunner:
    model: str
    nproc: int
    seq_len: int
    start_step: int
    end_step: int
    timeout_s: float

    def __call__(self, folder: Path, config: dict[str, Any]) -> dict[str, Any]:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "ds_config.json").write_text(json.dumps(config, indent=2))
        out = folder / "metrics.json"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(self.nproc)]
        job = folder / "job.json"
        job.write_text(
            json.dumps(
                {
                    "model": self.model,
                    "config": str(folder / "ds_config.json"),
                    "out": str(out),
                    "seq_len": self.seq_len,
                    "start": self.start_step,
                    "end": self.end_step,
                }
            )
        )
        cmd += ["--master-port", str(_free_port()), *self.program(job)]
        env = {
            **os.environ,
            "ZEROSHARD_LOG_LEVEL": "WARNING",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
        # a session of its own: at the timeout torchrun gets SIGTERM and stops its workers (they run in sessions of
        # their own; killing torchrun alone left them holding the GPU for the next trials)
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
        try:
            with passing_stops_on(proc, grace_s=40.0):  # a Ctrl-C or SIGTERM of the autotuner stops the trial too
                stdout, stderr = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(proc, grace_s=40.0)  # torchrun waits up to 30 s for its workers to stop
            with contextlib.suppress(subprocess.TimeoutExpired):  # (a worker that outlived it holds the pipes)
                proc.communicate(timeout=10)
            return {"status": "failed", "error": f"timed out after {self.timeout_s:.0f} s"}
        (folder / "log.txt").write_text(stdout + stderr)
        if proc.returncode != 0 or not out.exists():
            return {"status": "failed", "error": _reason(stderr, proc.returncode)}
        return {"status": "ok", **json.loads(out.read_text())}

    def program(self, job: Path) -> list[str]:
        """What torchrun runs on each rank: the trial worker over `job`."""
        return ["-m", "zeroshard.autotuning.worker", str(job)]


def _reason(stderr: str, code: int) -> str:
    """The error line a failed rank printed (OutOfMemoryError, ConfigError, ...), else the exit code."""
    lines = [line.strip() for line in stderr.splitlines() if "Error" in line and ":" in line]
    oom = [line for line in lines if "OutOfMemory" in line or "out of memory" in line]
    return (oom or lines or [f"exit code {code}"])[-1][:300]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
