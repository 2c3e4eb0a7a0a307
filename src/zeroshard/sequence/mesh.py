"""The groups of Ulysses sequence parallelism, from the config or from a sequence-parallel mpu.

[Note: sequence parallelism]
DeepSpeed-Ulysses splits every sample's sequence over the `sequence_parallel_size` (P) consecutive ranks of a
sequence-parallel group; `DistributedAttention` (sequence/layer.py) exchanges q, k, v with one all-to-all each so
that every rank attends over the whole sequence for 1/P of the heads, and exchanges the result back. The other
layers see only their rank's part of the sequence. The world is a (data-parallel, sequence-parallel) mesh, the
sequence dimension inner: ranks k*P .. k*P+P-1 hold one sample, ranks j, j+P, j+2P, ... are the replicas.

What the engine does differently, as DeepSpeed 0.19.8 does with a sequence-parallel mpu
(runtime/sequence_parallel/parallel_state_sp.py, the one Hugging Face's Ulysses integration passes):
- ZeRO shards and reduces over every rank (DeepSpeed's "sequence data parallel" group): the P ranks of a sample
  hold the same parameters, so their gradients, each the gradient of their part of the sequence, are summed;
- the sum over ranks is divided by world / P, the number of replicas, not by world ([Note: pre- and
  post-scaling]): gradients are summed over the sequence-parallel ranks and averaged over the replicas. The
  single-process gradient of a mean loss over a replica's whole sequences is therefore what a rank's loss gives
  when it sums its part and divides by the token count of the whole sequence (the parity tests' loss);
- the batch arithmetic counts replicas: train_batch_size = micro batch x gradient accumulation x world / P;
  the P ranks of a sample read the same batches from the engine's dataloader (each takes its part of the
  sequence);
- gradients are communicated in `seq_parallel_communication_data_type` (fp32 by default) instead of
  `communication_data_type`.
DeepSpeed builds the same mesh from the config keys `sequence_parallel_size` and `data_parallel_size`, but then
shards and reduces over the data-parallel dimension only, so a sample's ranks never combine their gradients and
drift apart (measured with DeepSpeed 0.19.8 on gloo: each rank stepped with P times its own gradient). zeroshard
gives the config keys the mpu's semantics above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from zeroshard.comm.collectives import Collectives, scope_of
from zeroshard.comm.topology import NodeLayout, new_group
from zeroshard.errors import ConfigError


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel group (consecutive ranks) and its replicas' group (strided), counted in the
    world's collectives."""

    sp: Collectives
    dp: Collectives

    @property
    def size(self) -> int:
        return self.sp.world_size


def is_sequence_mpu(mpu: Any) -> bool:
    """Whether `mpu` is a sequence-parallel unit only: DeepSpeed's parallel_state_sp (which aliases the
    model-parallel methods to the sequence-parallel group, so it must not be taken for tensor parallelism), told
    apart as DeepSpeed does by `initialize_sequence_parallel`, or an object with sequence-parallel methods and no
    data-parallel ones. Megatron-DeepSpeed's parallel_state has both kinds: a tensor-parallel mpu."""
    if mpu is None or not callable(getattr(mpu, "get_sequence_parallel_group", None)):
        return False
    return hasattr(mpu, "initialize_sequence_parallel") or not callable(getattr(mpu, "get_data_parallel_group", None))


def sequence_degree(cfg: Any, mpu: Any, world_size: int) -> int:
    """P, checked against the world and the config's `data_parallel_size`; 1 without sequence parallelism."""
    configured = cfg.sequence_parallel_size
    size = int(mpu.get_sequence_parallel_world_size()) if is_sequence_mpu(mpu) else int(configured or 1)
    mpu_sp = getattr(mpu, "get_sequence_parallel_world_size", None)
    if mpu is not None and not is_sequence_mpu(mpu) and callable(mpu_sp) and int(mpu_sp()) > 1:
        raise ConfigError(
            f"initialize(mpu=...) with tensor (model) parallelism and a sequence-parallel group of {int(mpu_sp())} "
            "ranks: sequence parallelism with tensor parallelism is not implemented; use one of them"
        )
    if configured is not None and int(configured) != size:
        raise ConfigError(
            f"sequence_parallel_size={configured} but initialize(mpu=...)'s sequence-parallel group has {size} "
            "ranks; set one of them (or the same value)"
        )
    if size > 1 and world_size % size:
        raise ConfigError(
            f"sequence_parallel_size={size} does not divide the world size {world_size}; use a divisor of it"
        )
    replicas = world_size // size
    # as DeepSpeed, data_parallel_size is read only beside sequence_parallel_size (it shapes their mesh)
    if configured is not None and cfg.data_parallel_size is not None and int(cfg.data_parallel_size) != replicas:
        raise ConfigError(
            f"data_parallel_size={cfg.data_parallel_size} x sequence_parallel_size={size} is not the world size "
            f"{world_size}; set data_parallel_size to {replicas} or leave it out"
        )
    return size


def refuse_with_sequence_parallel(cfg: Any, model: Any, mpu: Any, size: int) -> None:
    """One line for each combination with sequence parallelism that is not implemented, before any work."""
    from zeroshard.moe.zero import moe_layers
    from zeroshard.pipe.module import PipelineModule
    from zeroshard.tp.build import autotp_size

    if isinstance(model, PipelineModule):
        raise ConfigError(f"sequence_parallel_size={size} with a PipelineModule: not implemented; use one of them")
    if mpu is not None or autotp_size(cfg.tensor_parallel) > 1:
        raise ConfigError(
            f"sequence_parallel_size={size} with tensor parallelism (a model-parallel mpu or "
            "tensor_parallel.autotp_size): not implemented; use one of them"
        )
    if any(layer.ep_size > 1 for layer in moe_layers(model)):
        raise ConfigError(
            f"sequence_parallel_size={size} with MoE layers of ep_size > 1: not implemented; use ep_size 1"
        )


def build_sequence_parallel(size: int, mpu: Any, world: Collectives) -> SequenceParallel | None:
    """[Note: sequence parallelism] the groups for P = `size` (None when 1). Collective over the world: every
    rank makes every group, in one order."""
    if size <= 1:
        return None
    nodes = NodeLayout.from_env(world.world_size)
    blocks = [list(range(k * size, (k + 1) * size)) for k in range(world.world_size // size)]
    replicas = [list(range(j, world.world_size, size)) for j in range(size)]
    mine = blocks[world.rank // size]
    if is_sequence_mpu(mpu):
        sp_group = mpu.get_sequence_parallel_group()
        if dist.get_process_group_ranks(sp_group) != mine:
            raise ConfigError(
                f"initialize(mpu=...): rank {world.rank}'s sequence-parallel group has ranks "
                f"{dist.get_process_group_ranks(sp_group)}; zeroshard needs consecutive blocks of "
                f"{size} ranks ({mine} here), as DeepSpeed's parallel_state_sp.initialize_sequence_parallel makes"
            )
        across = getattr(mpu, "get_sequence_data_parallel_world_size", None)
        if callable(across) and int(across()) != world.world_size:
            raise ConfigError(
                f"initialize(mpu=...): the mpu's sequence-data-parallel group has {int(across())} ranks, not the "
                f"world's {world.world_size}; ZeRO shards over the whole world with sequence parallelism"
            )
    else:
        whole = len(blocks) == 1  # one sample's ranks are the world: its group serves
        made = {tuple(b): world.group if whole else new_group(b) for b in blocks}
        sp_group = made[tuple(mine)]
    # a group of one rank too: the data-parallel accessors hand out the group itself, not the world
    dp_made = {tuple(r): new_group(r) for r in replicas}
    mine_dp = replicas[world.rank % size]
    sp = world.subgroup(sp_group, size, world.rank % size, scope_of(nodes, mine))
    dp = world.subgroup(dp_made.get(tuple(mine_dp)), len(mine_dp), world.rank // size, scope_of(nodes, mine_dp))
    return SequenceParallel(sp, dp)


def with_mesh_param(parsed: Any, mesh_param: tuple[int, int] | None) -> Any:
    """DeepSpeed's `initialize(mesh_param=(dp, sp))`: the config's `data_parallel_size` and
    `sequence_parallel_size`, which may also be given there, with the same values."""
    if mesh_param is None:
        return parsed
    if len(mesh_param) != 2 or not all(isinstance(v, int) and v > 0 for v in mesh_param):
        raise ConfigError(
            f"initialize(mesh_param={mesh_param!r}): give (data-parallel size, sequence-parallel size), two positive "
            "integers"
        )
    raw = dict(parsed.raw or {})
    for key, value in zip(("data_parallel_size", "sequence_parallel_size"), mesh_param, strict=True):
        if raw.get(key, value) != value:
            raise ConfigError(
                f"initialize(mesh_param={tuple(mesh_param)}) sets {key}={value} but the config says {raw[key]}; "
                "give it once, or the same value"
            )
        raw[key] = value
    from zeroshard.config import parse_config

    return parse_config(raw)
