"""Run a training script on N gloo ranks forked from the harness's forkserver, as torchrun would run it.

`script_on_ranks(script, args, nproc, env, cwd)` calls the script as `__main__` in each rank (its folder first on
sys.path, `sys.argv` set, the working directory `cwd`, `env` added to the environment) and returns what
`subprocess.run` would: the exit code (the first non-zero one) and the ranks' stdout and stderr, rank by rank. The
ranks start with torch and zeroshard already imported, which saves a script about 5 s of a torchrun launch on this
2-core machine; what the test checks is the script's run, not the launcher (tests/distributed/test_cli_* and the
`zeroshard accelerate-launch` case launch for real).
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import subprocess
import sys

from helpers.harness import run_on_ranks


def _rank(rank: int, world_size: int, script: str, args: list[str], env: dict[str, str], cwd: str):
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))  # as `python script.py` puts it
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    return code, out.getvalue(), err.getvalue()


def script_on_ranks(
    script: str, args: list[str], nproc: int, env: dict[str, str], cwd: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    results = run_on_ranks(_rank, nproc, script, list(args), dict(env), str(cwd), timeout=timeout)
    code = next((c for c, _, _ in results if c), 0)
    stdout = "".join(o for _, o, _ in results)
    stderr = "".join(e for _, _, e in results)
    return subprocess.CompletedProcess([script, *args], code, stdout, stderr)
