"""ZeRO stages 0/1/2 on flat buffers: sharded master weights, reduced gradients, one step.

Stage 0 keeps everything replicated and all-reduces gradients; stage 1 shards master weights and
optimizer state (gradients still accumulate in full, then are reduce-scattered); stage 2 also
shards gradients, reduce-scattering them during every backward. After the step each rank writes
its updated shard into the parameter buffer and the buckets are all-gathered in place.

[Note: gradients outside engine.backward]
Gradients from a backward that this engine did not take as its own (another engine's loss flowing through this
module, as in a GAN; a plain `loss.backward()` on the engine's output is its own: [Note: a backward the engine did
not start] in manual_backward.py) stay in `.grad`, as in plain PyTorch and DeepSpeed's stage 0:
`module.zero_grad()` clears them, a later `engine.backward` adds to them (autograd accumulates into `.grad` before
the hook moves it), and `engine.step()` reduces what is left (`_collect_loose_grads`). Stage 3 reduces every
gradient its hooks see into its shards, as DeepSpeed's stage 3 does.
Fp32 stage 0 also reduces and clips over trainable parameters outside the optimizer ([Note: clipping over the
whole module at stage 0] in zero/flat/bystanders.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeroshard.checkpoint.state import ShardedState
from zeroshard.comm.collectives import Collectives
from zeroshard.errors import UnusedParameterError
from zeroshard.memory import StrategyMemory
from zeroshard.offload.gradients import GradShard, publish_master
from zeroshard.offload.residency import Residency
from zeroshard.optim import state_dtype
from zeroshard.optim.lamb import Lamb
from zeroshard.optim.muon import Muon
from zeroshard.zero.flat.bystanders import PIPE_REPLICATED, Bystanders, find_bystanders
from zeroshard.zero.flat.full_values import FlatFullValues
from zeroshard.zero.flat.group_buffers import GroupBuffers, build_group_buffers
from zeroshard.zero.flat.local import local_of
from zeroshard.zero.flat.reducer import GradientReducer, ReducePolicy
from zeroshard.zero.layout import Bucket, FlatLayout, ParamSpec, build_layout, counted_ranges
from zeroshard.zero.matrices import FlatMatrixPlan
from zeroshard.zero.norms import FlatNormPlan
from zeroshard.zero.owners import OWNERS, weak_hook
from zeroshard.zero.pool import BufferPool
from zeroshard.zero.strategy import (
    AccumulationState,
    HostView,
    ParamGroupSpec,
    StrategyPolicy,
    held,
    optimizer_state_tensors,
)


@dataclass(frozen=True)
class FlatPolicy(StrategyPolicy):
    """Stages 0-2: which stage, and how gradients are bucketed and reduced."""

    stage: int
    bucket_numel: int
    use_reduce_scatter: bool
    ignore_unused_parameters: bool = True  # false: a trainable parameter without a gradient fails the step
    # elements each parameter's start is padded to in the flat buffers (zero_optimization.parameter_alignment: a
    # 16-byte boundary at stages 1-2, as DeepSpeed's; 1 otherwise)
    param_align: int = 1


class FlatStrategy(FlatFullValues):
    """Stage 0/1/2 state of one model on one rank."""

    def __init__(
        self,
        module: nn.Module,
        groups: Sequence[ParamGroupSpec],
        policy: FlatPolicy,
        comm: Collectives,
        device: torch.device,
        accumulation: AccumulationState,
        siblings: Sequence[ParamGroupSpec] = (),
    ):
        """`siblings`: parameters neither tracked here nor bystanders (a split strategy's other parts':
        `flat_parts`)."""
        super().__init__(module, groups, policy, comm, device, accumulation)
        self.policy = policy
        self.rank = comm.rank
        self.world_size = comm.world_size
        shard_count = self.world_size if policy.stage >= 1 else 1
        self.shard_rank = self.rank if shard_count > 1 else 0  # which slice of every bucket this rank owns
        order = {id(p): i for i, p in enumerate(module.parameters())}
        # [Note: DTensor parameters] a tensor-parallel parameter is its local shard here
        specs = [[ParamSpec(name, local_of(p).numel(), order[id(p)]) for name, p in g.params] for g in groups]
        self.layout: FlatLayout = build_layout(specs, policy.bucket_numel, shard_count, policy.param_align)
        on_demand = self._accumulator_on_demand(shard_count)  # [Note: stage 1's accumulator on demand]
        self.buffers: list[GroupBuffers] = [
            build_group_buffers(
                layout,
                [p for _, p in g.params],
                self.shard_rank,
                policy.compute_dtype,
                policy.grad_accum_dtype,
                keep_full_grads=policy.stage == 0 or (policy.stage == 1 and not on_demand),
                device=device,
                master_tier=policy.master_tier,
                master_dtype=policy.master_dtype,
            )
            for layout, g in zip(self.layout.groups, groups, strict=True)
        ]
        tracked = {id(p) for g in groups for _, p in g.params}
        self._cast_untracked(module, tracked)
        owned = tracked | {id(p) for g in siblings for _, p in g.params}
        whole_module_norm = policy.stage == 0 and policy.compute_dtype == torch.float32
        kept = find_bystanders(module, owned) if whole_module_norm else []  # [Note: clipping over the whole module..]
        self.bystanders = Bystanders(kept, comm, policy.step.prescale)
        # NVMe: each group's master shard and optimizer state live in swap files between steps and are read in
        # turn, one group ahead (Residency.in_turn)
        self.store: Residency = policy.master_tier.residency
        self._keyed = [(f"group{g}", g) for g in range(len(self.buffers))]
        for key, g in self._keyed:
            self.store.place(key, [self.buffers[g].master])
        self.pool = BufferPool(device)
        self.reducer = GradientReducer(
            self.layout,
            self.buffers,
            comm,
            ReducePolicy(
                partition_grads=policy.stage >= 2,
                comm_dtype=policy.comm_dtype,
                overlap=policy.overlap_comm,
                use_reduce_scatter=policy.use_reduce_scatter,
                prescale=policy.step.prescale(comm.world_size),
            ),
            self.pool,
            self.shard_rank,
        )
        self._hooks = [
            buffers.params[slot.index].register_post_accumulate_grad_hook(self._grad_hook(g, s))
            for g, buffers in enumerate(self.buffers)
            for s, slot in enumerate(buffers.layout.slots)
        ]
        # a model that outlives its strategy (dropped without destroy()) keeps no dead hooks
        weakref.finalize(self, _remove_all, self._hooks)
        # per group: the fp32 gradient the optimizer reads (the shard itself, a copy on the master tier, or None
        # for a temporary at the step); buckets whose slice of a copy backward already refreshed
        self._grad_copies: list[torch.Tensor | None] = []
        self._copied: set[int] = set()
        self._got_grad: set[tuple[int, int]] = set()  # (group, slot) with a gradient in this window
        self._group_buckets = [{b.id for b in buffers.layout.buckets} for buffers in self.buffers]
        self.host_copies_in_backward = 0  # groups whose step found the host gradients already copied
        self._copies_in_flight: list[Any] = []  # the step's host-to-GPU master copies, waited for at its end
        # [Note: tied copies in the norm] (pipe/context.py): per group, the ranges of the shard the norm counts
        copies = [{s for s, slot in enumerate(b.layout.slots) if _tied_copy(b, slot)} for b in self.buffers]
        rank = self.shard_rank
        self._counted = [counted_ranges(b.layout, rank, c) for b, c in zip(self.buffers, copies, strict=True)]
        OWNERS.register(self, self.tracked_params())  # [Note: parameter registry]

    # -- construction helpers --------------------------------------------------------------------
    def _cast_untracked(self, module: nn.Module, tracked: set[int]) -> None:
        """Frozen parameters follow the compute dtype, as DeepSpeed's module cast does (buffers: [Note: buffer
        dtypes], applied by initialize)."""
        dtype = self.policy.compute_dtype
        for param in module.parameters():
            if id(param) not in tracked and param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)

    def master_param_groups(self) -> list[dict[str, Any]]:
        return [{**opts, "params": [b.master]} for opts, b in zip(self.group_options, self.buffers, strict=True)]

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._grad_copies = [self.gradients_tier.copy_for(b.grad_shard, b.master) for b in self.buffers]
        if isinstance(optimizer, Muon):  # [Note: Muon on flat shards]
            optimizer.plan = FlatMatrixPlan(
                {
                    g: (b.master, [local_of(b.params[slot.index]).shape for slot in b.layout.slots], b.layout)
                    for g, (options, b) in enumerate(zip(self.group_options, self.buffers, strict=True))
                    if options.get("use_muon")
                },
                self.layout.shard_count,
                self.comm,
                self.device,
            )
        if isinstance(optimizer, Lamb):  # [Note: LAMB on flat shards]
            masters = {g: (b.master, b.layout) for g, b in enumerate(self.buffers)}
            optimizer.plan = FlatNormPlan(masters, self.layout.shard_count, self.comm, self.device)

    # -- backward --------------------------------------------------------------------------------
    def _grad_hook(self, group: int, slot: int) -> Any:
        """[Note: tensor hooks hold their owner weakly]"""
        return weak_hook(self, lambda strategy, param: strategy._on_grad(group, slot, param))

    def _on_grad(self, group: int, slot: int, param: nn.Parameter) -> None:
        if not self.reducer.active:  # [Note: gradients outside engine.backward]: left in .grad
            return
        if not getattr(param, "ds_grad_is_ready", True):  # [Note: tiled compute]: more slices to come, in .grad
            return
        self._got_grad.add((group, slot))
        self._received(self.reducer.on_grad_ready(group, slot, param))

    def begin_backward(self) -> None:
        if self.accumulation.coalescing:  # [Note: coalesced gradient reduction]: the gradients stay in .grad
            return
        self.reducer.begin_backward(self.accumulation.communicates())

    def flush_coalesced(self) -> None:
        """[Note: coalesced gradient reduction]: the block's sum in `.grad`, reduced now, on the boundary or not."""
        self._collect_loose_grads(sync=True)

    def _accumulator_on_demand(self, shard_count: int) -> bool:
        """Stage 1 allocates its full accumulator only when a backward does not communicate ([Note: stage 1's
        accumulator on demand] in reducer.py): windows of one backward that the engine counts, over several ranks."""
        windows = self.accumulation
        return shard_count > 1 and windows.managed and windows.gradient_accumulation_steps == 1

    def finish_backward(self) -> None:
        self._received(self.reducer.finish_backward())

    def end_window(self) -> None:
        """Stages 0-1 reduce a window's local accumulation once, at its end ([Note: caller-owned windows]): a
        backward with no gradients left to arrive launches every bucket."""
        if not self.accumulation.communicate_every_micro_step:
            self.begin_backward()
            self.finish_backward()

    def _collect_loose_grads(self, sync: bool = False) -> None:
        """[Note: gradients outside engine.backward] Before the step, `.grad`s a backward this engine did not run
        left on its parameters are reduced as one more backward would be (`sync`: now, even off the boundary)."""
        loose = [
            (g, s, buffers.params[slot.index])
            for g, buffers in enumerate(self.buffers)
            for s, slot in enumerate(buffers.layout.slots)
            if buffers.params[slot.index].grad is not None
        ]
        if not loose:
            return
        self.reducer.begin_backward(sync or self.accumulation.communicates())
        for g, s, param in loose:
            self._got_grad.add((g, s))
            self._received(self.reducer.on_grad_ready(g, s, param))
        self.finish_backward()

    def _check_unused(self) -> None:
        """`ignore_unused_parameters: false`: every trainable parameter must have had a gradient in this window."""
        if self.policy.ignore_unused_parameters or self.policy.stage == 0:
            return
        unused = [
            slot.name
            for g, buffers in enumerate(self.buffers)
            for s, slot in enumerate(buffers.layout.slots)
            if (g, s) not in self._got_grad
        ]
        if unused:
            raise UnusedParameterError(
                f"parameters got no gradient in this step: {', '.join(unused[:8])}"
                + (f" and {len(unused) - 8} more" if len(unused) > 8 else "")
                + "; set zero_optimization.ignore_unused_parameters true (their gradient is then zero), or make "
                "them take part in the loss"
            )

    def _received(self, buckets: list[Bucket]) -> None:
        """`buckets`' slices of the gradient shards are final for this micro-step: hand them to the gradient tier
        ([Note: gradients to the host during backward])."""
        if not self._grad_copies:  # no optimizer attached yet
            return
        boundary = self.accumulation.is_boundary()
        for bucket in buckets:
            copy = self._grad_copies[bucket.group]
            shard = self.buffers[bucket.group].grad_shard.narrow(0, bucket.shard_start, bucket.shard_numel)
            target = None if copy is None else copy.narrow(0, bucket.shard_start, bucket.shard_numel)
            if self.gradients_tier.received(GradShard(f"group{bucket.group}", shard), target, boundary):
                self._copied.add(bucket.id)
            else:
                self._copied.discard(bucket.id)

    # -- the step (skeleton in Strategy.step) ------------------------------------------------------
    @property
    def _sharded(self) -> bool:
        return self.layout.shard_count > 1

    def _before_step(self) -> None:
        self._collect_loose_grads()
        self.reducer.settle()  # [Note: the full accumulator is not zero-filled per window]
        self._check_unused()
        self.bystanders.reduce()

    def _extra_norms(self) -> list[torch.Tensor]:
        return [norm for _, norm in self.bystanders.norms()]

    def _grad_slots(self) -> list[GradShard]:
        """Each group's gradient shard; only the ranges the norm counts where a group holds a tied weight's
        copy ([Note: tied copies in the norm])."""
        return [
            GradShard(f"group{g}", b.grad_shard if ranges == [(0, b.layout.shard_numel)] else b.grad_shard[lo:hi])
            for g, (b, ranges) in enumerate(zip(self.buffers, self._counted, strict=True))
            for lo, hi in ranges
        ]

    def _step_chunks(self, scale: float) -> None:
        # one group at a time (the same arithmetic as one call: the optimizers are elementwise per tensor), so
        # that with NVMe offload only the group being stepped is in memory
        self._copies_in_flight = []
        try:
            for g in self.store.in_turn(self._keyed, self._group_tensors):
                self._step_group(g, scale)
        finally:
            _wait(self._copies_in_flight)

    def _step_group(self, g: int, scale: float) -> None:
        assert self.optimizer is not None
        buffers, copy = self.buffers[g], self._grad_copies[g]
        ready = copy is not None and copy is not buffers.grad_shard and self._group_buckets[g] <= self._copied
        self.host_copies_in_backward += ready
        buffers.master.grad = self.gradients_tier.for_step(buffers.grad_shard, buffers.master, copy, ready, scale)
        state_dtype.step(self.optimizer, [buffers.master])  # [Note: bf16 master weights]
        buffers.master.grad = None
        # host masters copied to the GPU while the next group steps; masters on NVMe leave memory after their step,
        # so their copies are waited for first ([Note: publishing a host master to the GPU])
        self._write_owned(buffers, None if self.store.leaves_memory else self._copies_in_flight)

    def _publish(self) -> None:
        self._gather_params()

    def _group_tensors(self, g: int) -> list[torch.Tensor]:
        master = self.buffers[g].master
        state = self.optimizer.state.get(master, {}) if self.optimizer is not None else {}
        return [master] + [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]

    @contextmanager
    def optimizer_state_resident(self) -> Iterator[None]:
        with self.store.resident(self._keyed, self._group_tensors):
            yield

    def publish_params(self) -> None:
        """Write each rank's updated master shard into the parameter views and all-gather every bucket."""
        with self.optimizer_state_resident():
            for buffers in self.buffers:
                self._write_owned(buffers)
        self._gather_params()

    def _write_owned(self, buffers: GroupBuffers, in_flight: list[Any] | None = None) -> None:
        """This rank's ranges of the parameter buffer := its master shard; copies from pinned host memory are waited
        for here, or put in `in_flight` for the caller to wait for before the masters are written again."""
        if buffers.master_aliases_params:
            return
        if self.layout.shard_count == 1:
            pending = [publish_master(buffers.param_flat, buffers.master)]
        else:
            pending = []
            for bucket in buffers.layout.buckets:
                lo, hi = bucket.owner_range(self.shard_rank)
                master = buffers.master.narrow(0, bucket.shard_start, bucket.shard_numel)
                pending.append(publish_master(buffers.param_flat[lo:hi], master))
        if in_flight is not None:
            in_flight.extend(pending)
        else:
            _wait(pending)

    def _gather_params(self) -> None:
        """All-gather every bucket of the parameter buffers in place (each rank wrote its own ranges)."""
        if self.layout.shard_count == 1:
            return
        handles = []
        for buffers in self.buffers:
            if buffers.master_aliases_params:
                continue
            for bucket in buffers.layout.buckets:
                lo, hi = bucket.owner_range(self.shard_rank)
                out = buffers.bucket_params(bucket.start, bucket.numel)
                handles.append(self.comm.all_gather(out, buffers.param_flat[lo:hi], async_op=True))
        for handle in handles:
            handle.wait()

    def zero_grad(self) -> None:
        self.finish_backward()
        for param in self.tracked_params():  # gradients left in .grad ([Note: gradients outside engine.backward])
            param.grad = None
        self.bystanders.clear()
        self.reducer.reset_window()
        self._copied.clear()
        self._got_grad.clear()
        self.gradients_tier.reset()

    # -- state -----------------------------------------------------------------------------------
    def checkpoint_state(self) -> ShardedState:
        from zeroshard.zero.flat.checkpoint import FlatState

        return FlatState(self)

    @contextmanager
    def gathered(self) -> Iterator[None]:
        yield  # parameters are always whole in stages 0-2

    def tracked_params(self) -> list[nn.Parameter]:
        return [p for b in self.buffers for p in b.params]

    def offloadable(self) -> dict[str, list[torch.Tensor]]:
        copies = zip(self._grad_copies, self.buffers, strict=True)
        return {
            "optim_states": optimizer_state_tensors(self.optimizer),
            "hp_params": [b.master for b in self.buffers if not b.master_aliases_params],
            "lp_params": [b.param_flat for b in self.buffers],
            "lp_grads": [b.grad_full if b.grad_full is not None else b.grad_shard for b in self.buffers]
            + [g for g, b in copies if g is not None and g is not b.grad_shard],
        }

    def show_params(self, away: bool, host_view: HostView | None = None) -> None:
        for b in self.buffers:
            b.show_params(away, host_view)

    def release_buffers(self) -> None:
        self.pool.clear()

    @property
    def trainable_numel(self) -> int:
        return self.layout.unpadded_numel

    def destroy(self) -> None:
        OWNERS.unregister(self.tracked_params())
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.store.close()  # removes the swap files
        self.pool.clear()

    def memory(self) -> StrategyMemory:
        memory = StrategyMemory(comm_buffers=self.pool.held_bytes)
        for b in self.buffers:  # as held now: 0 for what offload_states() moved ([Note: offloaded states])
            memory.params += held(b.param_flat)
            full = b.grad_full
            inside = full is not None and b.grad_shard.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
            memory.gradients += held(full) + (0 if inside else held(b.grad_shard))
        masters = sum(0 if b.master_aliases_params else held(b.master) for b in self.buffers)
        state = sum(held(t) for t in optimizer_state_tensors(self.optimizer))
        self.policy.master_tier.count_state(memory, masters, state)
        copies = zip(self._grad_copies, self.buffers, strict=True)
        self.gradients_tier.count(memory, sum(0 if g is b.grad_shard else held(g) for g, b in copies))
        return memory


def _wait(events: list[Any]) -> None:
    """[Note: publishing a host master to the GPU]: none outlives the step."""
    for event in events:
        if event is not None:
            event.synchronize()


def _tied_copy(buffers: GroupBuffers, slot: Any) -> bool:
    """A pipeline stage's copy of a weight tied to a lower stage's ([Note: tied copies in the norm]): marked
    with DeepSpeed's attribute (deepspeed.runtime.constants.PIPE_REPLICATED)."""
    return bool(getattr(buffers.params[slot.index], PIPE_REPLICATED, False))


def _remove_all(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
