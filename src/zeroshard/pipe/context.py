"""What the pipeline engine needs beyond a ZeRO engine: the mesh's groups, their collectives, the schedule kind.

[Note: pipeline config]
DeepSpeed 0.19.8's `pipeline` block has stages ("auto"), partition ("best"), seed_layers,
activation_checkpoint_interval, pipe_partitioned and grad_partitioned; its PipelineModule's arguments decide the
split, and of the block the engine reads `activation_checkpoint_interval` (above 0 it becomes the module's:
[Note: pipeline activation checkpointing] in pipe/module.py) and `use_reentrant` (which checkpoint function).
zeroshard checks the same keys (`stages`, if an int, must equal the module's
num_stages) and reads two of its own, which DeepSpeed ignores: `schedule` ("1f1b", DeepSpeed's TrainSchedule and the
default; "gpipe"; or "interleaved", torch's interleaved 1F1B) and `virtual_stages` (chunks per rank with
"interleaved", default 2: [Note: interleaved chunks]). ZeRO stages 2 and 3 are refused as DeepSpeed refuses them
with a pipeline: gradients are accumulated over all micro-batches of the schedule before the data-parallel
reduction.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from zeroshard.comm.collectives import Collectives, scope_of
from zeroshard.comm.topology import NodeLayout
from zeroshard.config.parse import misspelt
from zeroshard.errors import ConfigError
from zeroshard.pipe.mesh import PipeGroups
from zeroshard.pipe.module import PipelineModule
from zeroshard.zero.flat.bystanders import PIPE_REPLICATED

SCHEDULES = ("1f1b", "gpipe", "interleaved")
DEEPSPEED_KEYS = {
    "stages",
    "partition",
    "seed_layers",
    "activation_checkpoint_interval",
    "pipe_partitioned",
    "grad_partitioned",
    "use_reentrant",
}


OURS = {"schedule", "virtual_stages"}


def pipeline_schedule(block: Mapping[str, Any] | None, module: PipelineModule) -> tuple[str, int]:
    """The schedule named by the `pipeline` block and the chunks per rank, after checking them against the module
    ([Note: pipeline config])."""
    stages, schedule, virtual = check_pipeline_block(block)
    if stages is not None and stages != module.num_stages:
        raise ConfigError(f"pipeline.stages={stages} but the PipelineModule has num_stages={module.num_stages}")
    given = dict(block or {})
    if given.get("activation_checkpoint_interval", 0) > 0:  # as DeepSpeed's engine: [Note: pipeline activation
        module.set_checkpoint_interval(given["activation_checkpoint_interval"])  # checkpointing] in pipe/module.py
    if given.get("use_reentrant") is False:  # DeepSpeed's engine puts its non-reentrant checkpoint in the user's place
        module.use_non_reentrant_checkpoint()
    return schedule, virtual


def check_pipeline_block(block: Mapping[str, Any] | None) -> tuple[int | None, str, int]:
    """The block's stages (None: "auto"), schedule and chunks per rank, checked without the module ([Note: blocks
    checked by their readers] in config/blocks.py)."""
    block = dict(block or {})
    unknown = set(block) - DEEPSPEED_KEYS - OURS
    if unknown:
        raise ConfigError(
            misspelt("pipeline", unknown, DEEPSPEED_KEYS | OURS)
            or f"pipeline: unknown keys {sorted(unknown)}; expected {sorted(DEEPSPEED_KEYS | OURS)}"
        )
    stages = block.get("stages", "auto")
    if stages != "auto" and (not isinstance(stages, int) or isinstance(stages, bool) or stages < 1):
        raise ConfigError(f'pipeline.stages={stages!r}: expected "auto" or a positive int (the PipelineModule\'s)')
    schedule = str(block.get("schedule", "1f1b")).lower()
    if schedule not in SCHEDULES:
        raise ConfigError(f"pipeline.schedule={schedule!r}: expected one of {SCHEDULES}")
    virtual = block.get("virtual_stages", 2 if schedule == "interleaved" else 1)
    if not isinstance(virtual, int) or virtual < 1 or (schedule == "interleaved") != (virtual > 1):
        raise ConfigError(
            f"pipeline.virtual_stages={virtual!r}: chunks per rank, at least 2 and only with "
            '"schedule": "interleaved" (default 2 there)'
        )
    interval = block.get("activation_checkpoint_interval", 0)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
        raise ConfigError(
            f"pipeline.activation_checkpoint_interval={interval!r}: expected an int >= 0 (layers per range)"
        )
    if not isinstance(block.get("use_reentrant", True), bool):
        raise ConfigError(f"pipeline.use_reentrant={block['use_reentrant']!r}: expected true or false")
    return None if stages == "auto" else stages, schedule, virtual


def refuse_unsupported(stage: int, backend: str) -> None:
    if stage >= 2:
        raise ConfigError(
            f"zero_optimization.stage {stage} with a PipelineModule: pipeline parallelism works with ZeRO stages 0 "
            "and 1 only (as DeepSpeed: gradients are reduced once after all micro-batches, which stages 2 and 3 "
            'cannot do); set "zero_optimization": {"stage": 1}'
        )
    if backend != "zero":
        raise ConfigError(f'zeroshard.backend "{backend}" with a PipelineModule: use the "zero" backend')


@dataclass
class PipeContext:
    """This rank's place in the pp x dp mesh and the collectives over its groups."""

    groups: PipeGroups
    world: Collectives
    dp_comm: Collectives
    pp_comm: Collectives
    tie_comms: dict[str, tuple[Collectives, int]]  # key -> (collectives, global rank of the lowest stage)
    schedule: str
    tp_size: int = 1  # > 1 with an mpu's tensor-parallel layers ([Note: 3D mesh] in pipe/three_d.py)
    norm_comm: Collectives | None = None  # the pp x tp group there; the pipeline group otherwise

    @classmethod
    def create(cls, world: Collectives, module: PipelineModule, schedule: str) -> PipeContext:
        groups = PipeGroups.create(module.grid, world.rank, module.tied_stages())
        grid, nodes = module.grid, NodeLayout.from_env(world.world_size)
        dp_ranks, pp_ranks = grid.dp_ranks(groups.stage), grid.pp_ranks(groups.replica)
        dp_comm = world.subgroup(groups.dp_group, grid.dp, groups.replica, scope_of(nodes, dp_ranks))
        pp_comm = world.subgroup(groups.pp_group, grid.stages, groups.stage, scope_of(nodes, pp_ranks))
        ties = {
            key: (world.subgroup(group, len(ranks), ranks.index(world.rank), scope_of(nodes, ranks)), ranks[0])
            for key, (group, ranks) in groups.tie_groups.items()
        }
        mark_tied_copies(module, {key: root != world.rank for key, (_, root) in ties.items()})
        return cls(groups, world, dp_comm, pp_comm, ties, schedule)

    @property
    def is_first(self) -> bool:
        return self.groups.stage == 0

    @property
    def is_last(self) -> bool:
        return self.groups.stage == self.groups.grid.stages - 1

    @property
    def last_stage_rank(self) -> int:
        """The global rank of this pipeline's last stage (where the loss is)."""
        return self.groups.grid.pp_ranks(self.groups.replica)[-1]

    @property
    def data_parallel_size(self) -> int:
        """The replicas the data is split over: the lanes of a stage, less the tensor-parallel ones ([Note: 3D
        mesh])."""
        return self.groups.grid.dp // self.tp_size

    @property
    def data_parallel_rank(self) -> int:
        return self.groups.replica // self.tp_size

    @property
    def model_parallel(self) -> Collectives:
        """The group the clipping norm and the overflow flag are summed over."""
        return self.norm_comm if self.norm_comm is not None else self.pp_comm

    @property
    def dp_root(self) -> int:
        return self.groups.grid.dp_ranks(self.groups.stage)[0]

    def sync_tied(self, module: nn.Module) -> None:
        """[Note: tied layers] every copy starts from the lowest stage's values."""
        assert isinstance(module, PipelineModule)
        for key, (comm, root) in self.tie_comms.items():
            for param in module.tied_parameters(key):
                comm.broadcast(param.data, src=root, label=f"pipe.tie.{key}")

    def reduce_tied_grads(self, module: PipelineModule) -> None:
        """[Note: tied layers] sum the copies' gradients (held in `.grad` until the step collects them)."""
        for key, (comm, _root) in self.tie_comms.items():
            params = module.tied_parameters(key)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = _flatten_dense_tensors(grads)
            comm.all_reduce(flat, label=f"pipe.tie_grads.{key}")
            for param, synced in zip(params, _unflatten_dense_tensors(flat, grads), strict=True):
                param.grad = synced.clone()


def mark_tied_copies(module: PipelineModule, copy: dict[str, bool]) -> None:
    """[Note: tied copies in the norm]

    A weight tied across pipeline stages (a `TiedLayerSpec` key on several stages: the embedding and the output
    layer of a GPT) has one copy per stage, synchronised ([Note: tied layers]): after `reduce_tied_grads` every
    copy holds the same summed gradient. The clipping norm adds every stage's share over the pipeline group, so
    it would count that gradient once per copy; DeepSpeed counts it once: its PipelineModule sets
    `ds_pipe_replicated` on every parameter (True on the copies of ranks other than the lowest stage of the tie
    group, False elsewhere) and its optimizers leave the True ones out of the norm. zeroshard sets the same
    attribute the same way (code written for DeepSpeed may read it) and the flat strategy (stages 0 and 1, the
    ones a pipeline runs) gives the norm only the ranges of its gradient shards outside those copies
    (`counted_ranges` in zero/layout.py); the copies still step with the clipped gradient, so they stay equal.
    Only the tied weights themselves (`tied_weight_attr`) are synchronised and marked: DeepSpeed also marks the
    other parameters of a tied module (a bias), which it does not synchronise."""
    for param in module.parameters():
        setattr(param, PIPE_REPLICATED, False)
    for key, is_copy in copy.items():
        for param in module.tied_parameters(key):
            setattr(param, PIPE_REPLICATED, is_copy)


def dp_size(model: nn.Module, world_size: int) -> int:
    """The data-parallel degree the batch arithmetic uses."""
    return model.grid.dp if isinstance(model, PipelineModule) else world_size
