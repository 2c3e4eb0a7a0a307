"""Checkpoints of a pipeline engine: one zeroshard checkpoint per stage, saved and loaded within the same mesh.

[Note: pipeline checkpoints]
Each stage holds different layers, so each stage writes a complete zeroshard checkpoint of its own module (its
ZeRO shards over its data-parallel group) under `<save_dir>/pipe_stage_XX/`, with the usual tags, `latest` and
crash-safe commit (docs/checkpoint.md). The checkpoint code rendezvouses through the c10d store with keys per
rank of the group it is given; the stages take turns (a barrier over the whole world between turns) so that the
dp ranks of one stage are the only ones in a call at a time and every rank counts the same calls. Loading needs
the same num_stages and partition; the data-parallel degree may differ, as for any zeroshard checkpoint. With an
mpu's tensor-parallel layers ([Note: 3D mesh]) the tp ranks of a stage would write their different slices into the
same folder: save and load are refused there until the checkpoint holds a tensor-parallel dimension.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from zeroshard.checkpoint.engine_mixin import CheckpointMixin
from zeroshard.comm.topology import Topology
from zeroshard.errors import ZeroshardError
from zeroshard.pipe.context import PipeContext

T = TypeVar("T")


def stage_dir(root: str | os.PathLike[str], stage: int) -> str:
    return os.path.join(os.fspath(root), f"pipe_stage_{stage:02d}")


class PipelineCheckpointMixin(CheckpointMixin):
    """save_checkpoint / load_checkpoint per stage ([Note: pipeline checkpoints])."""

    pipe: PipeContext
    topology: Topology

    def save_checkpoint(
        self,
        save_dir: str | os.PathLike[str],
        tag: Any = None,
        client_state: Any = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        self._refuse_three_d("save_checkpoint")
        folder = stage_dir(save_dir, self.pipe.groups.stage)
        return self._stagewise(
            lambda: CheckpointMixin.save_checkpoint(
                self, folder, tag, client_state, save_latest, exclude_frozen_parameters
            )
        )

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike[str],
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict[str, Any] | None]:
        self._refuse_three_d("load_checkpoint")
        folder = stage_dir(load_dir, self.pipe.groups.stage)
        return self._stagewise(
            lambda: CheckpointMixin.load_checkpoint(
                self,
                folder,
                tag,
                load_module_strict,
                load_optimizer_states,
                load_lr_scheduler_states,
                load_module_only,
            )
        )

    def _refuse_three_d(self, what: str) -> None:
        if self.pipe.tp_size > 1:
            raise ZeroshardError(
                f"{what} with a PipelineModule and an mpu's tensor-parallel layers (pp x tp) is not implemented; "
                "train without checkpoints or drop one of the two dimensions"
            )

    def _stagewise(self, call: Callable[[], T]) -> T:
        result: T | None = None
        error: BaseException | None = None
        for stage in range(self.pipe.groups.grid.stages):
            if stage == self.pipe.groups.stage:
                try:
                    with self._stage_topology():
                        result = call()
                except BaseException as e:  # noqa: BLE001 - the other stages must still reach the barrier
                    error = e
            self._world_barrier()
        if error is not None:
            raise error
        return result  # type: ignore[return-value]

    @contextlib.contextmanager
    def _stage_topology(self) -> Iterator[None]:
        """The checkpoint code sees this stage's data-parallel group as the world."""
        world = self.topology
        groups = self.pipe.groups
        self.topology = dataclasses.replace(
            world, rank=groups.replica, world_size=groups.grid.dp, group=groups.dp_group
        )
        try:
            yield
        finally:
            self.topology = world

    def _world_barrier(self) -> None:
        self.pipe.world.all_reduce(torch.zeros(1, device=self.topology.device), label="pipe.checkpoint_turn")
