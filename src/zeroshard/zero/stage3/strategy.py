"""ZeRO stage 3: every parameter is sharded; units are gathered just before use and released after.

The strategy routes the hooks' events (hooks.py) to the pieces that do the work, each in its own file: construction
(build.py), the gather schedule and prefetch (schedule.py, prefetch.py), gradient reduction (reduce.py), the sub-group
step (step.py), checkpoints (checkpoint.py) and divergence diagnosis (comm/divergence.py). Whatever did not happen in
backward (units whose inputs need no gradient, units unused in the loss) happens when backward returns."""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._pytree import tree_flatten

from zeroshard.checkpoint.state import ShardedState
from zeroshard.comm.collectives import Collectives
from zeroshard.comm.divergence import DivergenceWatch
from zeroshard.loading.weights import StreamedWeights
from zeroshard.memory import StrategyMemory
from zeroshard.offload.gradients import GradShard
from zeroshard.offload.tier import Tier
from zeroshard.zero.owners import OWNERS
from zeroshard.zero.pool import BufferPool
from zeroshard.zero.stage3.build import BuildPolicy, build_units
from zeroshard.zero.stage3.checkpoint import Stage3State
from zeroshard.zero.stage3.ds_param import unmark
from zeroshard.zero.stage3.gathering import Stage3Gathering
from zeroshard.zero.stage3.hooks import Stage3Hooks
from zeroshard.zero.stage3.norms import step_plan
from zeroshard.zero.stage3.offloaded import Stage3Offload
from zeroshard.zero.stage3.param_values import Stage3ParamValues
from zeroshard.zero.stage3.plan import NO_LEAVES, LeafModules, UnitPolicy, unit_module_names
from zeroshard.zero.stage3.prefetch import PrefetchPolicy
from zeroshard.zero.stage3.reduce import UnitReducer
from zeroshard.zero.stage3.root import RootScope, root_unit_of
from zeroshard.zero.stage3.schedule import GatherSchedule, recomputing, settle_live_gathers
from zeroshard.zero.stage3.sections import gather_flat
from zeroshard.zero.stage3.speculate import SpeculationPolicy, check_undoable, speculation_for
from zeroshard.zero.stage3.step import SubGroupStepper
from zeroshard.zero.stage3.unit import ShardedUnit, UnitState
from zeroshard.zero.strategy import (
    AccumulationState,
    ParamGroupSpec,
    Strategy,
    StrategyPolicy,
)
from zeroshard.zero.strategy import held as held_now
from zeroshard.zero.zeropp.policy import ZeroPPPolicy
from zeroshard.zero.zeropp.stage3 import attach_zeropp


@dataclass(frozen=True)
class Stage3Policy(StrategyPolicy):
    """Stage 3: prefetch and persistence, sub-groups, and where compute shards live."""

    prefetch: PrefetchPolicy
    persistence_threshold: int
    sub_group_numel: int
    param_tier: Tier  # compute-dtype shards (offload_param)
    param_read_ahead: tuple[int, int] = (0, 0)  # offload_param on NVMe: (units, elements) read ahead of use
    wait_timeout_s: float = field(default_factory=lambda: float(os.environ.get("ZEROSHARD_DIVERGENCE_TIMEOUT_S", "40")))
    unit_policy: UnitPolicy | None = None
    leaves: LeafModules = NO_LEAVES  # zero_optimization.leaf_module ([Note: leaf modules])
    weights: StreamedWeights | None = None  # the checkpoint of a model `zero_init` built from one
    init_source: int | None = None  # the rank whose initialisation every rank takes: [Note: one start on every rank]
    zeropp: ZeroPPPolicy | None = None  # qwZ / hpZ / qgZ ([Note: ZeRO++])
    root_by_module: bool = True  # zeroshard.stage3_root_by_module ([Note: root unit by module])
    speculation: SpeculationPolicy | None = None  # offload_optimizer.super_offload ([Note: speculative host steps])
    model_persistence_threshold: int = sys.maxsize  # stage3_model_persistence_threshold ([Note: units])
    resident_state: frozenset[str] = frozenset()  # optimizer state kept in memory when the rest swaps (step.py)
    unit_groups: Mapping[str, Collectives] = field(default_factory=dict)  # [Note: units apart] in plan.py


class Stage3Strategy(Stage3Gathering, Stage3Offload, Stage3ParamValues, Strategy):
    """Stage-3 state of one model on one rank."""

    def __init__(
        self,
        module: nn.Module,
        groups: Sequence[ParamGroupSpec],
        policy: Stage3Policy,
        comm: Collectives,
        device: torch.device,
        accumulation: AccumulationState,
    ):
        super().__init__(module, groups, policy, comm, device, accumulation)
        self.policy = policy
        # gradients stay in the reduction's dtype with one micro-step per step, else they accumulate (a window the
        # caller owns may have any length: [Note: caller-owned windows])
        one_micro_step = accumulation.gradient_accumulation_steps == 1 and accumulation.managed
        grad_dtype = policy.comm_dtype if one_micro_step else policy.grad_accum_dtype
        self._grads_accumulate_in = grad_dtype if grad_dtype == policy.grad_accum_dtype else None
        self._untraced = 0  # inside gathered(): forwards out of the trace and the digest
        self._ds_tensors: dict[nn.Parameter, torch.Tensor] = {}  # offload_states(lp_params): the parts, kept
        build = BuildPolicy(
            policy.compute_dtype,
            grad_dtype,
            policy.persistence_threshold,
            policy.sub_group_numel,
            policy.unit_policy,
            policy.master_tier,
            policy.param_tier,
            policy.weights,
            policy.init_source,
            keeps_gradients=bool(groups),
            persistent_alone=policy.speculation is not None,
            model_persistence_threshold=policy.model_persistence_threshold,
            leaves=policy.leaves,
            master_dtype=policy.master_dtype,
            frozen_quantizer=policy.zeropp.frozen_quantizer if policy.zeropp is not None else None,
            unit_groups=policy.unit_groups,
        )
        self.built = build_units(module, groups, build, comm, device, self.gradients_tier)
        self.units: list[ShardedUnit] = self.built.units
        if comm.rank == 0:
            split = [(g.tier, sum(u.layout.trainable_shard_numel for u in g.units)) for g in self.built.sub_groups]
            policy.master_tier.log_split(split)
        self.pool = BufferPool(device)
        self.watch = DivergenceWatch(comm, device, policy.wait_timeout_s, lambda i: self.units[i].name)
        param_store = policy.param_tier.residency
        self.schedule = GatherSchedule(
            self.units, policy.prefetch, self.watch, param_store, policy.param_read_ahead, policy.overlap_comm
        )
        self.reducer = UnitReducer(
            self.pool,
            policy.comm_dtype,
            policy.step.prescale(comm.world_size),
            policy.overlap_comm,
            self.gradients_tier,
            accumulation,
            self.watch,
        )
        self.zeropp = attach_zeropp(policy.zeropp, comm, self.units, self.schedule, self.reducer)
        self.stepper = SubGroupStepper(
            self.built, policy.master_tier.residency, param_store, self.gradients_tier, policy.resident_state
        )
        self.speculation = speculation_for(self.stepper, policy.speculation, self._grad_scale, device)
        self.reducer.speculation = self.speculation
        self.steps_in_backward = self.speculation is not None
        self._state_dict_gathered: list[bool] = []
        # blocks the unit policy names that hold no unit (every parameter persistent): the divergence digest
        # still follows them ([Note: divergence check])
        unit_names = {u.name for u in self.units}
        modules, blocks = dict(module.named_modules()), unit_module_names(module, policy.unit_policy, policy.leaves)
        self.parameterless_blocks = [
            (len(self.units) + k, modules[name]) for k, name in enumerate(n for n in blocks if n not in unit_names)
        ]
        self.root_unit = root_unit_of(self, module, policy.unit_policy, policy.leaves)
        if self.root_unit is not None and not policy.root_by_module:  # whole from the start; its entries still
            self.root_unit.scope = RootScope.WHOLE  # gather it without the root's forward: [Note: a whole root ...]
        self.hooks = Stage3Hooks(self, module)
        self.hooks.register()
        OWNERS.register(self, self.tracked_params())
        # [Note: nothing in flight at exit] runs at interpreter exit unless `destroy` ran it first (holding the
        # units weakly: what the finalizer holds lives until it runs, [Note: tensor hooks hold their owner weakly])
        self._settle_at_exit = weakref.finalize(self, settle_live_gathers, [weakref.ref(u) for u in self.units])

    # -- construction ------------------------------------------------------------------------------
    def _agreement_timeout_s(self, policy: StrategyPolicy, device: torch.device) -> float | None:
        """On the CPU as long as a gather waits before the divergence report; elsewhere the group's deadline."""
        assert isinstance(policy, Stage3Policy)
        return policy.wait_timeout_s if device.type == "cpu" else None

    def master_param_groups(self) -> list[dict[str, Any]]:
        groups = []
        self.built.placeholders.clear()
        for options, pieces in zip(self.group_options, self.built.pieces, strict=True):
            params = [piece.master for piece in pieces]
            if not params:  # this rank owns no element of the group: an empty stand-in keeps the group
                params = [torch.zeros(0, dtype=self.policy.master_dtype, device=self.device)]
                self.built.placeholders.append(params[0])
            groups.append({**options, "params": params})
        return groups

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        check_undoable(optimizer, self.speculation)
        self.optimizer = self.stepper.optimizer = optimizer
        self.stepper.plan = step_plan(optimizer, self.built, self.group_options, self.comm, self.device)

    # -- hook events (hooks.py) --------------------------------------------------------------------
    def on_root_pre_forward(self) -> None:
        if self.zeropp is not None and not self.schedule.in_backward:
            self.zeropp.new_forward()
        self.schedule.root_pre_forward()

    def on_pre_forward(self, unit: ShardedUnit, counted: bool = True) -> None:
        """`counted`: this forward call's backward reports back (`on_post_backward`), [Note: root unit by module]."""
        if not self._untraced:
            self.watch.run_log.append(unit.index)
        self.schedule.pre_forward(unit, counted)

    def on_block_ran(self, index: int) -> None:
        """A block without a unit of its own (all its parameters persistent) ran: only the digest records it."""
        if not self._untraced:
            self.watch.run_log.append(index)

    def on_post_forward(
        self,
        unit: ShardedUnit,
        output: Any,
        backward: Callable[[], bool] | None = lambda: True,
        release: bool = True,
    ) -> None:
        """The gradient of `output` gathers the unit again while `backward()` says so (None: its backward does not
        read the parameters); `release`: the unit may be released now ([Note: root unit by module])."""
        if torch.is_grad_enabled() and backward is not None:
            flat, _ = tree_flatten(output)
            needs = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
            if needs:
                recomputed = recomputing()  # [Note: recompute]
                wanted = backward

                def pre_backward(grads: Any) -> None:
                    if wanted():
                        self.schedule.pre_backward(unit, recomputed)

                torch.autograd.graph.register_multi_grad_hook(needs, pre_backward, mode="any")
        if release:
            self.schedule.post_forward(unit)

    def on_grad(self, unit: ShardedUnit, index: int, param: nn.Parameter) -> None:
        if self.speculation is not None:
            self.speculation.check_no_backward()
        self.reducer.stage(unit, index, param)
        unit.return_shape(index)  # [Note: root unit by module]: lent while autograd accumulated it

    def on_post_backward(self, unit: ShardedUnit, reduce: bool = True) -> None:
        """The unit's backward has run for one of its forward calls; after the last, reduce (unless gradients are
        still to come, [Note: root unit by module]: then when backward ends) and release."""
        if self.schedule.last_backward(unit):
            if reduce and not self.accumulation.coalescing:  # [Note: coalesced gradient reduction]: held back
                self.reducer.reduce(unit)
            unit.release()

    # -- backward ----------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        if self.speculation is not None:
            self.speculation.check_no_backward()
        self.schedule.in_backward = True

    def finish_backward(self) -> None:
        if self.accumulation.coalescing:  # [Note: coalesced gradient reduction]: the staging buffers stay
            if self.schedule.in_backward:
                self.schedule.end_backward()
            return
        if not self.schedule.in_backward and not any(u.staging is not None for u in self.units):
            return
        self.reducer.finish(self.units)
        self.schedule.end_backward()
        self.pool.end_pass()
        if self.speculation is not None:  # [Note: speculative host steps]: taken by the time backward returns
            self.speculation.settle(self.comm)

    # -- the step (skeleton in Strategy.step) --------------------------------------------------------
    @property
    def _sharded(self) -> bool:
        return self.comm.world_size > 1

    def _before_step(self) -> None:
        self.watch.check_step()
        for unit in self.units:  # no backward in this window: transient shards read as zeros from here on
            if unit.grad_transient and unit.grad_zero:
                unit.grad_resident()

    def _grad_slots(self) -> list[GradShard]:
        return [GradShard(u.grad_key, u.grad_shard, bool(u.trainable)) for u in self.units]

    def _make_grads_resident(self) -> None:
        for unit in self.units:
            unit.grad_resident()

    def _step_chunks(self, scale: float) -> None:
        done = self.speculation.commit(scale) if self.speculation is not None else frozenset()
        self.stepper.step(scale, done)

    def _publish(self) -> None:
        self.refresh_gathered()

    def refresh_gathered(self) -> None:
        """Units that stay gathered (the persistent one) get their shards' new values (collective)."""
        for unit in self.units:
            if unit.persistent or unit.state is not UnitState.SHARDED:
                self.schedule.refresh(unit)

    def zero_grad(self) -> None:
        for unit in self.units:  # a coalesced block's held gradients ([Note: coalesced gradient reduction]): dropped
            unit.drop_staging(self.pool)
        self.finish_backward()
        if self.speculation is not None:  # a skipped step, or gradients dropped without one
            self.speculation.undo("the step was skipped or its gradients dropped")
        for unit in self.units:
            unit.zero_grad_shard()
            unit.grad_copy_ready = False
        self.gradients_tier.reset()
        self.reducer.first_window_step = True

    def loading(self, done: bool) -> None:
        if self.speculation is not None and not done:  # what backward stepped is stepped back, as zero_grad would
            self.speculation.before_load()
        elif self.speculation is not None:  # what backward stepped is gone with the state it changed
            self.speculation.forget()

    @property
    def host_copies_in_backward(self) -> int:
        return self.stepper.host_copies_in_backward

    # -- state -------------------------------------------------------------------------------------
    def checkpoint_state(self) -> ShardedState:
        return Stage3State(self)

    def optimizer_state_resident(self) -> AbstractContextManager[None]:
        return self.stepper.all_resident()

    def consolidated_params(
        self, dtype: torch.dtype, keep: bool = True, device: torch.device | None = None
    ) -> dict[int, torch.Tensor]:
        """Full master values of every parameter, unit by unit (collective: every rank calls it); one unit whole
        on the compute device at a time."""
        out: dict[int, torch.Tensor] = {}
        self.agreement.agree("the consolidated state dict", f"all-gather of the fp32 shards of {len(self.units)} units")
        with self.optimizer_state_resident():
            for unit in self.units:
                full = torch.zeros(unit.numel, dtype=torch.float32, device=self.device)
                mine, label = unit.fp32_shard().to(self.device), f"consolidate {unit.name!r}"
                gather_flat(unit.comm.all_gather, unit.layout, full, mine, unit.shard_rank, label=label).wait()
                for slot in unit.layout.slots:
                    value = full.narrow(0, slot.offset, slot.numel).view(unit.views[slot.index].shape)
                    self.consolidated_value(unit.params[slot.index], value, out if keep else None, dtype, device)
        return out

    def tracked_params(self) -> list[nn.Parameter]:
        return [p for u in self.units for p in u.params]

    @property
    def trainable_numel(self) -> int:
        return sum(u.trainable_numel for u in self.units)

    def memory(self) -> StrategyMemory:
        def held(t: torch.Tensor) -> int:  # what is allocated now (released units, shards on NVMe: 0)
            return t.untyped_storage().nbytes()

        memory = StrategyMemory(
            gradients=sum(held(u.grad_shard) for u in self.units),
            comm_buffers=self.pool.held_bytes,
            persistent_params=sum(held(u.full) for u in self.units if u.persistent),
            gathered_params=sum(held(u.full) for u in self.units if not u.persistent),
            peak_gathered_params=self.schedule.peak_gathered_numel * self.units[0].full.element_size()
            if self.units
            else 0,
            secondary_params=self.zeropp.secondary_bytes if self.zeropp is not None else 0,
        )
        self.policy.param_tier.count_params(memory, sum(held(t) for u in self.units for t in u.stored()))
        self._count_state(memory)
        copies = [u.grad_copy for u in self.units if u.grad_copy is not None and u.grad_copy is not u.grad_shard]
        self.gradients_tier.count(memory, sum(held_now(c) for c in copies))
        return memory

    def _count_state(self, memory: StrategyMemory) -> None:
        """Masters and optimizer state, each sub-group's on its tier ([Note: partial offload])."""
        # the first sub-group's tier reports even when there is none (NVMe: its files)
        held: dict[Tier, list[int]] = {self.policy.master_tier.for_sub_group(0, 1): [0, 0, 0]}
        for sub_group in self.built.sub_groups:
            masters = sum(0 if u.master is u.shard else held_now(u.master) for u in sub_group.units)
            both = sum(held_now(t) for t in self.stepper.tensors(sub_group.units))  # masters and swapped state
            unswapped = sum(held_now(t) for t in self.stepper.tensors(sub_group.units, resident=True))
            counts = held.setdefault(sub_group.tier, [0, 0, 0])
            counts[0] += masters
            counts[1] += both - masters + unswapped
            counts[2] += unswapped
        for tier, (masters, state, unswapped) in held.items():
            tier.count_state(memory, masters, state, unswapped)

    def destroy(self) -> None:
        """Remove every hook; the module is left gathered (full parameters), usable without zeroshard."""
        if self.speculation is not None:
            self.speculation.close()
        self.hooks.remove()
        self._settle_at_exit.detach()  # every pending gather is waited for below
        self.stepper.store.close()  # removes the swap files
        OWNERS.unregister(self.tracked_params())
        for unit in self.units:
            self.schedule.wait_gathered(unit)
            if unit.state is UnitState.SHARDED:
                unit.gather(async_op=False)
                unit.wait_gathered()
        unmark(self.tracked_params())  # whole again: [Note: DeepSpeed's parameter attributes] in ds_param.py
        self.stepper.param_store.close()
        self.pool.clear()

    def window_change_refused(self, gradient_accumulation_steps: int) -> str | None:
        if gradient_accumulation_steps == 1 or self._grads_accumulate_in is not None:
            return None
        dtype = str(self.policy.grad_accum_dtype).removeprefix("torch.")
        return (
            f"gradient_accumulation_steps 1 -> {gradient_accumulation_steps} at stage 3: this engine keeps its "
            f"gradient shards in {str(self.policy.comm_dtype).removeprefix('torch.')}, the reduction's dtype, since "
            f"it was built for one micro-step per step, and accumulating needs {dtype}; start with "
            "gradient_accumulation_steps > 1, or set data_types.grad_accum_dtype to the communication dtype"
        )

    def take_module_params(self, src: int) -> None:
        return None  # GatheredParameters's modifier_rank wrote rank src's values into every rank's shards

    def coalescing_refused(self) -> str | None:
        if self.speculation is not None:
            return "super_offload steps the optimizer during backward, which a coalesced block holds back"
        return None

    def _pieces_of(self, unit: ShardedUnit) -> list[Any]:
        return [piece for pieces in self.built.pieces for piece in pieces if piece.unit is unit]

    def _slot_of(self, param: torch.Tensor) -> tuple[ShardedUnit, int, Any]:
        unit, index = next((u, i) for u in self.units for i, p in enumerate(u.params) if p is param)
        return unit, index, next(s for s in unit.layout.slots if s.index == index)

    def _agree_slot(self, call: str, param: torch.Tensor, what: str) -> None:  # a gradient and a master: same sizes
        unit, _, slot = self._slot_of(param)
        self.agreement.agree(call, f"all-gather of the {what} shards of {slot.name} (unit {unit.index})")

    def _gather_slot(
        self, param: torch.Tensor, local: Callable[[ShardedUnit], torch.Tensor], call: str = "", what: str = ""
    ) -> torch.Tensor:
        """All-gather `local(unit)` (this rank's fp32 shard of `param`'s unit, or its prefix); `param`'s part.
        With `call`, agreed first on reading `what`."""
        if call:
            self._agree_slot(call, param, what)
        unit, index, slot = self._slot_of(param)
        full, values = torch.zeros(unit.numel, dtype=torch.float32, device=self.device), local(unit)
        mine = F.pad(values.to(self.device, torch.float32), (0, unit.layout.shard_numel - values.numel()))
        label = f"full value in {unit.name!r}"
        gather_flat(unit.comm.all_gather, unit.layout, full, mine, unit.shard_rank, label=label).wait()
        return full.narrow(0, slot.offset, slot.numel).view(unit.views[index].shape).clone()
