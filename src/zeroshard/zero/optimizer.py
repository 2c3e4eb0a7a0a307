"""The ZeRO stage 0/1/2 optimizer: flat sharded master weights, reduced gradients, one step.

Stage 0 keeps everything replicated and all-reduces gradients; stage 1 shards master weights and
optimizer state (gradients still accumulate in full, then are reduce-scattered); stage 2 also
shards gradients, reduce-scattering them during every backward. After the step each rank writes
its updated shard into the parameter buffer and the buckets are all-gathered in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeroshard.comm.collectives import Collectives
from zeroshard.offload.nvme_store import InMemory, Residency
from zeroshard.offload.tier import Tier, copy_aside
from zeroshard.utils.logging import get_logger
from zeroshard.zero.buffers import BufferPool, GroupBuffers, build_group_buffers, cast_floating_buffers
from zeroshard.zero.layout import Bucket, FlatLayout, ParamSpec, build_layout
from zeroshard.zero.reducer import GradientReducer, ReducePolicy
from zeroshard.zero.stepmath import step_scale

logger = get_logger(__name__)


@dataclass(frozen=True)
class ZeroPolicy:
    """Everything the stage 0/1/2 optimizer needs to know, decided once from the config."""

    stage: int
    compute_dtype: torch.dtype
    grad_accum_dtype: torch.dtype
    comm_dtype: torch.dtype
    bucket_numel: int
    overlap_comm: bool
    use_reduce_scatter: bool
    prescale_gradients: bool
    gradient_predivide_factor: float
    gradient_clipping: float
    check_overflow: bool  # fp16: skip the step on every rank when any rank saw inf/nan
    master_tier: Tier | None = None  # where master weights and optimizer state live (None: the device)


@dataclass(frozen=True)
class StepOutcome:
    skipped: bool
    grad_norm: float | None


@dataclass(frozen=True)
class ParamGroupSpec:
    """A parameter group as the user gave it: hyperparameters and its (named) parameters."""

    options: dict[str, Any]
    params: list[tuple[str, nn.Parameter]]


def _optimizer_state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [
        v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0
    ]


class ZeroOptimizer:
    """Stage 0/1/2 state of one model on one rank. `step()` is the whole boundary step."""

    def __init__(
        self,
        module: nn.Module,
        groups: Sequence[ParamGroupSpec],
        policy: ZeroPolicy,
        comm: Collectives,
        device: torch.device,
        nvme: Callable[[], Residency] | None = None,
    ):
        self.module = module
        self.policy = policy
        self.comm = comm
        self.device = device
        self.rank = comm.rank
        self.world_size = comm.world_size
        shard_count = self.world_size if policy.stage >= 1 else 1
        self.shard_rank = self.rank if shard_count > 1 else 0  # which slice of every bucket this rank owns
        order = {id(p): i for i, p in enumerate(module.parameters())}
        specs = [[ParamSpec(name, p.numel(), order[id(p)]) for name, p in g.params] for g in groups]
        self.layout: FlatLayout = build_layout(specs, policy.bucket_numel, shard_count)
        self.group_options = [dict(g.options) for g in groups]
        self.buffers: list[GroupBuffers] = [
            build_group_buffers(
                layout,
                [p for _, p in g.params],
                self.shard_rank,
                policy.compute_dtype,
                policy.grad_accum_dtype,
                keep_full_grads=policy.stage < 2,
                device=device,
                master_tier=policy.master_tier,
            )
            for layout, g in zip(self.layout.groups, groups, strict=True)
        ]
        self._cast_untracked(module, {id(p) for g in groups for _, p in g.params})
        # offload_optimizer.device "nvme": each group's master shard and optimizer state live in swap files
        # between steps and are read in turn, one group ahead (nvme_store.in_turn)
        self.store: Residency = nvme() if nvme is not None else InMemory()
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
                prescale=1.0 / policy.gradient_predivide_factor if policy.prescale_gradients else 1.0,
            ),
            self.pool,
            self.shard_rank,
            sync_decider=lambda: True,
        )
        self.reducer.register_hooks()
        self.optimizer: torch.optim.Optimizer | None = None
        self._master_grads: list[torch.Tensor | None] = []
        # [Note: gradients to the host during backward] With optimizer offload the fp32 gradient copies live on
        # the host; each bucket's slice is copied as soon as its reduction is final on the accumulation
        # boundary (on CUDA on a side stream, into pinned memory), so the step finds them there. A slice
        # updated without a copy leaves the set, and the step copies that group itself.
        self.boundary_decider: Callable[[], bool] = lambda: True
        self._host_ready: set[int] = set()
        self._group_buckets = [{b.id for b in buffers.layout.buckets} for buffers in self.buffers]
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.host_copies_in_backward = 0  # groups whose step found the host gradients already copied
        self.reducer.on_reduced = self._grad_to_host

    # -- construction helpers --------------------------------------------------------------------
    def _cast_untracked(self, module: nn.Module, tracked: set[int]) -> None:
        """Frozen parameters and floating buffers follow the compute dtype, as DeepSpeed's module cast does."""
        dtype = self.policy.compute_dtype
        for param in module.parameters():
            if id(param) not in tracked and param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
        cast_floating_buffers(module, dtype)

    def master_param_groups(self) -> list[dict[str, Any]]:
        """torch-style groups over the flat master shards (one tensor per group), user options kept."""
        return [{**opts, "params": [b.master]} for opts, b in zip(self.group_options, self.buffers, strict=True)]

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Use `optimizer` (built over `master_param_groups()` or re-pointed at them) for the step."""
        self.optimizer = optimizer
        on_disk = not isinstance(self.store, InMemory)  # NVMe: a temporary per group at step time instead
        self._master_grads = [
            b.grad_shard
            if b.grad_shard.dtype == torch.float32 and b.grad_shard.device == b.master.device
            else None
            if on_disk
            else torch.zeros_like(b.master)
            for b in self.buffers
        ]

    # -- the step --------------------------------------------------------------------------------
    @property
    def post_scale(self) -> float:
        """Factor that turns the summed gradients into the mean over ranks."""
        if self.policy.prescale_gradients:
            return self.policy.gradient_predivide_factor / self.world_size
        return 1.0 / self.world_size

    def grad_shards(self) -> list[torch.Tensor]:
        return [b.grad_shard for b in self.buffers]

    def step(self, loss_scale: float = 1.0) -> StepOutcome:
        """Finish reductions, unscale, clip, step the optimizer on the shards and publish parameters."""
        assert self.optimizer is not None, "attach() an optimizer first"
        with torch.profiler.record_function("zeroshard.reduce_wait"):
            self.reducer.finish_backward()
        decided = step_scale(
            self.grad_shards(),
            self.comm,
            self.layout.shard_count > 1,
            self.post_scale,
            loss_scale,
            self.policy.gradient_clipping,
            self.policy.check_overflow,
            self.device,
        )
        if decided.overflow:
            self.zero_grad()
            return StepOutcome(skipped=True, grad_norm=None)
        if self._copy_stream is not None:
            self._copy_stream.synchronize()  # the gradient copies made during backward have landed
        with torch.profiler.record_function("zeroshard.optimizer_step"):
            # one group at a time (the same arithmetic as one call: the optimizers are elementwise per
            # tensor), so that with NVMe offload only the group being stepped is in memory
            for g in self.store.in_turn(self._keyed, self._group_tensors):
                self._step_group(g, decided.scale)
        with torch.profiler.record_function("zeroshard.all_gather_params"):
            self._gather_params()
        self.zero_grad()
        return StepOutcome(skipped=False, grad_norm=decided.grad_norm)

    def _grad_to_host(self, bucket: Bucket) -> None:
        """Reducer callback: `bucket`'s slice of the gradient shard is final for this micro-step."""
        if not self._master_grads:  # no optimizer attached yet
            return
        master_grad = self._master_grads[bucket.group]
        grad_shard = self.buffers[bucket.group].grad_shard
        if master_grad is None or master_grad is grad_shard:
            return
        if not self.boundary_decider():
            self._host_ready.discard(bucket.id)
            return
        src = grad_shard.narrow(0, bucket.shard_start, bucket.shard_numel)
        copy_aside(master_grad.narrow(0, bucket.shard_start, bucket.shard_numel), src, self._copy_stream)
        self._host_ready.add(bucket.id)

    def set_boundary_decider(self, decider: Callable[[], bool]) -> None:
        """`decider()` says, during a backward, whether it is the last micro-step before the optimizer step."""
        self.boundary_decider = decider

    def _step_group(self, g: int, scale: float) -> None:
        assert self.optimizer is not None
        buffers, master_grad = self.buffers[g], self._master_grads[g]
        if master_grad is buffers.grad_shard:
            if scale != 1.0:
                master_grad.mul_(scale)
        else:  # another dtype, or another tier (offload): copy (unless backward did), then scale there
            if master_grad is None:
                master_grad = torch.empty_like(buffers.master)
            if self._group_buckets[g] <= self._host_ready:
                self.host_copies_in_backward += 1
            else:
                master_grad.copy_(buffers.grad_shard)
            if scale != 1.0:
                master_grad.mul_(scale)
        buffers.master.grad = master_grad
        self.optimizer.step()
        buffers.master.grad = None
        self._write_owned(buffers)

    def _group_tensors(self, g: int) -> list[torch.Tensor]:
        master = self.buffers[g].master
        state = self.optimizer.state.get(master, {}) if self.optimizer is not None else {}
        return [master] + [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]

    @contextmanager
    def optimizer_state_resident(self) -> Iterator[None]:
        """Master weights and optimizer state in memory for the block (checkpoints, export); with NVMe
        offload they are read in first and written back after."""
        with self.store.resident(self._keyed, self._group_tensors):
            yield

    def publish_params(self) -> None:
        """Write each rank's updated master shard into the parameter views and all-gather every bucket."""
        with self.optimizer_state_resident():
            for buffers in self.buffers:
                self._write_owned(buffers)
        self._gather_params()

    def _write_owned(self, buffers: GroupBuffers) -> None:
        """This rank's ranges of the parameter buffer := its master shard."""
        if buffers.master_aliases_params:
            return
        if self.layout.shard_count == 1:
            buffers.param_flat.copy_(buffers.master)
            return
        for bucket in buffers.layout.buckets:
            lo, hi = bucket.owner_range(self.shard_rank)
            buffers.param_flat[lo:hi].copy_(buffers.master.narrow(0, bucket.shard_start, bucket.shard_numel))

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
        self.reducer.finish_backward()
        self.reducer.reset_window()
        self._host_ready.clear()

    # -- the strategy interface the engine uses (shared with stage 3) ----------------------------
    def begin_backward(self, sync: bool) -> None:
        self.reducer.begin_backward(sync)

    def finish_backward(self) -> None:
        self.reducer.finish_backward()

    def set_sync_decider(self, decider: Callable[[], bool]) -> None:
        self.reducer.sync_decider = decider

    def tracked_params(self) -> list[nn.Parameter]:
        return [p for b in self.buffers for p in b.params]

    def consolidated_params(self, dtype: torch.dtype) -> dict[int, torch.Tensor]:
        """Full fp32 master values of every trainable parameter, keyed by id(param), on every rank
        (collective: every rank must call it)."""
        with self.optimizer_state_resident():
            return self._consolidated_params(dtype)

    def _consolidated_params(self, dtype: torch.dtype) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        for buffers in self.buffers:
            layout = buffers.layout
            if layout.numel == layout.shard_numel:
                full = buffers.master.to(self.device)
            else:
                full = torch.zeros(layout.numel, dtype=torch.float32, device=self.device)
                for bucket in layout.buckets:
                    mine = buffers.master.narrow(0, bucket.shard_start, bucket.shard_numel).to(self.device)
                    self.comm.all_gather(full.narrow(0, bucket.start, bucket.numel), mine)
            for slot in layout.slots:
                param = buffers.params[slot.index]
                out[id(param)] = full.narrow(0, slot.offset, slot.numel).view(param.shape).to(dtype).clone()
        return out

    def offloadable_tensors(self) -> list[torch.Tensor]:
        """Master weights (unless they are the parameters themselves) and optimizer state."""
        out = [b.master for b in self.buffers if not b.master_aliases_params]
        copies = zip(self._master_grads, self.buffers, strict=True)
        out += [g for g, b in copies if g is not None and g is not b.grad_shard]
        return out + _optimizer_state_tensors(self.optimizer)

    @property
    def trainable_numel(self) -> int:
        return self.layout.unpadded_numel

    def destroy(self) -> None:
        self.reducer.remove_hooks()
        self.store.close()  # removes the swap files
        self.pool.clear()

    # -- introspection ---------------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        grads = 0
        for b in self.buffers:
            grads += nbytes(b.grad_full)
            if b.grad_shard is not b.grad_full:
                grads += nbytes(b.grad_shard)
        state = 0
        if self.optimizer is not None:
            for per_param in self.optimizer.state.values():
                state += sum(nbytes(v) for v in per_param.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        masters = sum(0 if b.master_aliases_params else nbytes(b.master) for b in self.buffers)
        copies = sum(
            0 if g is b.grad_shard else nbytes(g) for g, b in zip(self._master_grads, self.buffers, strict=True)
        )
        offloaded = self.policy.master_tier is not None and self.policy.master_tier.offloaded
        on_disk = not isinstance(self.store, InMemory)  # NVMe: what is resident now (read for a step)
        return {
            "params_trainable": sum(nbytes(b.param_flat) for b in self.buffers),
            "gradients": grads,
            "master_weights": 0 if offloaded else masters,
            "optimizer_state": 0 if offloaded else state,
            "comm_buffers": self.pool.held_bytes + (0 if offloaded else copies),
            "host_master_weights": masters if offloaded and not on_disk else 0,
            "host_optimizer_state": self.store.resident_bytes if on_disk else (state if offloaded else 0),
            "host_gradients": copies if offloaded else 0,
            "nvme_bytes": self.store.disk_bytes,
        }
