"""Exact per-step losses and parameter digests of the parity cases, for refactors that must not change numerics.

    python -m benchmarks.loss_digest > before.txt   # on the old commit
    python -m benchmarks.loss_digest > after.txt    # on the new one
    diff before.txt after.txt                       # empty: bit-identical

Each line is one case on one rank: its name, every step's mean loss as an exact hex float, and a SHA-256 of
the final flat parameters' bytes. Runs the cases of tests/distributed/test_parity.py, test_stage3.py and
test_offload.py (2 gloo ranks), plus fp16 with the loss scaler.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.harness import run_on_ranks  # noqa: E402
from helpers.parity import Case, engine_run  # noqa: E402

CASES = (
    [Case(stage=s, dtype=d, gas=g) for s in (0, 1, 2, 3) for d in ("fp32", "bf16") for g in (1, 3)]
    + [Case(stage=s, variant=v) for s in (0, 1, 2, 3) for v in ("frozen", "unused")]
    + [Case(stage=3, variant=v) for v in ("twice", "unused_unit", "order", "eval")]
    + [Case(stage=3, persistence=10**6), Case(stage=3, persistence=2000), Case(stage=3, reuse=10**9, prefetch=10**9)]
    + [
        Case(stage=1, offload="cpu"),
        Case(stage=2, offload="cpu", gas=3),
        Case(stage=3, offload="cpu"),
        Case(stage=3, offload_param="cpu"),
        Case(stage=3, offload="cpu", offload_param="cpu", gas=3),
        Case(stage=2, offload="cpu", dtype="bf16"),
        Case(stage=3, offload="cpu", offload_param="cpu", dtype="bf16"),
        Case(stage=3, offload="nvme", sub_group=4000),
        Case(stage=3, offload="nvme", sub_group=4000, gas=3, dtype="bf16"),
        Case(stage=1, offload="nvme"),
        Case(stage=2, offload="nvme", gas=3),
        Case(stage=2, offload="nvme", dtype="bf16"),
        Case(stage=3, offload_param="nvme"),
        Case(stage=3, offload="nvme", offload_param="nvme", sub_group=4000, gas=3),
        Case(stage=3, offload="cpu", offload_param="nvme", dtype="bf16", persistence=2000),
    ]
)
CASES = [replace(c, steps=8) for c in CASES]  # 8 steps each, as digests were recorded (the tests' default is 5)
FP16 = [Case(stage=s, dtype="bf16", steps=4) for s in (1, 2, 3)]  # run as fp16 with the loss scaler


def _fp16(config: dict) -> dict:
    config = dict(config, bf16={"enabled": False})
    config["fp16"] = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 2}
    return config


def _digest(rank: int, world_size: int) -> list[str]:
    lines = []
    for name, case, configure in [(c.name + f"-sg{c.sub_group}", c, None) for c in CASES] + [
        ("fp16-" + c.name, c, _fp16) for c in FP16
    ]:
        losses, params, _ = engine_run(rank, world_size, case, configure)
        digest = hashlib.sha256(params[-1].numpy().tobytes()).hexdigest()[:16]
        lines.append(f"{name} rank{rank} {' '.join(float(x).hex() for x in losses)} params={digest}")
    return lines


def main() -> None:
    for lines in run_on_ranks(_digest, 2, timeout=3000):
        for line in lines:
            print(line)


if __name__ == "__main__":
    main()
