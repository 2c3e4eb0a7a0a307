"""The experiments an autotuning run may try, pruned with `zeroshard estimate`'s formulas before any runs.

[Note: autotuning space] Every ZeRO option (stage 0-3 x offload, `OPTIONS`) x micro-batch 1, 2, 4, ... doubling
while the estimate fits the memory cap (and the global batch stays within `max_train_batch_size`) x reduce bucket
sizes. The estimate prunes what cannot fit; what is left is measured, because the estimate does not know speed.
Order: gridsearch is the order below (least sharding first, micro-batch rising); random shuffles it (seeded);
model_based tries the largest micro-batch of each option first (throughput grows with it until memory runs
out), a cheap stand-in for DeepSpeed's cost model.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

from zeroshard.cli.estimate.formulas import OPTIONS, Cluster, Option, Precision
from zeroshard.cli.estimate.rows import estimate_rows
from zeroshard.cli.estimate.shapes import ModelInfo

BUCKETS = (50_000_000, 500_000_000)  # reduce_bucket_size: small, DeepSpeed's default


@dataclass(frozen=True)
class Experiment:
    stage: int
    offload_optimizer: str
    offload_param: str
    micro_batch: int
    bucket: int
    estimated_bytes: int  # per rank, from the estimator

    @property
    def option(self) -> Option:
        return Option(self.stage, self.offload_optimizer, self.offload_param)

    @property
    def name(self) -> str:
        off = "".join(
            f"_{k}-{v}" for k, v in (("oo", self.offload_optimizer), ("op", self.offload_param)) if v != "none"
        )
        return f"z{self.stage}{off}_mbs{self.micro_batch}_bucket{self.bucket:.0e}".replace("+", "")

    def ds_config(self, base: dict[str, Any]) -> dict[str, Any]:
        """`base` (the user's ds_config, autotuning block removed) with this experiment's choices."""
        config = {k: v for k, v in base.items() if k not in ("autotuning", "train_batch_size")}
        config["train_micro_batch_size_per_gpu"] = self.micro_batch
        config.setdefault("gradient_accumulation_steps", 1)
        zero = dict(config.get("zero_optimization", {}))
        zero.update(stage=self.stage, reduce_bucket_size=self.bucket)
        for key, device in (("offload_optimizer", self.offload_optimizer), ("offload_param", self.offload_param)):
            given = dict(zero.pop(key, None) or {})
            if device == "none":
                continue
            # the user's block (pin_memory, nvme_path, ratio, ...) where this experiment keeps its device
            block = given if given.get("device") == device else {"device": device}
            if self.stage != 3 or device != "cpu":
                block.pop("ratio", None)  # partial offload is stage 3's, on the CPU ([Note: partial offload])
            zero[key] = block
        config["zero_optimization"] = zero
        config.setdefault("optimizer", {"type": "AdamW", "params": {"lr": 1e-4}})
        return config

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, **asdict(self)}


def build_space(
    model: ModelInfo,
    cluster: Cluster,
    precision: Precision,
    seq_len: int,
    cap: int | None,
    max_train_batch_size: int | None,
    tuner_type: str,
    max_micro_batch: int = 1024,
) -> tuple[list[Experiment], list[Experiment]]:
    """(experiments to try, in tuner order; the smallest-memory experiment per option, for a cap nothing meets)."""
    space: list[Experiment] = []
    smallest: list[Experiment] = []
    for option in OPTIONS:
        if option.offload_optimizer == "nvme" or option.offload_param == "nvme":
            continue  # needs an nvme_path; tune it by hand
        mb = 1
        while mb <= max_micro_batch:
            if max_train_batch_size is not None and mb * cluster.world_size > max_train_batch_size:
                break
            row = next((r for r in estimate_rows(model, cluster, precision, seq_len, mb) if r.option == option), None)
            if row is None:  # no such row for this precision (stage 0 with bf16 master weights)
                break
            if mb == 1:
                smallest.append(_experiment(option, mb, BUCKETS[0], row.gpu_bytes_per_rank))
            if cap is not None and row.gpu_bytes_per_rank > cap:
                break
            space += [_experiment(option, mb, bucket, row.gpu_bytes_per_rank) for bucket in BUCKETS]
            mb *= 2
    return _order(space, tuner_type), sorted(smallest, key=lambda e: e.estimated_bytes)


def _experiment(option: Option, mb: int, bucket: int, estimated: int) -> Experiment:
    return Experiment(option.stage, option.offload_optimizer, option.offload_param, mb, bucket, estimated)


def _order(space: list[Experiment], tuner_type: str) -> list[Experiment]:
    if tuner_type == "random":
        shuffled = list(space)
        random.Random(0).shuffle(shuffled)
        return shuffled
    if tuner_type == "model_based":
        return sorted(space, key=lambda e: (-e.micro_batch, OPTIONS.index(e.option), e.bucket))
    return space
