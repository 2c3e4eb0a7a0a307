"""Checkpoints of a pipeline engine: one zeroshard checkpoint per stage, loaded with the same stages and tp, any dp.

[Note: pipeline checkpoints]
Each stage holds different layers, so each stage writes a complete zeroshard checkpoint of its own module (its ZeRO
shards over its data-parallel group) under `<save_dir>/pipe_stage_XX/`, with the usual tags, `latest` and crash-safe
commit (docs/checkpoint.md). The checkpoint code rendezvouses through the c10d store with keys per rank of the group
it is given; every stage saves at the same time (as DeepSpeed's stages do), its keys under a prefix of its own (they
took turns, a barrier over the whole world between turns: a save took the sum of the stages' times), and one
all-reduce over the world at the end tells every rank which stages failed. A save and a load start with a rendezvous
over the whole world (`WORLD_PREFIX`: the space check; a load's entry), which the absence watch reads
([Note: one-rank checkpoint calls]). A stage that failed leaves the others' `latest` moved on: a load by `latest`
checks that every stage names the same tag. The space check ([Note: checkpoint space]) runs over the whole world
first (the stages share filesystems and write at once); with `pipeline_loading_checkpoint` the stages load in turns
(a node holds one rank's load buffers at a time). Loading needs the same num_stages and partition; the data-parallel
degree may differ, as for any zeroshard checkpoint: each rank reads its ZeRO ranges of its stage's folder
([Note: resharding at load]) and `adapt_batch` keeps the saved global batch by changing gradient_accumulation_steps
(dp2 -> dp1: 4 -> 8), which the schedules are keyed by, so an engine that ran a schedule before the load builds new
ones. Tested (tests/distributed/test_pipeline_reshard.py): pp2 x dp2 -> pp2 x dp1 and pp2 x dp1 -> pp2 x dp2,
ZeRO-1, 1F1B, data_iter, every step and an eval_batch after the last within 1e-5 relative of the single-process
reference for the same global batch. Untested across dp: GPipe and interleaved, ZeRO-0, and the engine's own loader
over training_data (its sampler position).

[Note: 3D checkpoints]
With an mpu's tensor-parallel layers ([Note: 3D mesh]) the "world" a stage's checkpoint sees is its lane group
(every (d, t) of the stage, rank = lane = d * tp + t), the same shape as a 2D tp x dp world, and the stage's state
is `TensorParallelState` ([Note: tensor-parallel checkpoints]): each slice is `<key>.tp<j>of<tp>`, written once by
the dp group of position j, replicated parameters once by position 0's dp group, optimizer state with them. Global
rank 0 records the mesh (`pipe_mesh.json`: num_stages, tp) at the root; every rank reads it before a stage folder is
opened and refuses another num_stages or tp (a pp x dp engine included) in one line, as it refuses a 3D load from a
folder without that record. The data-parallel degree may differ, as in 2D: the replicas `adapt_batch` divides the
global batch by are the config's (train_batch_size / (micro x accumulation)), not the tp x dp ranks of the lane
group. Tested: pp2 x tp2 x dp2 -> pp2 x tp2 x dp1 (accumulation 4 -> 8), ZeRO-1, clipping, every step and an
eval_batch within 1e-5 of the reference (tests/distributed/test_pipeline_reshard.py); dp1 -> dp2 is not. The slices
are caller-split (Megatron-marked), so a different tp is never resharded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from zeroshard.checkpoint import load as _load
from zeroshard.checkpoint.engine_mixin import CheckpointMixin
from zeroshard.checkpoint.errors import CheckpointError
from zeroshard.checkpoint.format import LATEST_FILE
from zeroshard.checkpoint.protocol import CheckpointableEngine
from zeroshard.checkpoint.save import engine_state
from zeroshard.checkpoint.space import bytes_to_write, check_space, space_report
from zeroshard.checkpoint.sync import ENTRY_PHASE, RankSync, entry_timeout, write_timeout
from zeroshard.checkpoint.torn import cure, load_scope, mark_torn, refuse_torn
from zeroshard.comm.topology import NodeLayout, Topology
from zeroshard.errors import ZeroshardError
from zeroshard.pipe.context import PipeContext

T = TypeVar("T")


def stage_dir(root: str | os.PathLike[str], stage: int) -> str:
    return os.path.join(os.fspath(root), f"pipe_stage_{stage:02d}")


MESH_FILE = "pipe_mesh.json"
# the store keys of the calls over the whole world (global ranks), apart from each stage's: the absence watch reads
# them ([Note: one-rank checkpoint calls])
WORLD_PREFIX = "zeroshard/pipe_world"


def write_mesh(root: str | os.PathLike[str], mesh: dict[str, int]) -> None:
    os.makedirs(root, exist_ok=True)
    path = os.path.join(os.fspath(root), MESH_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(mesh, f)
    os.replace(path + ".tmp", path)


def check_mesh(root: str | os.PathLike[str], mesh: dict[str, int]) -> None:
    """[Note: 3D checkpoints] refuse another num_stages or tp before anything else is read."""
    path = os.path.join(os.fspath(root), MESH_FILE)
    if not os.path.exists(path):
        if mesh["tensor_parallel"] > 1:
            raise ZeroshardError(
                f"load_checkpoint({os.fspath(root)!r}): no {MESH_FILE}, so not a pp x tp checkpoint; a 3D engine "
                f"(tensor_parallel {mesh['tensor_parallel']}) loads only what a 3D engine of the same mesh saved"
            )
        return  # a pp x dp checkpoint saved before the record existed
    with open(path) as f:
        saved = json.load(f)
    if saved != mesh:
        raise ZeroshardError(
            f"load_checkpoint({os.fspath(root)!r}): saved with num_stages {saved.get('num_stages')} and "
            f"tensor_parallel {saved.get('tensor_parallel')}, this engine has num_stages {mesh['num_stages']} "
            f"and tensor_parallel {mesh['tensor_parallel']}; load it into an engine of the saved mesh"
        )


class PipelineCheckpointMixin(CheckpointMixin):
    """save_checkpoint / load_checkpoint per stage ([Note: pipeline checkpoints])."""

    pipe: PipeContext
    topology: Topology
    config: Any  # ZeroshardConfig
    _saves_per_stage = True
    _checkpoint_prefix = WORLD_PREFIX

    def save_checkpoint(
        self,
        save_dir: str | os.PathLike[str],
        tag: Any = None,
        client_state: Any = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        if not save_dir:
            raise CheckpointError(f"save_checkpoint: save_dir must be a non-empty path, got {save_dir!r}")
        refuse_torn(self, "save_checkpoint")  # before the mesh file: [Note: a torn load]
        folder = stage_dir(save_dir, self.pipe.groups.stage)
        self._world_space(folder)  # [Note: checkpoint space] over every stage's writes

        def save() -> bool:
            if self.pipe.world.rank == 0:  # the engine's mesh, not its data: [Note: 3D checkpoints]
                write_mesh(save_dir, self._mesh())
            return CheckpointMixin.save_checkpoint(
                self, folder, tag, client_state, save_latest, exclude_frozen_parameters
            )

        return self._stagewise(save)

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike[str],
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Callable[..., Any] | None = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        if custom_load_fn is not None:  # (DeepSpeed's pipeline engine asserts it is None)
            raise ZeroshardError(
                "load_checkpoint(custom_load_fn=...) is not supported with a PipelineModule (each stage loads its own "
                "layers); load without it"
            )
        self._refuse_offloaded("load_checkpoint")
        # every rank arrives over the world first: a rank that trains on instead is named in seconds
        world = self.pipe.world
        sync = RankSync("load_checkpoint", world.rank, world.world_size, prefix=WORLD_PREFIX)
        sync.all_gather(ENTRY_PHASE, {}, entry_timeout())
        sync.leave(entry_timeout())
        check_mesh(load_dir, self._mesh())
        folder = stage_dir(load_dir, self.pipe.groups.stage)
        if tag is None:
            self._same_latest(folder)
        # pipeline_loading_checkpoint: a node holds one rank's load buffers at a time, so the stages take turns
        at_once = not self.config.zero_optimization.pipeline_loading_checkpoint

        def across(refused: bool) -> bool:
            """Whether any stage refused its checks ([Note: a torn load]): at once, no stage writes unless none did."""
            flag = torch.tensor([1.0 if refused else 0.0], device=self.topology.device)
            self.pipe.world.all_reduce(flag, op="max", label="pipe.checkpoint_checked")
            return bool(flag.item() > 0)

        def load() -> tuple[str | None, dict[str, Any] | None]:
            self.commit_checkpoint("load_checkpoint")
            return _load.load_checkpoint(
                self,  # type: ignore[arg-type]
                folder,
                tag,
                load_module_strict,
                load_optimizer_states,
                load_lr_scheduler_states,
                load_module_only,
                across if at_once else None,
            )

        return self._stagewise(load, at_once, load_scope(load_optimizer_states, load_module_only))

    def _turn_over(self, turns: RankSync, turn: int, wait: float, error: BaseException | None) -> BaseException | None:
        """Stage `turn`'s load is over on every rank (its device work too: the next stage's reads follow it)."""
        if self.topology.device.type == "cuda":
            torch.cuda.synchronize(self.topology.device)
        try:
            turns.all_gather(f"turn{turn}", {}, wait)
        except CheckpointError as e:
            return error or CheckpointError(
                f"load_checkpoint: pipeline stage {turn} did not finish its turn within {wait:.0f}s (its ranks loading "
                f"with pipeline_loading_checkpoint); {e}"
            )
        return error

    def _same_latest(self, folder: str) -> None:
        """Every stage's `latest` names the same tag (one all-reduce): a save that failed on some stage moved the
        others' `latest` only, and loading each stage's own would mix two checkpoints into one model. A `latest` this
        rank cannot read counts as a tag of its own (the all-reduce is reached on every rank), then raises here."""
        path = os.path.join(folder, LATEST_FILE)
        try:
            tag = Path(path).read_text(encoding="utf-8").strip() if os.path.isfile(path) else ""
            mine, error = zlib.crc32(tag.encode()), None
        except (OSError, UnicodeDecodeError) as e:
            tag, mine, error = "", -1, e
        bounds = torch.tensor([mine, -mine], dtype=torch.int64, device=self.topology.device)
        self.pipe.world.all_reduce(bounds, op="max", label="pipe.checkpoint_latest")
        if error is not None:
            raise CheckpointError(f"load_checkpoint: {path}: cannot be read ({error})") from error
        if int(bounds[0]) != mine or -int(bounds[1]) != mine:
            raise CheckpointError(
                f"load_checkpoint({os.path.dirname(folder)!r}): the pipeline stages' `latest` tags differ (stage "
                f"{self.pipe.groups.stage}: {tag or 'none'!r}), as after a save that failed on some stage; pass tag= "
                "a tag every stage folder holds"
            )

    def _world_space(self, folder: str) -> None:
        """[Note: checkpoint space] over the whole world before any stage writes: the stages write at once, so a
        filesystem they share must hold all of their bytes (each stage's own check sees its own ranks only)."""
        with self._stage_topology():
            engine = cast(CheckpointableEngine, self)
            need = bytes_to_write(engine, engine_state(engine))
        world = self.pipe.world
        sync = RankSync("save_checkpoint", world.rank, world.world_size, prefix=WORLD_PREFIX)
        hello = sync.all_gather(ENTRY_PHASE, space_report(os.path.abspath(folder), need), entry_timeout())
        check_space(hello, os.path.abspath(os.path.dirname(folder)))
        sync.leave(entry_timeout())

    def _mesh(self) -> dict[str, int]:
        return {"num_stages": self.pipe.groups.grid.stages, "tensor_parallel": self.pipe.tp_size}

    def _stagewise(self, call: Callable[[], T], at_once: bool = True, load: int | None = None) -> T:
        """`call` on every stage at once (or stage after stage: a barrier between turns), each over its own
        data-parallel group and store keys; then every rank learns which stages failed (one all-reduce) and, where one
        did, raises: its own error, or one naming them. `load`: the call is a load of that scope, and a failure
        where any stage wrote leaves every stage torn ([Note: a torn load])."""
        result: T | None = None
        error: BaseException | None = None
        torn_before = self._torn_load
        world = self.pipe.world
        # turns end through the store, each wait bounded by a stage's own load deadlines (its plan and its reads, a
        # node's ranks in turn): an all-reduce would leave the waiting stages to the process group's timeout (NCCL's
        # 10 minutes). A wait that times out is this rank's error, and it still reaches the all-reduce below.
        turns = None if at_once else RankSync("load_checkpoint", world.rank, world.world_size, prefix=WORLD_PREFIX)
        wait = 2 * write_timeout() * NodeLayout.from_env(world.world_size).ranks_per_node
        for turn in range(1 if at_once else self.pipe.groups.grid.stages):
            if at_once or turn == self.pipe.groups.stage:
                try:
                    with self._stage_topology():
                        result = call()
                except BaseException as e:  # noqa: BLE001 - the other stages must still reach the all-reduce
                    error = e
            if turns is not None:
                error = self._turn_over(turns, turn, wait, error)
        if turns is not None:
            try:
                turns.leave(wait)
            except CheckpointError as e:  # (rank 0 only) still to the all-reduce, with the others
                error = error or e
        stage, stages = self.pipe.groups.stage, self.pipe.groups.grid.stages
        # failed; wrote (a load: done, or torn by it); torn after it (a load that repaired some stages only)
        flags = torch.zeros(3, stages, device=self.topology.device)
        flags[0, stage] = 1.0 if error is not None else 0.0
        flags[1, stage] = 1.0 if error is None or self._torn_load is not torn_before else 0.0
        flags[2, stage] = 1.0 if self._torn_load is not None else 0.0
        self.pipe.world.all_reduce(flags, op="max", label="pipe.checkpoint_stages")
        failed = [s for s, flag in enumerate(flags[0].tolist()) if flag > 0]
        if load is not None and failed and flags[1].max() > 0:
            why = f"load_checkpoint failed part way on pipeline stage(s) {failed}"
            mark_torn(self, why, load)
            cause = error if error is not None else "their ranks raised the cause"
            raise CheckpointError(
                f"{why} ({cause}) while other stages loaded; the engine refuses to train or save until {cure(self)} "
                "succeeds"
            ) from error
        if error is not None:
            raise error
        if failed:
            raise CheckpointError(
                f"pipeline stage(s) {failed} failed in this checkpoint call (their ranks raised the cause); this "
                f"stage ({stage}) finished its part"
            )
        torn = [s for s, flag in enumerate(flags[2].tolist()) if flag > 0]
        if load is not None and torn and self._torn_load is None:  # the stages refuse together, or none does
            mark_torn(self, f"pipeline stage(s) {torn} are still torn after a load_checkpoint that restored less there")
        return result  # type: ignore[return-value]

    @contextlib.contextmanager
    def _stage_topology(self) -> Iterator[None]:
        """The checkpoint code sees this stage's data-parallel group as the world, and its store keys apart from
        the other stages' (which save at the same time)."""
        world = self.topology
        groups = self.pipe.groups
        self.topology = dataclasses.replace(
            world,
            rank=groups.replica,
            world_size=groups.grid.dp,
            group=groups.dp_group,
            store_prefix=f"zeroshard/pipe_stage_{groups.stage:02d}",
        )
        try:
            yield
        finally:
            self.topology = world
