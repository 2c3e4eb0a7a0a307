"""Checkpoint save/load time per GB and bytes on disk, zeroshard next to DeepSpeed (issue 6).

    python -m benchmarks.checkpoint_io --size 120m --world-size 2 --stage 2 3 --repeats 3

For each stage and framework, one `torchrun --standalone` process group runs
`benchmarks.checkpoint_worker`: one training step, `repeats` timed saves into new directories, then
a fresh engine in the same processes and `repeats` timed loads. Times are medians of the repeats;
GB/s is bytes on disk (as `du` counts them) over that time. Checkpoints live under a temporary
directory that is deleted afterwards. Prints a Markdown table; `--json` also keeps the raw rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.launch import last_error, run, torchrun

FRAMEWORKS = ("zeroshard", "deepspeed")


def run_one(framework: str, args: argparse.Namespace, stage: int, root: Path) -> dict[str, Any]:
    out = root / f"{framework}-s{stage}.json"
    log = root / f"{framework}-s{stage}.log"
    cmd = torchrun(
        "benchmarks.checkpoint_worker",
        args.world_size,
        [
            "--framework",
            framework,
            "--size",
            args.size,
            "--stage",
            str(stage),
            "--repeats",
            str(args.repeats),
            "--root",
            str(root / "ckpt"),
            "--out",
            str(out),
        ],
    )
    code = run(cmd, log, threads=args.threads, timeout=args.timeout)
    if code != 0 or not out.exists():
        why = "timed out" if code is None else last_error(log)
        return {"framework": framework, "stage": stage, "error": why}
    return json.loads(out.read_text())


def summarise(row: dict[str, Any]) -> dict[str, Any]:
    if "error" in row:
        return row
    gb = row["disk_bytes"] / 1e9
    save, load = statistics.median(row["save_s"]), statistics.median(row["load_s"])
    restored = abs(row["loaded_loss"] - row["trained_loss"]) <= 1e-5 * max(1.0, abs(row["trained_loss"]))
    return {
        **row,
        "save": save,
        "load": load,
        "gb": gb,
        "save_gbps": gb / save,
        "load_gbps": gb / load,
        "restored": restored,
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| stage | framework | save s | load s | GB on disk | files | save GB/s | load GB/s | weights restored |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_stage: dict[int, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_stage.setdefault(row["stage"], {})[row["framework"]] = row
    for stage, pair in sorted(by_stage.items()):
        for fw in FRAMEWORKS:
            r = pair.get(fw)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {stage} | {fw} | failed: {r['error']} | | | | | | |")
                continue
            lines.append(
                f"| {stage} | {fw} | {r['save']:.2f} | {r['load']:.2f} | {r['gb']:.3f} | {len(r['files'])} | "
                f"{r['save_gbps']:.2f} | {r['load_gbps']:.2f} | {'yes' if r['restored'] else 'NO'} |"
            )
        zs, ds = pair.get("zeroshard"), pair.get("deepspeed")
        if zs and ds and "error" not in zs and "error" not in ds:
            lines.append(
                f"| {stage} | ratio zs/ds | {zs['save'] / ds['save']:.2f} | {zs['load'] / ds['load']:.2f} | "
                f"{zs['gb'] / ds['gb']:.2f} | | {zs['save_gbps'] / ds['save_gbps']:.2f} | "
                f"{zs['load_gbps'] / ds['load_gbps']:.2f} | |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="120m")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--stage", type=int, nargs="+", default=[2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads per rank")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per process group")
    parser.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    parser.add_argument("--json", help="also write the raw rows here")
    args = parser.parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory(prefix="zeroshard-ckpt-bench-") as tmp:
        for stage in args.stage:
            for framework in args.frameworks:
                rows.append(summarise(run_one(framework, args, stage, Path(tmp))))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(table(rows))  # noqa: T201 - the table is this command's output


if __name__ == "__main__":
    main()
