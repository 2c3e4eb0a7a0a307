"""Crash safety: a save killed (SIGKILL) at any point leaves the previous checkpoint and `latest` usable;
truncated or corrupted files are errors that name the file.

One subprocess trains, saves checkpoint "a" into one directory per fault point, then forks a process per
fault point that starts the next save with `ZEROSHARD_CHECKPOINT_FAULT` set and is killed there; the
subprocess then loads what survived and the damaged copies, and reports as JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fault point -> tag of the interrupted save (the first save is always tag "a")
FAULTS = {
    "mid_file": "b",  # half of a shard file written
    "after_rank_files": "b",  # every file written, metadata not yet
    "before_rename": "b",  # metadata written, directory not yet renamed
    "before_latest": "b",  # directory committed, `latest` not yet replaced
    "between_renames": "a",  # re-saving tag "a": the old copy moved aside, the new one not yet in place
}
SHARD = os.path.join("a", "optim", "rank00000.safetensors")


def _engine():
    import zeroshard
    from helpers.parity import Case, build_model, ds_config, param_groups

    case = Case(stage=1, steps=2)
    model = build_model(case)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=param_groups(model, case), config=ds_config(case))
    return engine


def _step(engine) -> None:
    from helpers.parity import Case, global_batches, micro_batch

    batch = global_batches(Case(stage=1), 1)[0]
    engine.backward(engine(*micro_batch(batch, 0, 0, 1, 2)))
    engine.step()


def _killed_save(engine, root: str, fault: str, tag: str) -> bool:
    """Save in a forked process that the fault kills; True if it died of SIGKILL."""
    pid = os.fork()
    if pid == 0:
        os.environ["ZEROSHARD_CHECKPOINT_FAULT"] = fault
        try:
            engine.save_checkpoint(root, tag=tag)
        finally:
            os._exit(3)  # not reached: the fault kills the process
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def _damage(good: str, base: str) -> dict[str, str]:
    """Copies of a good checkpoint with a truncated shard, a flipped byte, a cut metadata file."""
    damaged = {what: os.path.join(base, f"damaged-{what}") for what in ("truncated", "flipped", "metadata")}
    for path in damaged.values():
        shutil.copytree(good, path)
    os.truncate(os.path.join(damaged["truncated"], SHARD), os.path.getsize(os.path.join(good, SHARD)) // 2)
    with open(os.path.join(damaged["flipped"], SHARD), "r+b") as f:
        f.seek(-7, os.SEEK_END)
        byte = f.read(1)
        f.seek(-7, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x55]))
    meta = os.path.join(damaged["metadata"], "a", "metadata.json")
    os.truncate(meta, os.path.getsize(meta) // 2)
    return damaged


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _dot_dirs(root: str) -> list[str]:
    """What interrupted saves left, nonces cut off: ".tmp.b", ".old.a"."""
    return sorted(
        name.rsplit(".", 1)[0]
        for name in os.listdir(root)
        if os.path.isdir(os.path.join(root, name)) and name[0] == "."
    )


def _child(base: str) -> dict:
    import torch

    from zeroshard.checkpoint import CheckpointError, get_fp32_state_dict_from_zero_checkpoint

    torch.set_num_threads(1)  # no thread pool, so fork() is safe
    roots = {fault: os.path.join(base, fault) for fault in FAULTS}
    engine = _engine()
    _step(engine)
    for root in roots.values():
        engine.save_checkpoint(root, tag="a")
    _step(engine)
    report: dict = {"killed": {f: _killed_save(engine, roots[f], f, tag) for f, tag in FAULTS.items()}}
    report["latest"] = {f: _read(os.path.join(root, "latest")) for f, root in roots.items()}
    report["b committed"] = {f: os.path.isdir(os.path.join(root, "b")) for f, root in roots.items()}
    report["b readable"] = [
        f
        for f, root in roots.items()
        if report["b committed"][f] and get_fp32_state_dict_from_zero_checkpoint(root, "b")
    ]
    report["loaded"] = {}
    for fault, root in roots.items():
        fresh = _engine()
        path, _ = fresh.load_checkpoint(root)
        report["loaded"][fault] = [os.path.basename(path), fresh.global_steps]
        fresh.destroy()
    report["left before"] = {f: _dot_dirs(root) for f, root in roots.items()}
    for root in roots.values():  # a save of another tag removes what the killed saves left
        for name in os.listdir(root):  # (older than this process, as an earlier run's are; these killed saves were
            os.utime(os.path.join(root, name), (0, 0))  # forked from it)
        engine.save_checkpoint(root, tag="c", save_latest=False)
    report["left after"] = {f: _dot_dirs(root) for f, root in roots.items()}
    report["errors"] = {}
    for what, root in _damage(roots["before_latest"], base).items():
        fresh = _engine()
        try:
            fresh.load_checkpoint(root)
        except CheckpointError as e:
            report["errors"][what] = str(e)
        fresh.destroy()
    return report


def test_killed_saves_leave_a_loadable_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")])}
    for key in ("ZEROSHARD_CHECKPOINT_FAULT", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["ZEROSHARD_LOG_LEVEL"] = "WARNING"
    done = subprocess.run(
        [sys.executable, __file__, str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(report["killed"].values()), report["killed"]
    assert set(report["latest"].values()) == {"a"}, report["latest"]
    assert [f for f, yes in report["b committed"].items() if yes] == ["before_latest"]  # complete, not yet latest
    assert report["b readable"] == ["before_latest"]
    for fault, (tag, steps) in report["loaded"].items():
        assert steps == 1 and (tag == "a" or (fault == "between_renames" and tag.startswith(".old.a."))), fault
    # every save killed before its rename left its temporary folder (the re-save its old copy too); a save of another
    # tag removes them all but the old copy of the missing tag `a`, which loading fell back to
    left = {
        f: [] if f == "before_latest" else [".old.a", ".tmp.a"] if f == "between_renames" else [".tmp.b"]
        for f in FAULTS
    }
    assert report["left before"] == left, report["left before"]
    kept = {f: [".old.a"] if f == "between_renames" else [] for f in FAULTS}
    assert report["left after"] == kept, report["left after"]
    errors = report["errors"]
    assert SHARD in errors["truncated"] and "truncated" in errors["truncated"], errors
    assert SHARD in errors["flipped"] and "checksum mismatch" in errors["flipped"], errors
    assert "metadata.json: not valid JSON" in errors["metadata"], errors


if __name__ == "__main__":
    sys.stdout.write(json.dumps(_child(sys.argv[1])) + "\n")
