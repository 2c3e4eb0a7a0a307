"""The recommendation: the decision tree of seed 000 (a ZeRO tuning guide) as the starting point, then a
configuration that fits ([Note: levers] in levers.py).

    parameters < 10B         -> stage 0/1 (stage 1 when there is more than one rank)
    10B <= parameters <= 100B -> stage 2 + CPU optimizer offload
                                 GPU memory sufficient? yes -> overlap_comm; no -> pin_memory
    parameters > 100B        -> stage 3 + NVMe offload (combine with 3D parallelism)

"Fits" and "sufficient" both mean the per-rank GPU bytes stay under `HEADROOM` of the GPU's memory. When the
tree's choice fits at the micro-batch asked for, it is the recommendation. Otherwise the recommendation is the
cheapest candidate that fits, its ds_config is printed, and the tree's choice is named as not fitting; when no
candidate fits, the recommendation says so and names the one that needs the least memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Final

from zeroshard.cli.estimate.formulas import Cluster, Option
from zeroshard.cli.estimate.levers import HEADROOM, Plan, candidates, first_fit, fits
from zeroshard.cli.estimate.rows import Row

SMALL: Final = 10e9
LARGE: Final = 100e9

__all__ = ["HEADROOM", "Recommendation", "recommend"]


@dataclass(frozen=True)
class Recommendation:
    option: Option
    zero_optimization: dict[str, Any]
    reasons: list[str]
    fits: bool | None  # None: GPU memory unknown
    checkpointing: bool = False
    micro_batch: int = 1
    gpu_bytes: int | None = None  # per rank, with the levers above
    tree_option: Option | None = None  # the decision tree's choice, when it is not the recommendation
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # more ds_config blocks (expert_parallel)

    def to_json(self) -> dict[str, Any]:
        return {
            **self.option.to_json(),
            "zero_optimization": self.zero_optimization,
            **self.extra,
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "activation_checkpointing": self.checkpointing,
            "gpu_bytes_per_rank": self.gpu_bytes,
            "reasons": self.reasons,
            "fits": self.fits,
            "decision_tree": None if self.tree_option is None else self.tree_option.label(),
            "notes": self.notes,
        }


def recommend(
    params: int,
    rows: list[Row],
    cluster: Cluster,
    gpu_memory: int | None,
    activations: Callable[[bool, int], int] | None = None,
    checkpointing: bool = False,
    micro_batch: int = 1,
) -> Recommendation:
    """The tree's choice if it fits, else the cheapest configuration that does ([Note: levers]).
    `activations(checkpointing, micro_batch)` gives activation bytes per rank for the levers; without it only
    the rows as given (the micro-batch and checkpointing they were computed with) are considered."""
    by_option = {row.option: row for row in rows}
    tree, why, notes = _tree(params, cluster)
    if tree not in by_option and tree.stage == 0:  # no stage-0 row with bf16 master weights (DeepSpeed: 1-3 only)
        tree = Option(1)
        why.append("bf16 master weights need ZeRO stage 1-3: stage 1")
    elif tree not in by_option:  # expert_parallel: rows of stages 1-3 without NVMe
        tree = Option(1) if tree.stage < 2 else Option(3, "cpu", "cpu")
        why.append(f"expert_parallel trains at ZeRO stages 1-3 without NVMe: {tree.label()}")
    need = by_option[tree].gpu_bytes_per_rank
    sufficient = gpu_memory is not None and fits(need, gpu_memory)
    tight = SMALL <= params <= LARGE and not sufficient  # the tree's memory branch, said in the reasons
    if params >= SMALL and params <= LARGE:
        budget = "unknown" if gpu_memory is None else f"{_gib(need)} of {_gib(gpu_memory)}"
        why.append(
            f"GPU memory sufficient ({budget}): overlap_comm on (its extra buckets fit)"
            if sufficient
            else f"GPU memory tight ({budget}): pin_memory on for faster host transfers, overlap_comm off"
        )
    if gpu_memory is None:
        zero = _zero_config(tree, sufficient)
        return Recommendation(tree, zero, why, None, checkpointing, micro_batch, need, None, notes)
    if sufficient:
        zero = _zero_config(tree, sufficient)
        return Recommendation(tree, zero, why, True, checkpointing, micro_batch, need, None, notes)
    if activations is None:  # no levers: the options at the rows' own activations
        plans: Iterator[Plan] = _as_given(rows, checkpointing, micro_batch)
    else:
        plans = candidates(rows, activations, checkpointing, micro_batch)
    chosen, smallest = first_fit(plans, gpu_memory)
    limit = f"{_gib(int(HEADROOM * gpu_memory))} ({HEADROOM:.0%} of {_gib(gpu_memory)})"
    why.append(f"the decision tree's {tree.label()} needs {_gib(need)} per GPU: more than {limit}")
    if chosen is None:
        why.append(
            f"nothing fits: the smallest, {smallest.label()}, needs {_gib(smallest.gpu_bytes)} per GPU; add GPUs "
            "or nodes, shorten --seq-len, or add tensor/pipeline parallelism"
        )
        return _from_plan(smallest, False, why, tree, notes, tight)
    why.append(
        f"fits: {chosen.label()} needs {_gib(chosen.gpu_bytes)} per GPU, at most {limit}; "
        f"and {_gib(chosen.cpu_bytes_per_node)} of CPU memory per node"
    )
    if chosen.checkpointing and not checkpointing:
        notes.append(
            "activation checkpointing: model.gradient_checkpointing_enable() (Hugging Face), `zeroshard train "
            "--gradient-checkpointing`, or zeroshard.checkpointing.checkpoint around each layer"
        )
    if chosen.micro_batch < micro_batch:
        notes.append(
            f"micro-batch {micro_batch} -> {chosen.micro_batch}: raise gradient_accumulation_steps to keep "
            "the global batch"
        )
    recommendation = _from_plan(chosen, True, why, tree, notes, tight)
    return _partial_offload(recommendation, rows, gpu_memory, params, cluster.world_size)


def _partial_offload(
    rec: Recommendation, rows: list[Row], gpu_memory: int, params: int, world_size: int
) -> Recommendation:
    """Stage 3 with the whole optimizer offloaded, when part of it fits on the GPU: the smallest
    `offload_optimizer.ratio` (in steps of 0.05) that stays under the limit ([Note: partial offload] in
    offload/tier.py), with sub-groups small enough (about 20 per rank) for the split to follow it."""
    if rec.option != Option(3, "cpu") or rec.gpu_bytes is None:
        return rec
    by_option = {row.option: row for row in rows}
    offloaded = by_option[Option(3, "cpu")].states
    moved = by_option[Option(3)].states.gpu - offloaded.gpu  # GPU bytes per rank, ratio 0 -> 1
    host_states = offloaded.master_weights + offloaded.optimizer_state  # on the host at ratio 1
    room = HEADROOM * gpu_memory - rec.gpu_bytes
    if moved <= 0 or room <= 0:
        return rec
    ratio = max(math.ceil((1.0 - room / moved) * 20) / 20, 0.05)
    if ratio >= 1.0:
        return rec
    gpu = rec.gpu_bytes + int((1.0 - ratio) * moved)
    sub_group = max(math.ceil(params / world_size / 20 / 1e6), 1) * 1_000_000
    zero = {**rec.zero_optimization, "sub_group_size": sub_group}
    zero["offload_optimizer"] = {**zero["offload_optimizer"], "ratio": ratio}
    reason = (
        f"partial offload: offload_optimizer.ratio {ratio:g} offloads {ratio:.0%} of the optimizer state and keeps "
        f"the rest on the GPU ({_gib(gpu)} per GPU, still under the limit; {_gib(int(ratio * host_states))} of master "
        f"weights and optimizer state in host memory per rank instead of {_gib(host_states)}, and as much less host "
        f"work per step); sub_group_size {sub_group:,} makes about 20 sub-groups per rank, the split's granularity"
    )
    return replace(rec, zero_optimization=zero, gpu_bytes=gpu, reasons=[*rec.reasons, reason])


def _tree(params: int, cluster: Cluster) -> tuple[Option, list[str], list[str]]:
    billions = params / 1e9
    if params < SMALL:
        option = Option(1) if cluster.world_size > 1 else Option(0)
        why = [f"{billions:.3g}B parameters < 10B: stage 0/1"]
        why.append("stage 1: optimizer states sharded over the ranks" if option.stage else "one rank: stage 0")
        return option, why, []
    if params <= LARGE:
        return Option(2, "cpu"), [f"{billions:.3g}B parameters in 10B-100B: stage 2 + CPU optimizer offload"], []
    why = [f"{billions:.3g}B parameters > 100B: stage 3 + NVMe offload (ZeRO-Infinity)"]
    return (
        Option(3, "nvme", "nvme"),
        why,
        ["combine with tensor/pipeline parallelism (3D parallelism); zeroshard itself is data-parallel"],
    )


def _zero_config(option: Option, sufficient: bool) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": option.stage}
    for key, device in (("offload_optimizer", option.offload_optimizer), ("offload_param", option.offload_param)):
        if device == "cpu":
            zero[key] = {"device": "cpu", "pin_memory": not sufficient}
        elif device == "nvme":
            zero[key] = {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True}
    if option.stage >= 2:
        zero["overlap_comm"] = sufficient or option.offload_param == "nvme"
        zero["contiguous_gradients"] = True
    return zero


def _as_given(rows: list[Row], checkpointing: bool, micro_batch: int) -> Iterator[Plan]:
    for row in rows:
        yield Plan(row.option, checkpointing, micro_batch, row.gpu_bytes_per_rank, row.cpu_bytes_per_node)


def _from_plan(plan: Plan, ok: bool, why: list[str], tree: Option, notes: list[str], tight: bool) -> Recommendation:
    """A plan chosen because the tree's choice did not fit. `tight`: the reasons said GPU memory is tight (10B-100B
    parameters: the tree's branch), so the config does what they say (pinned host buffers, no overlap_comm
    buckets) whether or not the plan itself fits; else a plan that fits gets overlap_comm."""
    zero = _zero_config(plan.option, sufficient=ok and not tight)
    return Recommendation(plan.option, zero, why, ok, plan.checkpointing, plan.micro_batch, plan.gpu_bytes, tree, notes)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
