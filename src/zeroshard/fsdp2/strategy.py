"""The fsdp2 backend: zeroshard's strategy contract implemented over PyTorch FSDP2's `fully_shard`.

FSDP2 owns the parameters' sharded/unsharded life and the gradients' reduce-scatter ([Note: fsdp2 units]);
this strategy owns what the engine promises on top, the same code as the zero stages: the step skeleton of
`Strategy.step` (one inf/nan and norm decision for all ranks, clipping, the loss scale), the optimizer over
this rank's rows of every parameter ([Note: fsdp2 shards are element ranges]), full values, gathering and the
checkpoint format ([Note: strategy adapters]). See [Note: fsdp2 mapping] for the config.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from zeroshard.checkpoint.state import ShardedState
from zeroshard.comm.collectives import Collectives
from zeroshard.fsdp2.load import fill_shards, masters_in_fp32, streams_shards
from zeroshard.fsdp2.params import ShardedParam, gather_full, own_rows, sharded_param
from zeroshard.fsdp2.plan import Fsdp2Plan
from zeroshard.fsdp2.units import Fsdp2Unit, held_gathered, shard_units, unsharded_views
from zeroshard.loading.weights import StreamedWeights
from zeroshard.memory import StrategyMemory
from zeroshard.offload.gradients import GradShard, StepTimeCopies
from zeroshard.offload.tier import Tier
from zeroshard.optim.lamb import Lamb, refuse_unplanned
from zeroshard.precision.loss_scaler import has_inf_or_nan
from zeroshard.zero.flat.local import local_of
from zeroshard.zero.norms import ShardNormPlan
from zeroshard.zero.owners import OWNERS
from zeroshard.zero.stage3.plan import NO_LEAVES, LeafModules, UnitPolicy
from zeroshard.zero.strategy import (
    AccumulationState,
    ParamGroupSpec,
    Strategy,
    StrategyPolicy,
    held,
    nbytes,
    optimizer_state_tensors,
)


@dataclass(frozen=True)
class Fsdp2Policy(StrategyPolicy):
    """The fsdp2 backend: the FSDP2 policies ([Note: fsdp2 mapping]) and the unit policy ([Note: units])."""

    plan: Fsdp2Plan
    unit_policy: UnitPolicy | None = None
    leaves: LeafModules = NO_LEAVES  # zero_optimization.leaf_module ([Note: leaf modules])
    weights: StreamedWeights | None = None  # the checkpoint of a model `zero_init` built from one
    init_source: int | None = None  # the rank whose initialisation every rank takes: [Note: one start on every rank]
    mesh: DeviceMesh | None = None  # a dp x tp mesh's dp dimension ([Note: tensor parallelism on fsdp2])


class _NormsOnDevice(StepTimeCopies):
    """Gradients stay where FSDP2 reduced them (host memory under CPUOffloadPolicy); their norms go to the compute
    device, where the step's all-reduce runs (NCCL cannot reduce host tensors)."""

    def __init__(self, device: torch.device, check_overflow: bool):
        super().__init__(Tier(device), None, check_overflow)
        self.device = device

    def norms(
        self, slots: Sequence[GradShard], prepare: Any, with_norms: bool = True
    ) -> tuple[list[torch.Tensor], bool]:
        grads = [s.shard for s in slots if s.shard.numel() > 0]
        norms = list(torch._foreach_norm(grads)) if grads and with_norms else []  # one multi-tensor kernel
        overflow = self.check_overflow and has_inf_or_nan(grads)
        return [n.to(self.device, torch.float32) for n in norms], overflow


class Fsdp2Strategy(Strategy):
    """One model sharded by FSDP2 on one rank, behind the strategy contract ([Note: strategy contract])."""

    def __init__(
        self,
        module: nn.Module,
        groups: Sequence[ParamGroupSpec],
        policy: Fsdp2Policy,
        comm: Collectives,
        device: torch.device,
        accumulation: AccumulationState,
    ):
        super().__init__(module, groups, policy, comm, device, accumulation)
        self.policy = policy
        self.gradients_tier = _NormsOnDevice(device, policy.step.check_overflow)
        group_of = {name: g for g, spec in enumerate(groups) for name, _ in spec.params}
        # FSDP2 sums; the step turns sums into means exactly as for the zero stages ([Note: pre- and post-scaling])
        divide = 1.0 / policy.step.prescale(comm.world_size)
        replayed = [p for p in module.parameters() if p.is_meta and not (policy.weights and policy.weights.covers(p))]
        streamed = streams_shards(module, policy.weights, device)  # [Note: fsdp2 streaming load]
        if replayed:  # made whole on every rank: [Note: one start on every rank] (buffers too, as at stage 3)
            src = policy.init_source if policy.init_source is not None else comm.global_rank(0)
            agreed = [local_of(p).data for p in replayed] if policy.init_source is not None else []
            comm.broadcast_coalesced(agreed + list(module.buffers()), src=src, label="zero_init start")
        masters_in_fp32(module, policy.compute_dtype)
        units = (policy.unit_policy, policy.leaves)
        self.units: list[Fsdp2Unit] = shard_units(module, policy.plan, units, comm, device, divide, policy.mesh)
        self._holds: Counter[str] = Counter()  # blocks holding each unit gathered (gathered(), GatheredParameters)
        if streamed is not None:
            assert policy.weights is not None
            home = policy.master_tier.device  # the host under CPUOffloadPolicy
            fill_shards(module, streamed, policy.weights, home, comm.rank, comm.world_size)
        self.params: list[ShardedParam] = [
            sharded_param(name, p, group_of.get(name, -1), comm.rank, comm.world_size)
            for name, p in module.named_parameters()
        ]
        self._by_id = {id(sp.param): sp for sp in self.params}
        self._placeholders: list[torch.Tensor] = []
        OWNERS.register(self, self.tracked_params())

    # -- construction ------------------------------------------------------------------------------
    def master_param_groups(self) -> list[dict[str, Any]]:
        groups = []
        self._placeholders.clear()
        for g, options in enumerate(self.group_options):
            params = [sp.master for sp in self.params if sp.group == g]
            if not params:  # an empty group keeps its place (and its options) in the optimizer
                params = [torch.zeros(0, device=self.policy.master_tier.device)]
                self._placeholders.append(params[0])
            groups.append({**options, "params": params})
        return groups

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        if isinstance(optimizer, Lamb):  # [Note: LAMB on flat shards]: each master is one parameter's rows
            if self.policy.mesh is not None:  # a tensor-parallel slice's norm needs its tp peers too
                refuse_unplanned(optimizer, "tensor parallelism on the fsdp2 backend")
            groups = [[sp.master for sp in self.params if sp.group == g] for g in range(len(self.group_options))]
            optimizer.plan = ShardNormPlan(groups, self.comm, self.device)

    # -- backward: FSDP2's hooks reduce-scatter every unit and wait at the end of backward ---------------------
    def begin_backward(self) -> None:
        return None

    def finish_backward(self) -> None:
        return None

    # -- the step (skeleton in Strategy.step) --------------------------------------------------------
    @property
    def _sharded(self) -> bool:
        return self.comm.world_size > 1

    def _trainable(self) -> list[ShardedParam]:
        return [sp for sp in self.params if sp.trainable]

    def _grad_slots(self) -> list[GradShard]:
        slots = []
        for sp in self._trainable():
            grad = sp.local_grad()
            if grad is not None:
                slots.append(GradShard(sp.name, grad, True))
        return slots

    def _step_chunks(self, scale: float) -> None:
        assert self.optimizer is not None
        grads = []
        for sp in self._trainable():
            grad = sp.local_grad()  # FSDP2's: fp32 (the parameter's dtype) where the master lives
            # a parameter without a gradient this step gets zeros, as the zero stages' flat shards do
            sp.master.grad = torch.zeros_like(sp.master) if grad is None else grad
            if grad is not None and grad.numel() > 0:
                grads.append(grad)
        if grads and scale != 1.0:
            torch._foreach_mul_(grads, scale)
        for placeholder in self._placeholders:
            placeholder.grad = torch.zeros_like(placeholder)
        self.optimizer.step()
        for sp in self._trainable():
            sp.master.grad = None
        for placeholder in self._placeholders:
            placeholder.grad = None

    def _publish(self) -> None:
        """The masters are FSDP2's sharded parameters: a unit still gathered holds old values and is released."""
        for unit in self.units:
            unit.module.reshard()

    def zero_grad(self) -> None:
        for sp in self.params:
            sp.param.grad = None

    # -- one parameter's full values -----------------------------------------------------------------
    def _record(self, param: torch.Tensor) -> ShardedParam:
        sp = self._by_id.get(id(param))
        if sp is None:
            raise KeyError("the tensor is not a parameter of this engine's module (as sharded by fully_shard)")
        return sp

    def _agree_full(self, call: str, sp: ShardedParam, what: str) -> None:
        """What is read matters as much as where: a gradient and a master of one parameter gather the same sizes."""
        self.agreement.agree(call, f"all-gather of the full {what} of {sp.name}")

    def full_fp32_param(self, param: torch.Tensor) -> torch.Tensor | None:
        sp = self._record(param)
        if not sp.trainable:
            return None  # no master, as DeepSpeed
        self._agree_full("safe_get_full_fp32_param", sp, "fp32 master")
        return gather_full(sp, sp.master, self.comm, self.device)

    def full_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        sp = self._record(param)
        self._agree_full("safe_get_full_grad", sp, "gradient (after a check for one on any rank)")
        grad = sp.local_grad() if sp.trainable else None
        if not self.comm.any_true(grad is not None, self.device):
            return None
        local = grad if grad is not None else torch.zeros_like(sp.master)
        return gather_full(sp, local, self.comm, self.device) * self._grad_scale()

    def full_optimizer_state(self, param: torch.Tensor, key: str) -> torch.Tensor | None:
        sp = self._record(param)
        if not sp.trainable:
            return None
        # `_has_state` is itself a collective: agreed with the gather that follows it
        self._agree_full("safe_get_full_optimizer_state", sp, f"optimizer state {key!r} (after a check for it)")
        if not self._has_state(key):
            return None
        state = self.optimizer.state.get(sp.master, {}) if self.optimizer is not None else {}
        local = state.get(key, torch.zeros_like(sp.master))
        return gather_full(sp, local, self.comm, self.device)

    def set_full_fp32_param(self, param: torch.Tensor, value: torch.Tensor) -> None:
        sp = self._record(param)
        with torch.no_grad():
            sp.master.copy_(own_rows(sp, value))
        self._publish()

    def set_full_optimizer_state(self, param: torch.Tensor, value: torch.Tensor, key: str) -> None:
        sp = self._record(param)
        with torch.no_grad():
            self._state_of(sp.master, key).copy_(own_rows(sp, value))

    def set_full_grad(self, param: torch.Tensor, value: torch.Tensor) -> None:
        sp = self._record(param)
        if not sp.trainable:
            return  # nothing to set, as DeepSpeed
        if sp.param.grad is None:  # no rank's backward reached it: FSDP2's sharded form, zero
            sp.param.grad = torch.zeros_like(sp.param)
        local = sp.local_grad()
        assert local is not None
        with torch.no_grad():
            local.copy_(own_rows(sp, self._unscaled(value, sp.full_numel, local.dtype)))

    # -- gathering (GatheredParameters) ------------------------------------------------------------------
    def gather_begin(
        self, params: Sequence[torch.Tensor], call: str = "", modifier_rank: int | None = None
    ) -> list[Any]:
        names = {self._record(p).name for p in params if id(p) in self._by_id}
        units = [u for u in self.units if any(n in names for n in u.param_names)]
        needed = [u.name for u in units if not _unsharded(u)]  # FSDP's unshard of an unsharded unit sends nothing
        call = call or f"GatheredParameters over {len(params)} parameter(s)"
        self.agreement.before_block(call, needed, modifier_rank, len(units))  # [Note: gathering calls agree first]
        block = ExitStack()
        block.enter_context(self._held(units))
        return [block, units]

    @contextmanager
    def _held(self, units: Sequence[Fsdp2Unit]) -> Iterator[None]:
        """`held_gathered`, counted per unit so `release_gathered` leaves the units a block holds alone."""
        self._holds.update(u.name for u in units)
        try:
            with held_gathered(units):
                yield
        finally:
            self._holds.subtract(u.name for u in units)

    def gather_end(self, held: list[Any], modifier_rank: int | None) -> None:
        block, units = held
        try:
            if modifier_rank is not None and units:
                self.agreement.before_broadcast(modifier_rank, [u.name for u in units])
                with torch.no_grad():
                    # a data-parallel rank (DeepSpeed's rule on a group that is not the world, as under tensor
                    # parallelism); each tensor-parallel rank broadcasts its own slice
                    src = self.comm.global_rank(modifier_rank)
                    for unit in units:
                        for sharded, full in unsharded_views(unit):
                            local = full.to_local() if isinstance(full, DTensor) else full
                            self.comm.broadcast(local.data, src=src, label="GatheredParameters modifier")
                            sp = self._by_id[id(sharded)]
                            sp.master.copy_(own_rows(sp, local))
        finally:
            block.close()

    def coalescing_refused(self) -> str | None:
        return "the fsdp2 backend reduces inside FSDP2's own backward hooks, which cannot hold gradients for a block"

    def module_load_refused(self) -> str | None:
        return (
            "load_module_state_dict is not supported on the fsdp2 backend (its module's parameters are DTensors, "
            "which torch's load_state_dict does not fill from full tensors); use engine.load_checkpoint(..., "
            "load_module_only=True), or safe_set_full_fp32_param per parameter"
        )

    def release_gathered(self) -> None:
        """Reshard every unit no block holds (a no_grad forward at stages 1-2 leaves units unsharded until the next
        backward); units inside `gathered()` or GatheredParameters stay."""
        for unit in self.units:
            if not self._holds[unit.name]:
                unit.module.reshard()

    @contextmanager
    def gathered(self) -> Iterator[None]:
        with self._held(self.units):
            yield

    def full_state_dict(self) -> dict[str, Any]:
        """Whole tensors in the compute dtype, parameters gathered one at a time (collective); tied names share one
        tensor."""
        return self.whole_tensors(keep=True, device=None)

    def save_state_dict(self, keep: bool) -> dict[str, Any]:
        """Each tensor on the host as soon as it is whole, on the ranks that keep it (the others take part in the
        gathers only): the whole model is never on a GPU, as stage 3's unit-by-unit save."""
        return self.whole_tensors(keep, torch.device("cpu"))

    def whole_tensors(self, keep: bool, device: torch.device | None) -> dict[str, Any]:
        """The module's state dict, each parameter gathered whole in turn (every rank, in state-dict order) and moved
        to `device` (None: left where it was gathered); {} where not `keep`."""
        done: dict[int, torch.Tensor | None] = {}
        out: dict[str, Any] = {}
        self.agreement.agree("the full state dict", f"all-gather of {len(self.params)} parameters")
        for key, value in self.module.state_dict(keep_vars=True).items():
            sp = self._by_id.get(id(value))
            if sp is None:  # (a buffer under several names: one tensor, as a tied parameter)
                if keep and id(value) not in done:
                    done[id(value)] = value.detach() if device is None else value.detach().to(device, copy=True)
                if keep:
                    out[key] = done[id(value)]
                continue
            if id(value) not in done:
                gathered = gather_full(sp, sp.master, self.comm, self.device).to(self.policy.compute_dtype)
                whole = self._made_whole(key, gathered)
                done[id(value)] = None if not keep else whole if device is None else whole.to(device)
            if keep:
                out[key] = done[id(value)]
        return out

    def _made_whole(self, key: str, gathered: torch.Tensor) -> torch.Tensor:
        """A parameter whole after its gather over the data-parallel ranks (tensor parallelism: its slices too)."""
        return gathered

    # -- state, checkpoints -------------------------------------------------------------------------
    def checkpoint_state(self) -> ShardedState:
        from zeroshard.fsdp2.checkpoint import Fsdp2State

        return Fsdp2State(self)

    def optimizer_state_resident(self) -> AbstractContextManager[None]:
        return nullcontext()

    def consolidated_params(
        self, dtype: torch.dtype, keep: bool = True, device: torch.device | None = None
    ) -> dict[int, torch.Tensor]:
        out = {}
        self.agreement.agree("the consolidated state dict", f"all-gather of {len(self.params)} parameters")
        for sp in self.params:
            full = gather_full(sp, sp.master, self.comm, self.device)  # collective: every rank, every parameter
            if keep:
                out[id(sp.param)] = full.to(device or self.device, dtype, copy=True)
        return out

    def offloadable(self) -> dict[str, list[torch.Tensor]]:
        # the masters are the module's sharded parameters, which FSDP2 reads at every all-gather: they stay
        return {"optim_states": optimizer_state_tensors(self.optimizer)}

    def tracked_params(self) -> list[nn.Parameter]:
        return [sp.param for sp in self.params]

    @property
    def trainable_numel(self) -> int:
        return sum(sp.full_numel for sp in self._trainable())

    def memory(self) -> StrategyMemory:
        memory = StrategyMemory()
        shards = sum(nbytes(sp.master) for sp in self.params)
        grads = sum(nbytes(sp.local_grad()) for sp in self.params)
        state = sum(held(t) for t in optimizer_state_tensors(self.optimizer))  # 0 while offload_states() holds it
        gathered = 0
        for unit in self.units:
            for _, full in unsharded_views(unit):
                gathered += full.untyped_storage().nbytes()
        memory.gathered_params = gathered
        on_host = self.policy.plan.cpu_offload
        fp32 = self.policy.compute_dtype == torch.float32
        if on_host:  # CPUOffloadPolicy: sharded parameters (the masters), gradients and state in host memory
            memory.host_master_weights, memory.host_gradients, memory.host_optimizer_state = shards, grads, state
        else:  # fp32: the shards are the parameters; otherwise they are fp32 masters cast at each all-gather
            memory.params, memory.master_weights = (shards, 0) if fp32 else (0, shards)
            memory.gradients, memory.optimizer_state = grads, state
        return memory

    def destroy(self) -> None:
        """The module stays an FSDP2 module (usable without zeroshard); the registry forgets its parameters."""
        OWNERS.unregister(self.tracked_params())
        self._publish()


def _unsharded(unit: Fsdp2Unit) -> bool:
    """Whether FSDP holds `unit` gathered now (inside its forward, or a block): then its `unshard()` sends nothing."""
    groups = unit.module._get_fsdp_state()._fsdp_param_groups
    pending = [getattr(group, "_all_gather_result", None) is not None for group in groups]  # an unshard in flight
    return bool(groups) and all(group.is_unsharded or busy for group, busy in zip(groups, pending, strict=True))
