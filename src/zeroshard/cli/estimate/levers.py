"""The search for a configuration that fits: ZeRO option, activation checkpointing and micro-batch as levers.

[Note: levers] Every candidate is an option of `OPTIONS` with checkpointing off or on and a micro-batch halved
from the one asked for down to 1. The first candidate that fits in `HEADROOM` of the GPU wins, in order of what
each lever costs in speed:
1. a smaller micro-batch last (fewer tokens per step; the global batch needs more accumulation steps);
2. parameter offload (CPU, then NVMe) only after everything without it: its traffic crosses PCIe every step;
3. activation checkpointing (about a third more compute) before that, after the options without it;
4. among the rest, `OPTIONS` order: least sharding and offload first.
A lever the user already pulled (`--gradient-checkpointing`) stays pulled. When nothing fits, the candidate that
needs the least GPU memory is reported with the shortfall.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final

from zeroshard.cli.estimate.formulas import OPTIONS, Option
from zeroshard.cli.estimate.rows import Row

HEADROOM: Final = 0.8  # allocator fragmentation, CUDA context, framework workspace
_PARAM_OFFLOAD_COST: Final = {"none": 0, "cpu": 1, "nvme": 2}


@dataclass(frozen=True)
class Plan:
    option: Option
    checkpointing: bool
    micro_batch: int
    gpu_bytes: int  # per rank: model states on the GPU, activations, buffers
    cpu_bytes_per_node: int

    def label(self) -> str:
        levers = [f"micro-batch {self.micro_batch}"]
        if self.checkpointing:
            levers.append("activation checkpointing")
        return f"{self.option.label()} ({', '.join(levers)})"


def fits(gpu_bytes: int, gpu_memory: int) -> bool:
    return gpu_bytes <= HEADROOM * gpu_memory


def micro_batches(start: int) -> list[int]:
    out = [start]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def candidates(
    rows: list[Row], activations: Callable[[bool, int], int], checkpointing: bool, micro_batch: int
) -> Iterator[Plan]:
    """[Note: levers] every candidate, cheapest first. `activations(checkpointing, micro_batch)` gives the
    activation bytes per rank; they are the same for every option."""
    by_option = {row.option: row for row in rows}
    choices = (True,) if checkpointing else (False, True)
    for mb in micro_batches(micro_batch):
        ranked = sorted(
            ((option, ckpt) for option in OPTIONS for ckpt in choices),
            key=lambda c: (_PARAM_OFFLOAD_COST[c[0].offload_param], c[1], OPTIONS.index(c[0])),
        )
        for option, ckpt in ranked:
            row = by_option.get(option)
            if row is None:  # not a row for this precision (stage 0 with bf16 master weights)
                continue
            gpu = row.gpu_bytes_per_rank - row.activation_bytes + activations(ckpt, mb)
            yield Plan(option, ckpt, mb, gpu, row.cpu_bytes_per_node)


def first_fit(plans: Iterator[Plan], gpu_memory: int) -> tuple[Plan | None, Plan]:
    """(the first plan that fits or None, the plan needing the least GPU memory)."""
    smallest: Plan | None = None
    for plan in plans:
        if fits(plan.gpu_bytes, gpu_memory):
            return plan, plan
        if smallest is None or plan.gpu_bytes < smallest.gpu_bytes:
            smallest = plan
    assert smallest is not None  # OPTIONS is not empty
    return None, smallest
