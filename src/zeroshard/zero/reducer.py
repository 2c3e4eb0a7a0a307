"""Gradient reduction for stages 0-2: per-parameter hooks feed buckets, buckets launch in a fixed order.

[Note: bucket launch order]
A bucket's collective is launched when all of its parameters' gradients have arrived *and* every
bucket before it in the layout's launch order has been launched. Ranks therefore issue the same
collectives in the same order even when a parameter receives no gradient on some rank (its bucket
simply waits for `finish_backward`, which launches what is left with the missing gradients as zero).

Stage 0/1 accumulate full gradients locally and reduce only on the accumulation boundary; stage 2
reduces every micro-step into the rank's gradient shard and keeps no full gradient: a bucket's
gradients are staged in a pooled buffer only while that bucket is being filled and communicated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.comm.collectives import Collectives, Handle
from zeroshard.errors import ZeroshardError
from zeroshard.zero.buffers import BufferPool, GroupBuffers
from zeroshard.zero.layout import Bucket, FlatLayout

MAX_INFLIGHT = 2


@dataclass(frozen=True)
class ReducePolicy:
    partition_grads: bool  # stage 2: reduce every micro-step into the shard, keep no full gradients
    comm_dtype: torch.dtype
    overlap: bool  # launch asynchronously from the hooks (otherwise synchronously, still in bucket order)
    use_reduce_scatter: bool  # false: all-reduce and keep the owned slice (DeepSpeed's `reduce_scatter: false`)
    prescale: float  # multiply gradients by this before communicating (1 / gradient_predivide_factor)


@dataclass
class _Inflight:
    handle: Handle
    finish: Callable[[], None]
    bucket: Bucket


class GradientReducer:
    """Owns the gradient hooks of one ZeRO optimizer and the collectives they trigger."""

    def __init__(
        self,
        layout: FlatLayout,
        groups: list[GroupBuffers],
        comm: Collectives,
        policy: ReducePolicy,
        pool: BufferPool,
        shard_rank: int,
        sync_decider: Callable[[], bool],
    ):
        self.layout = layout
        self.groups = groups
        self.comm = comm
        self.policy = policy
        self.pool = pool
        self.shard_rank = shard_rank
        self.sync_decider = sync_decider  # used when a backward starts without begin_backward()
        self._order = layout.buckets_in_launch_order
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._active = False
        self._sync = False
        self._missing: dict[int, int] = {}
        self._seen: set[tuple[int, int]] = set()
        self._next = 0
        self._inflight: list[_Inflight] = []
        self._staging: dict[int, torch.Tensor] = {}
        self._first_window_step = True  # stage 2: the shard still holds zeros; reduce straight into it
        # called with each bucket once its slice of the gradient shard is final for this micro-step
        self.on_reduced: Callable[[Bucket], None] | None = None

    # -- hooks -----------------------------------------------------------------------------------
    def register_hooks(self) -> None:
        for g, buffers in enumerate(self.groups):
            for s, slot in enumerate(buffers.layout.slots):
                param = buffers.params[slot.index]
                self._hooks.append(param.register_post_accumulate_grad_hook(self._make_hook(g, s)))

    def _make_hook(self, group: int, slot: int) -> Callable[[nn.Parameter], None]:
        def hook(param: nn.Parameter) -> None:
            self.on_grad_ready(group, slot, param)

        return hook

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # -- one backward pass -----------------------------------------------------------------------
    def begin_backward(self, sync: bool) -> None:
        """Start a micro-step's backward; `sync` says whether its gradients are communicated."""
        self._active = True
        self._sync = sync
        self._missing = {b.id: len(b.slots) for b in self._order}
        self._seen.clear()
        self._next = 0

    def on_grad_ready(self, group: int, slot_index: int, param: nn.Parameter) -> None:
        if not self._active:
            self.begin_backward(self.sync_decider())
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        buffers = self.groups[group]
        slot = buffers.layout.slots[slot_index]
        bucket = self._bucket(group, slot.bucket)
        first_time = (group, slot_index) not in self._seen
        if not first_time and self._sync and self._launched(bucket):
            raise ZeroshardError(
                f"gradient of {slot.name!r} arrived twice in one backward after its bucket was communicated; "
                "use non-reentrant activation checkpointing or call engine.backward once per micro-step"
            )
        self._accumulate(buffers, bucket, slot.offset, slot.numel, grad)
        if first_time and self._sync:
            self._seen.add((group, slot_index))
            self._missing[bucket.id] -= 1
            self._launch_ready()

    def finish_backward(self) -> None:
        """Launch what the hooks did not, wait for every collective, and finish the micro-step."""
        if not self._active:
            return
        if self._sync:
            while self._next < len(self._order):
                self._launch(self._order[self._next])
                self._next += 1
            self.wait_all()
            if self.policy.partition_grads:
                self._first_window_step = False
        self._active = False

    def wait_all(self) -> None:
        for item in self._inflight:
            self._complete(item)
        self._inflight.clear()

    def reset_window(self) -> None:
        """After an optimizer step (or zero_grad): gradient accumulators start again from zero."""
        for buffers in self.groups:
            if buffers.grad_full is not None:
                buffers.grad_full.zero_()
            if buffers.grad_shard is not buffers.grad_full:
                buffers.grad_shard.zero_()
        self._first_window_step = True

    # -- internals -------------------------------------------------------------------------------
    def _bucket(self, group: int, bucket_id: int) -> Bucket:
        bucket = self._order[bucket_id]  # build_layout numbers buckets by launch position
        assert bucket.id == bucket_id and bucket.group == group
        return bucket

    def _launched(self, bucket: Bucket) -> bool:
        return bucket.id < self._next

    def _accumulate(self, buffers: GroupBuffers, bucket: Bucket, offset: int, numel: int, grad: torch.Tensor) -> None:
        flat_grad = grad.reshape(-1)
        if buffers.grad_full is not None:
            buffers.grad_full.narrow(0, offset, numel).add_(flat_grad)
            return
        staging = self._staging.get(bucket.id)
        if staging is None:
            staging = self.pool.acquire(bucket.numel, self.policy.comm_dtype)
            self._staging[bucket.id] = staging
        staging.narrow(0, offset - bucket.start, numel).add_(flat_grad)

    def _launch_ready(self) -> None:
        while self._next < len(self._order) and self._missing[self._order[self._next].id] == 0:
            self._launch(self._order[self._next])
            self._next += 1
            # finish older collectives as new ones start: their staging buffers go back to the pool during
            # backward, so stage 2 never holds more than MAX_INFLIGHT buckets' worth of full gradients
            while len(self._inflight) > MAX_INFLIGHT:
                self._finish_oldest()
        if not self.policy.overlap:
            self.wait_all()

    def _finish_oldest(self) -> None:
        self._complete(self._inflight.pop(0))

    def _complete(self, item: _Inflight) -> None:
        item.handle.wait()
        item.finish()
        if self.on_reduced is not None:
            self.on_reduced(item.bucket)

    def _launch(self, bucket: Bucket) -> None:
        buffers = self.groups[bucket.group]
        if self.policy.partition_grads:
            self._launch_partitioned(buffers, bucket)
        else:
            self._launch_full(buffers, bucket)

    def _source_in_comm_dtype(self, source: torch.Tensor) -> tuple[torch.Tensor, bool]:
        if source.dtype == self.policy.comm_dtype:
            return source, False
        staged = self.pool.acquire(source.numel(), self.policy.comm_dtype)
        staged.copy_(source)
        return staged, True

    def _launch_full(self, buffers: GroupBuffers, bucket: Bucket) -> None:
        """Stage 0/1: the bucket's accumulated full gradients are reduced (into the shard for stage 1)."""
        assert buffers.grad_full is not None
        source = buffers.grad_full.narrow(0, bucket.start, bucket.numel)
        send, staged = self._source_in_comm_dtype(source)
        if self.policy.prescale != 1.0:
            send.mul_(self.policy.prescale)
        sharded = self.layout.shard_count > 1
        if not sharded or not self.policy.use_reduce_scatter:
            handle = self.comm.all_reduce(send, async_op=self.policy.overlap)

            def finish_all_reduce() -> None:
                if sharded:
                    lo, _ = bucket.owner_range(self.shard_rank)
                    target = buffers.grad_shard.narrow(0, bucket.shard_start, bucket.shard_numel)
                    target.copy_(send.narrow(0, lo - bucket.start, bucket.shard_numel))
                elif staged:
                    source.copy_(send)
                if staged:
                    self.pool.release(send)

            self._inflight.append(_Inflight(handle, finish_all_reduce, bucket))
            return
        target = buffers.grad_shard.narrow(0, bucket.shard_start, bucket.shard_numel)
        out = target if target.dtype == send.dtype else self.pool.acquire(bucket.shard_numel, send.dtype)
        handle = self.comm.reduce_scatter(out, send, async_op=self.policy.overlap)

        def finish_reduce_scatter() -> None:
            if out is not target:
                target.copy_(out)
                self.pool.release(out)
            if staged:
                self.pool.release(send)

        self._inflight.append(_Inflight(handle, finish_reduce_scatter, bucket))

    def _launch_partitioned(self, buffers: GroupBuffers, bucket: Bucket) -> None:
        """Stage 2: reduce-scatter the staged bucket and add this rank's slice into its gradient shard."""
        staging = self._staging.pop(bucket.id, None)
        if staging is None:  # no parameter of this bucket got a gradient on this rank
            staging = self.pool.acquire(bucket.numel, self.policy.comm_dtype)
        if self.policy.prescale != 1.0:
            staging.mul_(self.policy.prescale)
        target = buffers.grad_shard.narrow(0, bucket.shard_start, bucket.shard_numel)
        if not self.policy.use_reduce_scatter:
            handle = self.comm.all_reduce(staging, async_op=self.policy.overlap)
            lo, _ = bucket.owner_range(self.shard_rank)

            def finish_all_reduce() -> None:
                target.add_(staging.narrow(0, lo - bucket.start, bucket.shard_numel))
                self.pool.release(staging)

            self._inflight.append(_Inflight(handle, finish_all_reduce, bucket))
            return
        direct = self._first_window_step and target.dtype == staging.dtype
        out = target if direct else self.pool.acquire(bucket.shard_numel, staging.dtype)
        handle = self.comm.reduce_scatter(out, staging, async_op=self.policy.overlap)

        def finish_reduce_scatter() -> None:
            if not direct:
                target.add_(out)
                self.pool.release(out)
            self.pool.release(staging)

        self._inflight.append(_Inflight(handle, finish_reduce_scatter, bucket))
