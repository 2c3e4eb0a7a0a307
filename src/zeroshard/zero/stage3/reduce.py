"""Stage-3 gradients: staged per unit by parameter hooks, reduce-scattered when the unit's backward is done.

Each unit's gradients are added into one staging buffer in the unit's flat layout; when the unit's backward
has run they are reduce-scattered into this rank's gradient shard (accumulating over micro-steps), and the
finished shard goes to the gradient tier (a host copy on the boundary, after which the shard's memory is
released, or a write to NVMe). At most
MAX_INFLIGHT_REDUCES reductions are in flight ([Note: bounded in-flight reductions]).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from zeroshard.comm.collectives import Handle
from zeroshard.comm.divergence import DivergenceWatch
from zeroshard.offload.gradients import GradientTier, GradShard
from zeroshard.zero.pool import BufferPool, InflightQueue
from zeroshard.zero.stage3.speculate import SpeculativeSteps
from zeroshard.zero.stage3.unit import ShardedUnit
from zeroshard.zero.strategy import AccumulationState

MAX_INFLIGHT_REDUCES = 2


class UnitReducer:
    def __init__(
        self,
        pool: BufferPool,
        comm_dtype: torch.dtype,
        prescale: float,
        overlap: bool,
        gradients: GradientTier,
        accumulation: AccumulationState,
        watch: DivergenceWatch,
    ):
        self.pool = pool  # each unit reduce-scatters over its own group (`unit.comm`)
        self.comm_dtype = comm_dtype
        self.prescale = prescale
        self.overlap = overlap
        self.gradients = gradients
        self.accumulation = accumulation
        self._inflight: InflightQueue[ShardedUnit] = InflightQueue(MAX_INFLIGHT_REDUCES, watch.wait)
        # the window's first micro-step: the shards hold zeros or no memory yet ([Note: gradient shards exist from
        # reduction to step]): reduce straight into them
        self.first_window_step = True
        self.scatter: Callable[..., Handle] | None = None  # ZeRO++ qgZ's reduce-scatter (zero/zeropp/grads.py)
        # super_offload's worker, told of each shard final on the boundary ([Note: speculative host steps])
        self.speculation: SpeculativeSteps | None = None
        self._finishing = False  # in `finish`: backward has returned

    def stage(self, unit: ShardedUnit, index: int, param: nn.Parameter) -> None:
        """A parameter's gradient was accumulated: move it into the unit's staging buffer."""
        grad = param.grad
        param.grad = None
        if grad is not None:  # a sparse one dense: [Note: sparse gradients] in zero/flat/local.py
            unit.stage_grad(index, grad.to_dense() if grad.is_sparse else grad, self.pool, self.comm_dtype)

    def reduce(self, unit: ShardedUnit) -> None:
        if unit.reduce_launched or not unit.trainable:
            return
        handle, finish = unit.launch_reduce(
            self.pool, self.comm_dtype, self.prescale, self.first_window_step, self.overlap, self.scatter
        )
        self._delivered(self._inflight.push(handle, finish, unit, f"reduce-scatter of unit {unit.name!r}"))

    def finish(self, units: list[ShardedUnit]) -> None:
        """Reduce what backward did not (unused units, units whose inputs need no grad) and wait for all."""
        self._finishing = True
        try:
            for unit in units:
                self.reduce(unit)
            self._delivered(self._inflight.drain())
        finally:
            self._finishing = False
        self.gradients.finish_backward()
        self.first_window_step = False

    def _delivered(self, units: list[ShardedUnit]) -> None:
        """`units`' gradient shards are final for this micro-step: hand them to the gradient tier."""
        boundary = self.accumulation.is_boundary()
        for unit in units:
            slot = GradShard(unit.grad_key, unit.grad_shard, bool(unit.trainable))
            unit.grad_copy_ready = self.gradients.received(slot, unit.grad_copy, boundary)
            if unit.grad_copy_ready and unit.grad_transient:
                # [Note: a gradient shard leaves once its host copy holds it]: what the step needs of it, then it goes
                self.gradients.let_go(slot)
                unit.hand_grad_to_copy(self.gradients.copy_stream)
            if boundary and self.speculation is not None:
                self.speculation.delivered(unit, not self._finishing)
