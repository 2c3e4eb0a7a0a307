"""Checkpoints of a model with MoE layers (`ExpertSplitStrategy`) in the ordinary checkpoint format.

[Note: expert checkpoints]
Every expert-parallel rank's module calls its local experts `...deepspeed_experts.0`, `...1`, ...: the same
state_dict keys name different experts on different ranks. In the checkpoint each expert is named by its global
index (DeepSpeed's files do the same): local expert l of expert-parallel rank j is
`...deepspeed_experts.{j * L + l}`. The expert part's pieces (sharded over the expert-data-parallel group, as its
optimizer state is) are written under those names, every rank lists the other ranks' experts as
`peer_tensors` (known to the checkpoint, absent from its module) and loads only its own. Since the names do not
depend on the mesh, a checkpoint also loads into another world size, stage (1-2) or `ep_size` (ep_size 1 calls
every expert by its global index already), optimizer state included (tests/distributed/test_moe.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from zeroshard.checkpoint.format import TensorInfo
from zeroshard.checkpoint.safetensors_io import dtype_name
from zeroshard.checkpoint.state import ModelPiece, OptimPiece, StatePart
from zeroshard.comm.collectives import Collectives
from zeroshard.zero.flat.checkpoint import FlatState, one_resident_part

if TYPE_CHECKING:
    from zeroshard.moe.zero import ExpertSplitStrategy


def expert_keys(module: nn.Module) -> list[tuple[str, list[str], nn.Parameter, Collectives]]:
    """Per local expert parameter: its state_dict key, the global keys of it and its peers on every
    expert-parallel rank (in rank order, its own among them), and the expert-parallel group."""
    from zeroshard.moe.layer import MoE

    rows = []
    for prefix, layer in module.named_modules():
        if not isinstance(layer, MoE):
            continue
        local = layer.num_local_experts
        base = f"{prefix}." if prefix else ""
        base += "deepspeed_moe.experts.deepspeed_experts"
        for index, expert in enumerate(layer.experts.deepspeed_experts):
            for name, param in expert.named_parameters():
                everyone = [f"{base}.{j * local + index}.{name}" for j in range(layer.ep_size)]
                rows.append((f"{base}.{index}.{name}", everyone, param, layer.groups.ep))
    return rows


def global_expert_names(strategy: ExpertSplitStrategy) -> tuple[dict[str, str], dict[str, TensorInfo]]:
    """[Note: expert checkpoints] local name -> global name of this rank's experts; infos of the others'."""
    renamed: dict[str, str] = {}
    peers: dict[str, TensorInfo] = {}
    for local_key, everyone, param, ep in expert_keys(strategy.module):
        mine = everyone[ep.rank]
        renamed[local_key] = mine
        info = TensorInfo(tuple(param.shape), dtype_name(param.dtype), "param", True, param.requires_grad)
        peers.update({key: info for key in everyone if key != mine})
    return renamed, peers


class ExpertSplitState:
    """`ShardedState` of `ExpertSplitStrategy`: the two parts' `FlatState`s, experts under global names."""

    regather_after_load = False
    loads_whole = True

    def __init__(self, strategy: ExpertSplitStrategy):
        dense, experts = strategy.parts
        self.dense, self.experts = FlatState(dense), FlatState(experts)
        self.renamed, self.peers = global_expert_names(strategy)
        self.group_offset = len(dense.buffers)  # the expert part's groups follow the dense ones in the optimizer
        self.strategy = strategy

    def _model(self, pieces: list[ModelPiece]) -> list[ModelPiece]:
        return [ModelPiece(self.renamed[p.name], p.begin, p.end, p.values) for p in pieces]

    def full_shapes(self) -> dict[int, tuple[int, ...]]:
        return {}

    def peer_tensors(self) -> dict[str, TensorInfo]:
        return self.peers

    @property
    def writes_optim(self) -> bool:
        assert self.dense.writes_optim == self.experts.writes_optim, "stages 1-2 shard both parts"
        return self.dense.writes_optim

    def sharded_params(self) -> dict[int, str]:
        experts = {ident: self.renamed[name] for ident, name in self.experts.sharded_params().items()}
        return {**self.dense.sharded_params(), **experts}

    def model_pieces_to_save(self) -> list[ModelPiece]:
        return self.dense.model_pieces_to_save() + self._model(self.experts.model_pieces_to_save())

    def model_bytes_to_save(self) -> int:
        return self.dense.model_bytes_to_save() + self.experts.model_bytes_to_save()

    def model_targets_to_load(self) -> list[ModelPiece]:
        return self.dense.model_targets_to_load() + self._model(self.experts.model_targets_to_load())

    def optim_pieces(self) -> list[OptimPiece]:
        experts = [
            OptimPiece(self.renamed[p.name], p.begin, p.end, p.param, p.offset, p.group + self.group_offset)
            for p in self.experts.optim_pieces()
        ]
        return self.dense.optim_pieces() + experts

    def refresh_master_from_params(self) -> None:
        self.dense.refresh_master_from_params()
        self.experts.refresh_master_from_params()

    def publish_params(self) -> None:
        self.strategy.publish_params()

    def parts(self) -> list[StatePart]:
        return one_resident_part(self, self.strategy)
