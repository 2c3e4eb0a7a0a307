"""The recommendation: the decision tree of seed 000 (a ZeRO tuning guide), then a check that it fits.

    parameters < 10B         -> stage 0/1 (stage 1 when there is more than one rank)
    10B <= parameters <= 100B -> stage 2 + CPU optimizer offload
                                 GPU memory sufficient? yes -> overlap_comm; no -> pin_memory
    parameters > 100B        -> stage 3 + NVMe offload (combine with 3D parallelism)

"Sufficient" means the option's per-rank GPU bytes stay under `HEADROOM` of the GPU's memory. When
the tree's choice does not fit at all, the first option (in `OPTIONS` order: least sharding and
offload first) that does is named as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from zeroshard.cli.estimate.formulas import Cluster, Option
from zeroshard.cli.estimate.rows import Row

SMALL: Final = 10e9
LARGE: Final = 100e9
HEADROOM: Final = 0.8  # allocator fragmentation, CUDA context, framework workspace


@dataclass(frozen=True)
class Recommendation:
    option: Option
    zero_optimization: dict[str, Any]
    reasons: list[str]
    fits: bool | None  # None: GPU memory unknown
    fallback: Option | None = None  # the first option that fits, when `option` does not
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            **self.option.to_json(),
            "zero_optimization": self.zero_optimization,
            "reasons": self.reasons,
            "fits": self.fits,
            "fallback": None if self.fallback is None else self.fallback.label(),
            "notes": self.notes,
        }


def recommend(params: int, rows: list[Row], cluster: Cluster, gpu_memory: int | None) -> Recommendation:
    by_option = {row.option: row for row in rows}
    billions = params / 1e9
    notes: list[str] = []
    if params < SMALL:
        option = Option(1) if cluster.world_size > 1 else Option(0)
        why = [f"{billions:.3g}B parameters < 10B: stage 0/1"]
        why.append("stage 1: optimizer states sharded over the ranks" if option.stage else "one rank: stage 0")
        zero: dict[str, Any] = {"stage": option.stage}
    elif params <= LARGE:
        option = Option(2, "cpu")
        why = [f"{billions:.3g}B parameters in 10B-100B: stage 2 + CPU optimizer offload"]
        need = by_option[option].gpu_bytes_per_rank
        sufficient = gpu_memory is not None and need <= HEADROOM * gpu_memory
        budget = "unknown" if gpu_memory is None else f"{_gib(need)} of {_gib(gpu_memory)}"
        if sufficient:
            why.append(f"GPU memory sufficient ({budget}): overlap_comm on (its extra buckets fit)")
        else:
            why.append(f"GPU memory tight ({budget}): pin_memory on for faster host transfers, overlap_comm off")
        zero = {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": not sufficient},
            "overlap_comm": sufficient,
            "contiguous_gradients": True,
        }
    else:
        option = Option(3, "nvme", "nvme")
        why = [f"{billions:.3g}B parameters > 100B: stage 3 + NVMe offload (ZeRO-Infinity)"]
        nvme = {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True}
        zero = {"stage": 3, "offload_optimizer": dict(nvme), "offload_param": dict(nvme), "overlap_comm": True}
        notes.append("combine with tensor/pipeline parallelism (3D parallelism); zeroshard itself is data-parallel")
    fits = None if gpu_memory is None else by_option[option].gpu_bytes_per_rank <= gpu_memory
    fallback = None
    if fits is False:
        assert gpu_memory is not None
        fallback = next((row.option for row in rows if row.gpu_bytes_per_rank <= gpu_memory), None)
        if fallback is None:
            notes.append("no option fits: lower --micro-batch or --seq-len, use --gradient-checkpointing, or add GPUs")
    return Recommendation(option, zero, why, fits, fallback, notes)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
