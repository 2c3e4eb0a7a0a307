"""ZeRO stage 3: every parameter is sharded; units are gathered just before use and released after.

Forward: a unit's pre-forward hook gathers it (waiting for a prefetch if one is in flight) and starts
gathering the next units of the recorded trace; its post-forward hook releases it unless the trace
says it is reused soon. Backward: a hook on the unit's outputs gathers it again; when the unit's
backward has run (its inputs' gradients exist) its gradients, staged by per-parameter hooks, are
reduce-scattered into the gradient shard and the unit is released. Whatever did not happen in
backward (units whose inputs need no gradient, units unused in the loss) happens when backward
returns. The step updates the fp32 master shards per sub-group and copies them to the compute shards.
"""

from __future__ import annotations

import datetime
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from zeroshard.comm.collectives import Collectives, Handle
from zeroshard.errors import CollectiveMismatchError
from zeroshard.offload.nvme_store import InMemory, Residency
from zeroshard.offload.tier import Tier, copy_aside
from zeroshard.precision.loss_scaler import has_inf_or_nan
from zeroshard.utils.logging import get_logger
from zeroshard.zero.buffers import BufferPool, cast_floating_buffers
from zeroshard.zero.optimizer import ParamGroupSpec, StepOutcome, ZeroPolicy, _optimizer_state_tensors
from zeroshard.zero.stage3.checkpoint import Stage3State
from zeroshard.zero.stage3.gathered import OWNERS
from zeroshard.zero.stage3.hooks import Stage3Hooks
from zeroshard.zero.stage3.plan import PERSISTENT, UnitPolicy, layout_unit, plan_units
from zeroshard.zero.stage3.prefetch import ExecutionTrace, PrefetchPolicy, reused_soon, units_to_prefetch
from zeroshard.zero.stage3.unit import ShardedUnit, UnitState
from zeroshard.zero.stepmath import scale_from_norms, tensor_norms

logger = get_logger(__name__)

MAX_INFLIGHT_REDUCES = 2
MAX_PENDING_GRAD_WRITES = 2


@dataclass(frozen=True)
class Stage3Policy:
    base: ZeroPolicy
    prefetch: PrefetchPolicy
    persistence_threshold: int
    gradient_accumulation_steps: int
    sub_group_numel: int
    master_tier: Tier | None = None  # optimizer state and fp32 master (offload_optimizer)
    nvme: Any = None  # NvmeStateStore factory (offload_optimizer.device "nvme"): called once, with no arguments
    param_tier: Tier | None = None  # compute-dtype shards (offload_param)
    param_nvme: Any = None  # NvmeStateStore factory (offload_param.device "nvme")
    param_read_ahead: tuple[int, int] = (0, 0)  # offload_param on NVMe: (units, elements) read ahead of use
    wait_timeout_s: float = field(default_factory=lambda: float(os.environ.get("ZEROSHARD_DIVERGENCE_TIMEOUT_S", "40")))
    unit_policy: UnitPolicy | None = None


class Stage3Optimizer:
    """Stage-3 state of one model on one rank; the same interface as the stage 0-2 ZeroOptimizer."""

    def __init__(
        self,
        module: nn.Module,
        groups: Sequence[ParamGroupSpec],
        policy: Stage3Policy,
        comm: Collectives,
        device: torch.device,
    ):
        self.module = module
        self.policy = policy
        self.comm = comm
        self.device = device
        self.world_size = comm.world_size
        self.shard_rank = comm.rank
        self.group_options = [dict(g.options) for g in groups]
        group_of = {id(p): gi for gi, g in enumerate(groups) for _, p in g.params}
        frozen_group = len(groups)
        named = dict(module.named_parameters())
        base = policy.base
        grad_dtype = base.comm_dtype if policy.gradient_accumulation_steps == 1 else base.grad_accum_dtype
        modules = dict(module.named_modules())
        self.param_store: Residency = policy.param_nvme() if policy.param_nvme is not None else InMemory()
        self.store: Residency = policy.nvme() if policy.nvme is not None else InMemory()
        self.units: list[ShardedUnit] = []
        self._pieces: list[list[tuple[ShardedUnit, torch.Tensor, torch.Tensor]]] = [[] for _ in groups]
        sub_group = SubGroupCounter(policy.sub_group_numel)
        for index, spec in enumerate(plan_units(module, policy.unit_policy, policy.persistence_threshold)):
            params = [named[n] for n in spec.param_names]
            rows = [
                (n, p.numel(), group_of.get(id(p), frozen_group)) for n, p in zip(spec.param_names, params, strict=True)
            ]
            _materialize(modules, spec.param_names, params, device, index)
            unit = ShardedUnit(
                index,
                spec.name,
                None if spec.name == PERSISTENT else modules[spec.name],
                layout_unit(rows, self.world_size),
                params,
                self.shard_rank,
                base.compute_dtype,
                grad_dtype,
                device,
                policy.master_tier,
                policy.param_tier,
                self.param_store,
                self.store,
            )
            unit.release()
            self.units.append(unit)
            self._add_pieces(unit)
            unit.place_shard()
            # NVMe: each master goes to disk as soon as it exists (the optimizer state follows after a step)
            masters = [] if unit.master is unit.shard else [unit.master]
            self.store.place(f"subgroup{sub_group.add(unit.layout.shard_numel)}", masters)
            self.store.place(unit.grad_key, [unit.grad_shard])
            unit.zero_grad_shard()
        cast_floating_buffers(module, base.compute_dtype)
        self._numels = [u.numel for u in self.units]  # fixed once the units exist; read on every event
        self.pool = BufferPool(device)
        self.trace = ExecutionTrace()
        self.optimizer: torch.optim.Optimizer | None = None
        self._inflight: list[tuple[Handle, Callable[[], None], str]] = []
        self._placeholders: list[torch.Tensor] = []
        self._forward_calls: dict[int, int] = {}
        self._in_backward = False
        self._first_window_step = True
        self._gather_log: list[int] = []
        self.peak_gathered_numel = 0  # largest sum of gathered (non-persistent) unit sizes seen
        self._state_dict_gathered: list[bool] = []
        self.sync_decider: Callable[[], bool] = lambda: True
        self.boundary_decider: Callable[[], bool] = lambda: True
        # [Note: gradients on NVMe] With the optimizer state on NVMe the gradient shards go there too, each
        # written as soon as its unit's reduction finishes (at most MAX_PENDING_GRAD_WRITES in memory); their
        # norms and inf/nan flags are taken on the accumulation boundary right before the write, so the step
        # computes the clipping scale without reading them back, then reads them sub-group by sub-group.
        self._grads_on_disk = policy.nvme is not None
        self._grad_stats: dict[int, tuple[torch.Tensor | None, bool]] = {}
        self._grad_writes: list[ShardedUnit] = []
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.host_copies_in_backward = 0  # units whose step found the host gradient copy already made
        self.hooks = Stage3Hooks(self, module)
        self.hooks.register()
        OWNERS.register(self, self.tracked_params())

    # -- construction ------------------------------------------------------------------------------
    def _add_pieces(self, unit: ShardedUnit) -> None:
        """Per optimizer group: (unit, master view, grad view) of the owned range that is that group's."""
        for group, begin, end in unit.layout.group_pieces(self.shard_rank):
            if group < len(self._pieces):
                master, grad = unit.master.narrow(0, begin, end - begin), unit.grad_shard.narrow(0, begin, end - begin)
                self._pieces[group].append((unit, master, grad))

    def master_param_groups(self) -> list[dict[str, Any]]:
        groups = []
        self._placeholders = []
        for options, pieces in zip(self.group_options, self._pieces, strict=True):
            params = [master for _, master, _ in pieces]
            if not params:  # this rank owns no element of the group: an empty stand-in keeps the group
                params = [torch.zeros(0, device=self.device)]
                self._placeholders.append(params[0])
            groups.append({**options, "params": params})
        return groups

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    # -- forward / backward events (called by the hooks) -------------------------------------------
    def on_root_pre_forward(self) -> None:
        """A new forward: close the previous trace (a forward without backward, e.g. evaluation)."""
        if self._in_backward or not self.trace.current:
            return
        self._end_trace()
        for unit in self.units:
            unit.release()
        self._forward_calls.clear()

    def _end_trace(self) -> None:
        self.trace.end_step()

    def on_pre_forward(self, unit: ShardedUnit) -> None:
        self.trace.record(unit.index)
        self._forward_calls[unit.index] = self._forward_calls.get(unit.index, 0) + 1
        self._use(unit)

    def on_post_forward(self, unit: ShardedUnit, output: Any) -> None:
        if torch.is_grad_enabled():
            flat, _ = tree_flatten(output)
            needs = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
            if needs:
                torch.autograd.graph.register_multi_grad_hook(
                    needs, lambda grads: self.on_pre_backward(unit), mode="any"
                )
        if reused_soon(unit.index, self.trace.upcoming(), self._numels, self.policy.prefetch):
            return
        unit.release()

    def on_pre_backward(self, unit: ShardedUnit) -> None:
        self._in_backward = True
        self.trace.record(unit.index)
        self._use(unit)

    def on_grad(self, unit: ShardedUnit, index: int, param: nn.Parameter) -> None:
        grad = param.grad
        param.grad = None
        if grad is not None:
            unit.stage_grad(index, grad, self.pool, self.policy.base.comm_dtype)

    def on_post_backward(self, unit: ShardedUnit) -> None:
        """The unit's backward has run for one of its forward calls; after the last, reduce and release."""
        remaining = self._forward_calls.get(unit.index, 1) - 1
        self._forward_calls[unit.index] = remaining
        if remaining > 0:
            return
        self._reduce(unit)
        unit.release()

    def _use(self, unit: ShardedUnit) -> None:
        if unit.state is UnitState.SHARDED:
            self._gather(unit)
        self._wait_gathered(unit)
        gathered = {u.index for u in self.units if u.state is not UnitState.SHARDED}
        live = sum(u.numel for u in self.units if u.state is not UnitState.SHARDED and not u.persistent)
        for index in units_to_prefetch(self.trace.upcoming(), self._numels, gathered, live, self.policy.prefetch):
            self._gather(self.units[index])
        self._read_ahead()

    def _read_ahead(self) -> None:
        """offload_param on NVMe: start reading the shards of the next units of the trace (up to
        buffer_count units and max_in_cpu elements), so their gathers do not wait for the disk."""
        max_units, max_numel = self.policy.param_read_ahead
        budget, count = 0, 0
        for index in dict.fromkeys(self.trace.upcoming()):
            unit = self.units[index]
            if unit.state is not UnitState.SHARDED:
                continue
            budget += unit.layout.shard_numel
            count += 1
            if count > max_units or budget > max_numel:
                break
            self.param_store.fetch(unit.key)

    def _gather(self, unit: ShardedUnit) -> None:
        self._gather_log.append(unit.index)
        unit.gather(self.comm, async_op=self.policy.base.overlap_comm)
        live = sum(u.numel for u in self.units if u.state is not UnitState.SHARDED and not u.persistent)
        self.peak_gathered_numel = max(self.peak_gathered_numel, live)

    def _wait_gathered(self, unit: ShardedUnit) -> None:
        if unit.state is UnitState.GATHERING:
            self._wait_or_diagnose(unit._pending, f"all-gather of unit {unit.name!r}")
            unit.wait_gathered()

    def _reduce(self, unit: ShardedUnit) -> None:
        if unit.reduce_launched or not unit.trainable:
            return
        base = self.policy.base
        prescale = 1.0 / base.gradient_predivide_factor if base.prescale_gradients else 1.0
        handle, finish = unit.launch_reduce(
            self.comm, self.pool, base.comm_dtype, prescale, self._first_window_step, base.overlap_comm
        )

        def done() -> None:
            finish()
            if self._grads_on_disk:
                self._write_grad(unit)
            if unit.host_grad is not None:
                self._grad_to_host(unit)

        self._inflight.append((handle, done, f"reduce-scatter of unit {unit.name!r}"))
        # finish older reductions as new ones start: staging buffers go back to the pool during backward,
        # so at most MAX_INFLIGHT_REDUCES units' full gradients exist at once
        while len(self._inflight) > MAX_INFLIGHT_REDUCES:
            self._finish_oldest_reduce()

    def _write_grad(self, unit: ShardedUnit) -> None:
        """[Note: gradients on NVMe] the unit's gradient shard is final for this micro-step: record its norm on
        the boundary, start writing it, and free the oldest shards whose writes are done."""
        if self.boundary_decider():
            grad = unit.grad_shard
            norms = tensor_norms([grad])
            overflow = self.policy.base.check_overflow and has_inf_or_nan([grad])
            self._grad_stats[unit.index] = (norms[0] if norms else None, overflow)
        self.store.evict(unit.grad_key)
        self._grad_writes.append(unit)
        while len(self._grad_writes) > MAX_PENDING_GRAD_WRITES:
            self.store.settle(self._grad_writes.pop(0).grad_key)

    def _grad_to_host(self, unit: ShardedUnit) -> None:
        """CPU optimizer offload: the unit's gradient shard is final for this micro-step; on the boundary copy it
        into the host fp32 buffer now (a side stream on CUDA), so the step does not wait for it."""
        assert unit.host_grad is not None
        unit.host_grad_ready = self.boundary_decider()
        if unit.host_grad_ready:
            copy_aside(unit.host_grad, unit.grad_shard, self._copy_stream)

    def _settle_grad_writes(self) -> None:
        for unit in self._grad_writes:
            self.store.settle(unit.grad_key)
        self._grad_writes.clear()

    def _finish_oldest_reduce(self) -> None:
        handle, finish, what = self._inflight.pop(0)
        self._wait_or_diagnose(handle, what)
        finish()

    # -- the strategy interface ----------------------------------------------------------------------
    def begin_backward(self, sync: bool) -> None:
        self._in_backward = True

    def finish_backward(self) -> None:
        """Reduce what backward did not (unused units, units whose inputs need no grad) and release."""
        if not self._in_backward and not any(u.staging is not None for u in self.units):
            return
        for unit in self.units:
            self._reduce(unit)
        while self._inflight:
            self._finish_oldest_reduce()
        self._settle_grad_writes()
        for unit in self.units:
            unit.end_backward()
            unit.release()
        self._forward_calls.clear()
        self._first_window_step = False
        self._in_backward = False
        self._end_trace()

    def set_sync_decider(self, decider: Callable[[], bool]) -> None:
        self.sync_decider = decider  # stage 3 reduces every micro-step; kept for the interface

    def set_boundary_decider(self, decider: Callable[[], bool]) -> None:
        """`decider()` says, during a backward, whether it is the last micro-step before the optimizer step."""
        self.boundary_decider = decider

    def step(self, loss_scale: float = 1.0) -> StepOutcome:
        assert self.optimizer is not None, "attach() an optimizer first"
        with torch.profiler.record_function("zeroshard.reduce_wait"):
            self.finish_backward()
        self._check_same_gathers()
        base = self.policy.base
        post = base.gradient_predivide_factor / self.world_size if base.prescale_gradients else 1.0 / self.world_size
        norms, overflow = self._grad_norms()
        decided = scale_from_norms(
            norms,
            overflow,
            self.comm,
            self.world_size > 1,
            post,
            loss_scale,
            base.gradient_clipping,
            base.check_overflow,
            self.device,
        )
        if decided.overflow:
            self.zero_grad()
            return StepOutcome(skipped=True, grad_norm=None)
        if self._copy_stream is not None:
            self._copy_stream.synchronize()  # the gradient copies made during backward have landed
        with torch.profiler.record_function("zeroshard.optimizer_step"):
            # empty stand-ins are stepped with the first sub-group so every rank's optimizer counts the same
            # steps per group (its scalar state, e.g. Adam's step, is what checkpoints record per group)
            for placeholder in self._placeholders:
                placeholder.grad = torch.zeros_like(placeholder)
            previous: list[ShardedUnit] = []
            keyed = self._keyed_sub_groups()
            # NVMe: sub-group k+1 (and its gradients) is read while k steps and k-1 is written back
            for k, sub_group in enumerate(self.store.in_turn(keyed, self._sub_group_tensors)):
                if k == 0:
                    self._start_step_reads(sub_group)
                if k + 1 < len(keyed):
                    self._start_step_reads(keyed[k + 1][1])
                for unit in sub_group:
                    self.store.ready(unit.grad_key)
                self._step_sub_group(sub_group, decided.scale)
                for unit in sub_group:  # not needed after the step (zero_grad follows): freed, not written
                    self.store.drop(unit.grad_key)
                for placeholder in self._placeholders:
                    placeholder.grad = None
                for unit in previous:  # compute shards on NVMe: the previous sub-group's writes are done
                    unit.settle_shard()
                previous = sub_group
            for unit in previous:
                unit.settle_shard()
        with torch.profiler.record_function("zeroshard.all_gather_params"):
            for unit in self.units:
                if unit.persistent or unit.state is not UnitState.SHARDED:
                    self._refresh_gathered(unit)
        self.zero_grad()
        return StepOutcome(skipped=False, grad_norm=decided.grad_norm)

    def _grad_norms(self) -> tuple[list[torch.Tensor], bool]:
        """Per-tensor gradient norms (in unit order, as `step_scale` takes them) and this rank's overflow flag;
        with gradients on NVMe from the boundary's records, else (or if a record is missing) from the shards."""
        grads = [u.grad_shard for u in self.units]
        if not self._grads_on_disk:
            return tensor_norms(grads), self.policy.base.check_overflow and has_inf_or_nan(grads)
        if all(u.index in self._grad_stats or not u.trainable for u in self.units):
            norms, overflow = [], False
            for unit in self.units:
                norm, flag = self._grad_stats.get(unit.index, (None, False))
                if norm is None:  # a frozen unit: its shard holds zeros
                    norm = torch.zeros((), device=self.device) if unit.layout.shard_numel else None
                if norm is not None:
                    norms.append(norm)
                overflow = overflow or flag
            return norms, overflow
        keyed = [(u.grad_key, u) for u in self.units]  # a backward outside the engine's accounting: read all
        for unit in self.units:
            unit.grad_resident()
        with self.store.resident(keyed, lambda u: [u.grad_shard]):
            return tensor_norms(grads), self.policy.base.check_overflow and has_inf_or_nan(grads)

    def _keyed_sub_groups(self) -> list[tuple[str, list[ShardedUnit]]]:
        """Units in chunks of about `sub_group_size` shard elements: one optimizer call (and one set of
        fp32 gradient temporaries, one NVMe swap entry) per chunk, as DeepSpeed's sub-groups."""
        counter = SubGroupCounter(self.policy.sub_group_numel)
        chunks: dict[int, list[ShardedUnit]] = {}
        for unit in self.units:
            chunks.setdefault(counter.add(unit.layout.shard_numel), []).append(unit)
        return [(f"subgroup{k}", units) for k, units in chunks.items()]

    def _sub_group_tensors(self, units: list[ShardedUnit]) -> list[torch.Tensor]:
        members = {u.index for u in units}
        out = [u.master for u in units if u.master is not u.shard]  # else it lives with the compute shard
        if self.optimizer is not None:
            for pieces in self._pieces:
                for unit, master, _ in pieces:
                    if unit.index in members:
                        state = self.optimizer.state.get(master, {})
                        out += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return out

    @contextmanager
    def optimizer_state_resident(self, changes: bool = True) -> Iterator[None]:
        """Master weights and optimizer state in memory for the block (consolidation, export); with NVMe
        offload they are read in first and written back after (`changes=False`: freed, not written)."""
        shards = [(u.key, u) for u in self.units]
        with self.store.resident(self._keyed_sub_groups(), self._sub_group_tensors, changes):
            with self.param_store.resident(shards, lambda u: [u.shard], changes):
                yield

    @contextmanager
    def units_resident(self, key: str, units: list[ShardedUnit], changes: bool = True) -> Iterator[None]:
        """One sub-group's masters, optimizer state and compute shards in memory for the block (checkpoints
        handle the state this way, one sub-group at a time: [Note: state parts])."""
        with self.store.resident([(key, units)], self._sub_group_tensors, changes):
            with self.param_store.resident([(u.key, u) for u in units], lambda u: [u.shard], changes):
                yield

    @property
    def swaps_state(self) -> bool:
        """Whether state leaves memory between steps (NVMe offload)."""
        return not (isinstance(self.store, InMemory) and isinstance(self.param_store, InMemory))

    def _start_step_reads(self, units: list[ShardedUnit]) -> None:
        """Start reading what stepping `units` needs besides the optimizer store's entry: gradient shards, and
        masters that are the compute shards (fp32 with both tiers on NVMe)."""
        for unit in units:
            unit.grad_resident()
            if unit.master is unit.shard:
                unit.home.fetch(unit.key)

    def _step_sub_group(self, units: list[ShardedUnit], scale: float) -> None:
        assert self.optimizer is not None
        members = {u.index for u in units}
        for unit in units:
            unit.master_resident()
            self.host_copies_in_backward += unit.host_grad_ready
        assigned = []
        for pieces in self._pieces:
            for unit, master, grad in pieces:
                if unit.index not in members:
                    continue
                if unit.host_grad_ready:  # copied during backward (CPU optimizer offload)
                    assert unit.host_grad is not None
                    offset = grad.storage_offset() - unit.grad_shard.storage_offset()
                    master.grad = unit.host_grad.narrow(0, offset, grad.numel()).mul_(scale)
                elif grad.dtype == torch.float32 and grad.device == master.device:
                    if scale != 1.0:
                        grad.mul_(scale)
                    master.grad = grad
                else:  # another dtype or another tier (offload): a temporary for this sub-group only
                    master.grad = grad.to(device=master.device, dtype=torch.float32).mul_(scale)
                assigned.append(master)
        if assigned or any(p.grad is not None for p in self._placeholders):
            self.optimizer.step()
        for master in assigned:
            master.grad = None
        for unit in units:
            unit.publish()

    def _refresh_gathered(self, unit: ShardedUnit) -> None:
        """Persistent (and any still-gathered) units get the updated values right after the step."""
        unit.state = UnitState.SHARDED
        unit.gather(self.comm, async_op=False)
        unit.wait_gathered()

    def zero_grad(self) -> None:
        self.finish_backward()
        for unit in self.units:
            unit.zero_grad_shard()
            unit.host_grad_ready = False
        self._grad_stats.clear()
        self._first_window_step = True

    def destroy(self) -> None:
        """Remove every hook; the module is left gathered (full parameters), usable without zeroshard."""
        self.hooks.remove()
        self.store.close()  # removes the swap files
        OWNERS.unregister(self.tracked_params())
        for unit in self.units:
            self._wait_gathered(unit)
            if unit.state is UnitState.SHARDED:
                unit.gather(self.comm, async_op=False)
                unit.wait_gathered()
        self.param_store.close()
        self.pool.clear()

    def tracked_params(self) -> list[nn.Parameter]:
        return [p for u in self.units for p in u.params]

    def consolidated_params(self, dtype: torch.dtype) -> dict[int, torch.Tensor]:
        """Full fp32 master values of every parameter, unit by unit (collective: every rank calls it)."""
        with self.optimizer_state_resident():
            return self._consolidated_params(dtype)

    def _consolidated_params(self, dtype: torch.dtype) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        for unit in self.units:
            full = torch.zeros(unit.numel, dtype=torch.float32, device=self.device)
            self.comm.all_gather(full, unit.master.to(self.device), label=f"consolidate unit {unit.name!r}")
            for slot in unit.layout.slots:
                param = unit.params[slot.index]
                shape = unit.views[slot.index].shape
                out[id(param)] = full.narrow(0, slot.offset, slot.numel).view(shape).to(dtype).clone()
        return out

    def checkpoint_state(self) -> Stage3State:
        """This strategy in the checkpoint format's terms (see zero/stage3/checkpoint.py)."""
        return Stage3State(self)

    def offloadable_tensors(self) -> list[torch.Tensor]:
        """fp32 master shards that are not also the compute shards, and optimizer state."""
        out = [u.master for u in self.units if u.master is not u.shard]
        return out + _optimizer_state_tensors(self.optimizer)

    @property
    def trainable_numel(self) -> int:
        return sum(u.trainable_numel for u in self.units)

    def memory_bytes(self) -> dict[str, int]:
        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        state = 0
        if self.optimizer is not None:
            for per_param in self.optimizer.state.values():
                state += sum(nbytes(v) for v in per_param.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        persistent_full = sum(u.full.untyped_storage().nbytes() for u in self.units if u.persistent)
        gathered = sum(u.full.untyped_storage().nbytes() for u in self.units if not u.persistent)
        masters = sum(0 if u.master is u.shard else nbytes(u.master) for u in self.units)
        shards = sum(u.shard.untyped_storage().nbytes() for u in self.units)  # resident (NVMe: read ahead)
        master_off = self.policy.master_tier is not None and self.policy.master_tier.offloaded
        param_off = self.policy.param_tier is not None and self.policy.param_tier.offloaded
        on_disk = not isinstance(self.store, InMemory)  # NVMe: what is resident now (read for a step)
        return {
            "params_trainable": 0 if param_off else shards,
            "gradients": sum(u.grad_shard.untyped_storage().nbytes() for u in self.units),  # resident
            "master_weights": 0 if master_off else masters,
            "optimizer_state": 0 if master_off else state,
            "host_params": shards if param_off else 0,
            "host_master_weights": masters if master_off and not on_disk else 0,
            "host_optimizer_state": self.store.resident_bytes if on_disk else (state if master_off else 0),
            "comm_buffers": self.pool.held_bytes,
            "host_gradients": sum(nbytes(u.host_grad) for u in self.units if u.host_grad is not None),
            "nvme_bytes": self.store.disk_bytes + self.param_store.disk_bytes,
            "persistent_params": persistent_full,
            "gathered_params": gathered,
            "peak_gathered_params": self.peak_gathered_numel * self.units[0].full.element_size() if self.units else 0,
        }

    # -- whole-model gathering ---------------------------------------------------------------------
    def pin(self, units: Sequence[ShardedUnit]) -> None:
        """Gather `units` (every rank must call this) and keep them gathered until `unpin`."""
        for unit in units:
            unit.pins += 1
            if unit.state is UnitState.SHARDED:
                self._gather(unit)
        for unit in units:
            self._wait_gathered(unit)

    def unpin(self, units: Sequence[ShardedUnit]) -> None:
        for unit in units:
            unit.pins = max(0, unit.pins - 1)
            unit.release()

    def gather_all(self) -> None:
        self.pin(self.units)

    def on_state_dict_pre(self, keep_vars: bool) -> None:
        """`state_dict()` gathers every unit (collective); `state_dict(keep_vars=True)` asks for the module's
        own tensors (e.g. to catalogue them) and gets the placeholders without communication."""
        self._state_dict_gathered.append(not keep_vars)
        if not keep_vars:
            self.gather_all()

    def release_all(self) -> None:
        self.unpin(self.units)

    def detach_state(self, state_dict: dict[str, Any]) -> None:
        """state_dict post-hook: full tensors are copied out before the units are released."""
        if not (self._state_dict_gathered and self._state_dict_gathered.pop()):
            return
        for key, value in list(state_dict.items()):
            if isinstance(value, torch.Tensor):
                state_dict[key] = value.detach().clone()
        self.release_all()

    @contextmanager
    def gathered(self) -> Iterator[None]:
        self.gather_all()
        try:
            yield
        finally:
            self.release_all()

    def units_of(self, params: Sequence[torch.Tensor]) -> list[ShardedUnit]:
        wanted = {id(p) for p in params}
        return [u for u in self.units if any(id(p) in wanted for p in u.params)]

    def write_back(self, unit: ShardedUnit) -> None:
        """After the full parameters of a gathered unit were modified: update this rank's shards."""
        lo, hi = unit.layout.owned(self.shard_rank)
        keyed = [(k, units) for k, units in self._keyed_sub_groups() if unit in units]
        with self.store.resident(keyed, self._sub_group_tensors):
            unit.overwrite_shard(unit.full[lo:hi])

    # -- divergence --------------------------------------------------------------------------------
    def _wait_or_diagnose(self, handle: Handle | None, what: str) -> None:
        if handle is None:
            return
        timeout = datetime.timedelta(seconds=self.policy.wait_timeout_s)
        if self.world_size == 1 or self.device.type != "cpu":
            handle.wait()  # NCCL: a stream wait; a CPU timeout here would block the host on the GPU
            return
        try:
            handle.wait(timeout)  # type: ignore[call-arg]
        except RuntimeError as err:
            if "timed out" not in str(err).lower() and "timeout" not in str(err).lower():
                raise
            raise CollectiveMismatchError(self._diagnose(what)) from err

    def _diagnose(self, what: str) -> str:
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        recent = [self.units[i].name for i in self._gather_log[-3:]]
        store.set(f"zeroshard/diag/{self.shard_rank}", f"waiting on {what}; last gathered units {recent}")
        lines = []
        for rank in range(self.world_size):
            try:
                store.wait([f"zeroshard/diag/{rank}"], datetime.timedelta(seconds=5))
                lines.append(f"rank {rank}: {store.get(f'zeroshard/diag/{rank}').decode()}")
            except RuntimeError:
                lines.append(f"rank {rank}: did not answer (busy elsewhere or hung)")
        return (
            f"ranks diverged: rank {self.shard_rank} waited {self.policy.wait_timeout_s:.0f}s on {what}, which not "
            "every rank issued. " + "; ".join(lines) + ". Every rank must run the same modules in the same order "
            "(a module skipped or added on some ranks only)."
        )

    def _check_same_gathers(self) -> None:
        """Once per step: every rank gathered the same units in the same order (catches divergence that
        equal-sized units would otherwise hide). Redundant when every collective is fingerprinted."""
        if self.world_size == 1 or self.comm.verify:
            self._gather_log.clear()
            return
        digest = zlib.crc32(bytes(str(self._gather_log), "ascii"))
        mine = torch.tensor([digest, len(self._gather_log)], dtype=torch.int64, device=self.device)
        everyone = torch.zeros(2 * self.world_size, dtype=torch.int64, device=self.device)
        self.comm.all_gather(everyone, mine)
        rows = everyone.view(self.world_size, 2).tolist()
        self._gather_log.clear()
        if any(row != rows[0] for row in rows):
            raise CollectiveMismatchError(
                "ranks gathered different units in this step "
                + "; ".join(f"rank {r}: {n} gathers (digest {d})" for r, (d, n) in enumerate(rows))
                + ". Every rank must run the same modules in the same order."
            )


class SubGroupCounter:
    """Numbers consecutive units into sub-groups: a sub-group closes once it holds `limit` shard elements."""

    def __init__(self, limit: int):
        self.limit = limit
        self.index = 0
        self.size = 0

    def add(self, shard_numel: int) -> int:
        """The sub-group of the next unit."""
        if self.size >= self.limit:
            self.index, self.size = self.index + 1, 0
        self.size += shard_numel
        return self.index


def _materialize(
    modules: dict[str, nn.Module], names: Sequence[str], params: list[nn.Parameter], device: torch.device, seed: int
) -> None:
    """Meta-device parameters become real, one unit at a time, initialised by their modules' own
    reset_parameters() under a per-unit seed shared by every rank: no rank ever holds the full model."""
    if not any(p.is_meta for p in params):
        return
    owners = sorted({n.rsplit(".", 1)[0] if "." in n else "" for n in names})
    root = modules[""]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch.initial_seed() + seed)
        for owner in owners:
            module = modules[owner]
            own = list(module.parameters(recurse=False))
            if not all(p.is_meta for p in own):
                continue  # initialised with an earlier unit that shares this module
            for p in own:  # the whole module, also parameters another unit will shard later
                _make_real(p, device)
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
            init = getattr(root, "_init_weights", None)
            if callable(init):
                init(module)
    for p in params:
        if p.is_meta:
            _make_real(p, device, zero=True)


def _make_real(param: nn.Parameter, device: torch.device, zero: bool = False) -> None:
    """Give a meta parameter real storage in place: the Python object (and every reference to it,
    tied weights included) stays the same; `.data =` cannot change a tensor's device type."""
    alloc = torch.zeros if zero else torch.empty
    real = nn.Parameter(alloc(param.shape, dtype=param.dtype, device=device), requires_grad=param.requires_grad)
    torch.utils.swap_tensors(param, real)
