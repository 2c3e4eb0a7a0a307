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
Frozen experts (a LoRA elsewhere in the model) are no part's, but their keys name other ranks' experts too: they
are written the same way, whole, by the first rank of each expert-data-parallel group.
AutoEP's fused experts ([Note: AutoEP] in moe/auto.py) keep one key per `[E, ...]` tensor, the Hugging Face one:
expert-parallel rank j holds its rows `j*L .. j*L+L-1`, which are elements `j*n .. j*n+n-1` of the whole tensor
(`n` the local tensor's size), so its pieces are written at that offset into the whole tensor's shape, and a
checkpoint loads into another `autoep_size` (1 included) or a plain Hugging Face model (tests/distributed/
test_autoep.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from zeroshard.checkpoint.format import TensorInfo
from zeroshard.checkpoint.safetensors_io import dtype_name
from zeroshard.checkpoint.state import ModelPiece, OptimPiece, StatePart
from zeroshard.comm.collectives import Collectives
from zeroshard.zero.flat.checkpoint import FlatState, one_resident_part

if TYPE_CHECKING:
    from zeroshard.moe.zero import ExpertSplitStrategy


@dataclass(frozen=True)
class ExpertTensor:
    """One of this rank's expert tensors: its state_dict key, the keys of it and its peers on every
    expert-parallel rank (in rank order, its own among them; fused: the one key whose rows the ranks hold in turn),
    the parameter and the expert-parallel group."""

    local_key: str
    keys: list[str]
    param: nn.Parameter
    ep: Collectives
    fused: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        """The local tensor's shape (at stage 3 its `ds_shape`: the data is a placeholder while released)."""
        return tuple(getattr(self.param, "ds_shape", self.param.shape))

    @property
    def full_shape(self) -> tuple[int, ...]:
        shape = self.shape
        return (shape[0] * self.ep.world_size, *shape[1:]) if self.fused else shape

    @property
    def offset(self) -> int:
        """Where this rank's elements start in the checkpoint's tensor."""
        return self.ep.rank * math.prod(self.shape) if self.fused else 0


def expert_keys(module: nn.Module) -> list[ExpertTensor]:
    """This rank's expert tensors ([Note: expert checkpoints])."""
    from zeroshard.moe.layer import MoE
    from zeroshard.moe.parallel_experts import ParallelExperts

    rows = []
    for prefix, layer in module.named_modules():
        base = f"{prefix}." if prefix else ""
        if isinstance(layer, ParallelExperts):
            for name, param in layer.named_parameters(recurse=False):
                rows.append(ExpertTensor(base + name, [base + name], param, layer.groups.ep, fused=True))
            continue
        if not isinstance(layer, MoE):
            continue
        local = layer.num_local_experts
        base += "deepspeed_moe.experts.deepspeed_experts"
        for index, expert in enumerate(layer.experts.deepspeed_experts):
            for name, param in expert.named_parameters():
                everyone = [f"{base}.{j * local + index}.{name}" for j in range(layer.ep_size)]
                rows.append(ExpertTensor(f"{base}.{index}.{name}", everyone, param, layer.groups.ep))
    return rows


def global_expert_names(module: nn.Module) -> tuple[dict[str, str], dict[str, TensorInfo]]:
    """[Note: expert checkpoints] local name -> global name of this rank's experts; infos of the others'."""
    renamed: dict[str, str] = {}
    peers: dict[str, TensorInfo] = {}
    for row in expert_keys(module):
        mine = row.keys[0] if row.fused else row.keys[row.ep.rank]
        renamed[row.local_key] = mine
        info = TensorInfo(row.full_shape, dtype_name(row.param.dtype), "param", True, row.param.requires_grad)
        peers.update({key: info for key in row.keys if key != mine})
    return renamed, peers


class ExpertSplitState:
    """`ShardedState` of `ExpertSplitStrategy`: the two parts' `FlatState`s, experts under global names."""

    regather_after_load = False
    loads_whole = True

    def __init__(self, strategy: ExpertSplitStrategy):
        dense, experts = strategy.parts
        self.dense, self.experts = FlatState(dense), FlatState(experts)
        self.renamed, self.peers = global_expert_names(strategy.module)
        fused = [row for row in expert_keys(strategy.module) if row.fused]
        self.offsets = {row.local_key: row.offset for row in fused}  # local name -> start in the whole tensor
        self.shapes = {id(row.param): row.full_shape for row in fused}
        self.group_offset = len(dense.buffers)  # the expert part's groups follow the dense ones in the optimizer
        self.strategy = strategy
        # frozen experts (LoRA elsewhere): no strategy holds them, yet their keys name other tensors on other ranks;
        # the first rank of each expert-data-parallel group writes its rows whole, every rank reads its own
        held = self.experts.sharded_params()  # (frozen after initialize, or left out of the optimizer: no part's)
        self.frozen = [row for row in expert_keys(strategy.module) if id(row.param) not in held]
        self.writes_frozen = experts.comm.rank == 0
        # what exclude_frozen_parameters may leave out although sharded here (checkpoint/save.py catalog_module)
        self.frozen_ids = frozenset(id(row.param) for row in self.frozen if not row.param.requires_grad)

    def _frozen(self, writing: bool) -> list[ModelPiece]:
        if writing and not (self.writes_frozen and self.writes_optim):
            return []
        rows = [(row, row.param.data.reshape(-1)) for row in self.frozen]
        return [ModelPiece(self.renamed[r.local_key], r.offset, r.offset + v.numel(), v) for r, v in rows]

    def _model(self, pieces: list[ModelPiece]) -> list[ModelPiece]:
        moved = [(p, self.offsets.get(p.name, 0)) for p in pieces]
        return [ModelPiece(self.renamed[p.name], p.begin + at, p.end + at, p.values) for p, at in moved]

    def full_shapes(self) -> dict[int, tuple[int, ...]]:
        return dict(self.shapes)

    def peer_tensors(self) -> dict[str, TensorInfo]:
        return self.peers

    @property
    def writes_optim(self) -> bool:
        # stages 1-2: every rank holds a shard of both parts; stage 0: each part's group's first rank writes it (the
        # world's rank 0 the dense part, each expert-data-parallel group's first rank its experts)
        return self.dense.writes_optim or self.experts.writes_optim

    def sharded_params(self) -> dict[int, str]:
        experts = {ident: self.renamed[name] for ident, name in self.experts.sharded_params().items()}
        frozen = {id(row.param): self.renamed[row.local_key] for row in self.frozen}
        return {**self.dense.sharded_params(), **experts, **frozen}

    def model_pieces_to_save(self) -> list[ModelPiece]:
        trained = self._model(self.experts.model_pieces_to_save())
        return self.dense.model_pieces_to_save() + trained + self._frozen(writing=True)

    def model_bytes_to_save(self, skip: frozenset[int] = frozenset()) -> int:
        left_out = {self.renamed[row.local_key] for row in self.frozen if id(row.param) in skip}
        pieces = [p for p in self._frozen(writing=True) if p.name not in left_out]
        frozen = sum(p.values.numel() * p.values.element_size() for p in pieces)
        return self.dense.model_bytes_to_save(skip) + self.experts.model_bytes_to_save(skip) + frozen

    def model_targets_to_load(self) -> list[ModelPiece]:
        trained = self._model(self.experts.model_targets_to_load())
        return self.dense.model_targets_to_load() + trained + self._frozen(writing=False)

    def optim_pieces(self) -> list[OptimPiece]:
        experts = [
            OptimPiece(self.renamed[p.name], p.begin + at, p.end + at, p.param, p.offset, p.group + self.group_offset)
            for p, at in ((p, self.offsets.get(p.name, 0)) for p in self.experts.optim_pieces())
        ]
        return self.dense.optim_pieces() + experts

    def optim_pieces_to_save(self) -> list[OptimPiece]:
        """Each part's pieces where this rank writes that part (every rank at stages 1-2; at stage 0 the first rank
        of the part's group: rank 0 the dense part, each expert-data-parallel group's first rank its experts)."""
        pieces, split = self.optim_pieces(), len(self.dense.optim_pieces())
        return (pieces[:split] if self.dense.writes_optim else []) + (
            pieces[split:] if self.experts.writes_optim else []
        )

    def refresh_master_from_params(self) -> None:
        self.dense.refresh_master_from_params()
        self.experts.refresh_master_from_params()

    def publish_params(self) -> None:
        self.strategy.publish_params()

    def parts(self) -> list[StatePart]:
        return [
            dataclasses.replace(part, optim_pieces_to_save=self.optim_pieces_to_save)
            for part in one_resident_part(self, self.strategy)
        ]
