"""The training time a checkpoint save costs: synchronous saves next to decoupled ones (`checkpoint.writer.decoupled`).

    python -m benchmarks.decoupled_save --size 120m --stage 3 --steps 3 --repeats 3 --json /tmp/decoupled.json

One `torchrun --standalone` process group (gloo, one OpenMP thread per rank) runs this module with `--worker`: per
mode (sync, decoupled) it builds an engine (fp32, client AdamW, `GPT(PRESETS[size])`, sequences of `--seq` tokens),
takes 2 warm-up steps, then per repeat times `steps` optimizer steps without a save ("train"), and a save into a
fresh directory followed by the same `steps` steps ("save + train"): what the save costs the training is the
difference. Also the seconds the save call blocks and the first step after it (where a decoupled save commits).
Medians over the repeats, wall seconds on rank 0 between barriers; every checkpoint is loaded back at the end and
its weights compared (a decoupled save must write what a synchronous one writes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.launch import last_error, run, torchrun
from benchmarks.machine import describe

MODES = ("sync", "decoupled")


def _config(stage: int, decoupled: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 1_000_000,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
    }
    if decoupled:
        config["checkpoint"] = {"writer": {"decoupled": True}}
    return config


def _timed(op: Any) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    op()
    dist.barrier()
    return time.perf_counter() - start


def _measure(engine: Any, batch: Any, args: argparse.Namespace, prefix: str) -> tuple[dict[str, list[float]], float]:
    """Per repeat: `steps` steps; a save, its first step, the other steps. Also the loss at the last save's call."""

    def step() -> None:
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()

    def steps(n: int) -> None:
        for _ in range(n):
            step()

    steps(2)  # warm-up
    row: dict[str, list[float]] = {"train": [], "save_and_train": [], "save_call": [], "first_step": []}
    loss_at_save = float("nan")
    for i in range(args.repeats):
        row["train"].append(_timed(lambda: steps(args.steps)))
        with torch.no_grad():
            loss_at_save = float(engine(*batch))
        call = _timed(lambda i=i: engine.save_checkpoint(f"{prefix}-{i}"))
        first = _timed(step)
        rest = _timed(lambda: steps(args.steps - 1))
        row["save_call"].append(call)
        row["first_step"].append(first)
        row["save_and_train"].append(call + first + rest)
    engine.commit_checkpoint()
    return row, loss_at_save


def _worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import zeroshard
    from zeroshard.models.gpt import GPT, PRESETS

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = PRESETS[args.size]
    gen = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, cfg.vocab_size, (1, args.seq + 1), generator=gen)
    batch = tokens[:, :-1], tokens[:, 1:]

    rows, at_save = {}, {}
    for mode in MODES:
        torch.manual_seed(0)
        model = GPT(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine, *_ = zeroshard.initialize(
            model=model, optimizer=optimizer, config=_config(args.stage, mode == "decoupled")
        )
        rows[mode], at_save[mode] = _measure(engine, batch, args, f"{args.root}/{mode}")
        engine.destroy()

    # each mode's last checkpoint, loaded into a fresh engine: its loss on the batch is the one at the save's call
    loaded = {}
    for mode in MODES:
        torch.manual_seed(1)
        model = GPT(cfg)
        engine, *_ = zeroshard.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), config=_config(args.stage, False)
        )
        path, _ = engine.load_checkpoint(f"{args.root}/{mode}-{args.repeats - 1}")
        with torch.no_grad():
            loss = float(engine(*batch))
        loaded[mode] = {"path": path, "loss": loss, "loss_at_save": at_save[mode]}
        engine.destroy()
    if rank == 0:
        Path(args.out).write_text(json.dumps({"rows": rows, "loaded": loaded}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _table(result: dict[str, Any], steps: int) -> str:
    med = {m: {k: statistics.median(v) for k, v in result["rows"][m].items()} for m in MODES}
    lines = [
        f"| mode | {steps} steps s | save + {steps} steps s | save costs training s | save call s | first step "
        "after s | loaded = saved |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in MODES:
        r = med[m]
        cost = r["save_and_train"] - r["train"]
        loaded = result["loaded"][m]
        lines.append(
            f"| {m} | {r['train']:.2f} | {r['save_and_train']:.2f} | {cost:.2f} | {r['save_call']:.2f} | "
            f"{r['first_step']:.2f} | {'yes' if loaded['loss'] == loaded['loss_at_save'] else 'NO'} |"
        )
    sync, dec = med["sync"], med["decoupled"]
    sync_cost, dec_cost = sync["save_and_train"] - sync["train"], dec["save_and_train"] - dec["train"]
    both = dec["save_and_train"] / sync["save_and_train"]
    lines.append(
        f"| decoupled / sync | {dec['train'] / sync['train']:.2f} | {both:.2f} | {dec_cost / sync_cost:.2f} | "
        f"{dec['save_call'] / sync['save_call']:.2f} | | |"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="120m")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--seq", type=int, default=128, help="tokens per sample")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps after each save (>= 2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads per rank")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--json", help="also write the raw result here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="zeroshard-decoupled-") as tmp:
        out, log = Path(tmp) / "result.json", Path(tmp) / "worker.log"
        forwarded = ["--size", args.size, "--stage", str(args.stage), "--seq", str(args.seq)]
        forwarded += ["--steps", str(args.steps), "--repeats", str(args.repeats)]
        cmd = torchrun(
            "benchmarks.decoupled_save",
            args.world_size,
            [*forwarded, "--worker", "--root", f"{tmp}/ckpt", "--out", str(out)],
        )
        code = run(cmd, log, threads=args.threads, timeout=args.timeout)
        if code != 0 or not out.exists():
            raise SystemExit(f"the worker failed: {'timed out' if code is None else last_error(log)}")
        result = json.loads(out.read_text())
    result["machine"] = describe()
    result["args"] = {k: v for k, v in vars(args).items() if k not in ("worker", "root", "out")}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(_table(result, args.steps))  # noqa: T201 - the table is this command's output


if __name__ == "__main__":
    main()
