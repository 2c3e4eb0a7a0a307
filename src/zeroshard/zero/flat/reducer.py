"""Gradient reduction for stages 0-2: per-parameter hooks feed buckets, buckets launch in a fixed order.

[Note: bucket launch order]
A bucket's collective is launched when all of its parameters' gradients have arrived *and* every
bucket before it in the layout's launch order has been launched. Ranks therefore issue the same
collectives in the same order even when a parameter receives no gradient on some rank (its bucket
simply waits for `finish_backward`, which launches what is left with the missing gradients as zero).

Stage 0/1 accumulate full gradients locally and reduce only on the accumulation boundary; stage 2
reduces every micro-step into the rank's gradient shard and keeps no full gradient: a bucket's
gradients are staged in a pooled buffer only while that bucket is being filled and communicated.

[Note: a second backward]
A training loop may call `engine.backward` twice before one `engine.step` (a GAN's discriminator: real and
fake losses). The second backward's gradients add to the first's, as plain PyTorch and DeepSpeed's stage 0 do.
Stage 0 (and stage 1 without reduce-scatter) reduces the full accumulator in place, so after a window's first
reduction it holds the sum over ranks: reducing it again would count the first backward N times. Once a
window has been reduced, later gradients in it are therefore staged and reduced on their own, and the result is
added into the gradient shard, as stage 2 does every micro-step.

[Note: gradients after their bucket's reduction]
A parameter's gradient can arrive again in the same backward after its bucket was launched: a weight tied to
another whose share comes later (an embedding tied to lm_head under a tiled loss, [Note: tiled compute]: the loss's
share arrives first, at its last slice, the embedding's at the end of backward), or a weight used by two
reentrant-checkpointed segments. Such a gradient is staged on its own, and when backward ends each bucket that got
one is reduced once more, in launch order, the result added into the gradient shard as [Note: a second backward]
adds. The ranks must see the same late arrivals, as they run the same model: a weight whose reuse depends on the
data (a branch taken on one rank only) would give the ranks different collectives, which hangs at stages 0-2 unless
`ZEROSHARD_VERIFY_COLLECTIVES=1` (then the mismatch is named: [Note: divergence check]). Tiled compute keeps its
arrivals rank-independent even when a slice skips a weight (`_HeldBack.release` in sequence/tiled.py). The cost is
one more reduction of those buckets, nothing when every gradient arrives once.

[Note: stage 1's shard inside its accumulator]
Stage 1's gradient shard (this rank's reduced slice of every bucket, concatenated: what the optimizer reads) has no
buffer of its own: it is the first `shard_numel` elements of the full accumulator. A reduced bucket's range of the
accumulator is scratch (the next window overwrites it, and gradients added after the reduction are staged: [Note: a
second backward]), so each bucket is reduce-scattered in place, into this rank's chunk of its own input (NCCL's
in-place form; gloo's reduce to the owner leaves the sum there), and when it finishes that chunk moves down to the
bucket's slice of the shard, [shard_start, shard_start + shard_numel). Within a group a bucket starts at N x its
shard_start, so the slice ends at or below the next bucket's start: it covers only buckets launched before or with
it, and a group's buckets launch in buffer order and finish oldest first, so nothing it overwrites is still to be
reduced. Until the window's reduction the shard's range holds the accumulation itself (`window_unreduced`): the
step then reads zeros (`settle`), as it did when the shard was a zeroed buffer of its own, and `full_grad` reads this
rank's own accumulation (`local_accumulation`), as DeepSpeed's reads its gradients then. This saves 4Ψ/N bytes per
rank (fp32 accumulation): stage 1's gradients are 4Ψ, not 4Ψ + 4Ψ/N.

[Note: stage 1's accumulator on demand]
The full accumulator is what stage 1 needs to reduce a window of several micro-steps once. A window of one backward
(`gradient_accumulation_steps` 1, windows the engine counts) needs none: its gradients are reduced as their buckets
fill, as stage 2 does, and only the shard is kept. DeepSpeed's stage 1 does the same on its boundary micro-step
(`reduce_ready_partitions_and_remove_grads`: the gradients become views of its reused contiguous bucket, the
partition is copied out), so at one micro-step per window it holds stage 2's gradient memory; ours held 4Ψ instead
of 4Ψ/N (fp32 accumulation): on a 124M GPT on 2 ranks 236 MiB more per rank, and a peak resident set 1.01-1.03x
DeepSpeed's ZeRO-1 (0.97x without the accumulator, same benchmark run, step time unchanged). So stage 1 starts
without the accumulator there, and allocates it (moving the shard to its front, as above) the first time a backward
does not communicate (inside `no_sync()`, after `set_gradient_accumulation_boundary(False)`): from then on it
accumulates as stage 1 always did. The reductions are the same collectives over the same values (a window's first
reduction lands in the zeroed shard), so the results are the same bits.

[Note: a bucket of one parameter reduces its own gradient]
A parameter larger than the bucket size gets a bucket of its own (an LLM's embedding and its lm_head: vocabulary x
hidden). Staging copied its gradient into a pooled buffer of the same size, which the pool then kept: on a 124M GPT
at stage 2 on 2 ranks, 147 MiB of the 238 MiB the pool held between steps (the tied embedding), and on a GPU the
caching allocator keeps such a block anyway. When the gradient fills the bucket exactly (no padding), is dense,
contiguous, owns its storage, is in the communication dtype, nothing but this reducer holds it (autograd handed it
over and the hook cleared `.grad`: a user hook that kept it would see its values change), and no other tensor shares
its memory (autograd hands a parameter used as `h + p.view(...)` a view of the add's gradient, which backward still
reads along `h`: reduced in place, `h`'s parameters got the other ranks' sums; found by review), the bucket
takes the gradient itself as its staging: reduced in place (it is scratch after), never pooled. Later arrivals in
the same backward add into it, as into a staging buffer. The values reduced are the same, so the results are too.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn

from zeroshard.comm.collectives import Collectives
from zeroshard.zero.flat.group_buffers import GroupBuffers
from zeroshard.zero.flat.local import local_grad
from zeroshard.zero.layout import Bucket, FlatLayout
from zeroshard.zero.pool import BufferPool, InflightQueue, wait_plain, zero_unwritten

MAX_INFLIGHT = 2


@dataclass(frozen=True)
class ReducePolicy:
    partition_grads: bool  # stage 2: reduce every micro-step into the shard, keep no full gradients
    comm_dtype: torch.dtype
    overlap: bool  # launch asynchronously from the hooks (otherwise synchronously, still in bucket order)
    use_reduce_scatter: bool  # false: all-reduce and keep the owned slice (DeepSpeed's `reduce_scatter: false`)
    prescale: float  # multiply gradients by this before communicating (StepPolicy.prescale)


class GradientReducer:
    """The collectives a flat strategy's gradients trigger. Each call returns the buckets whose slice of the
    gradient shard became final for this micro-step, for the strategy to hand to its gradient tier."""

    def __init__(
        self,
        layout: FlatLayout,
        groups: list[GroupBuffers],
        comm: Collectives,
        policy: ReducePolicy,
        pool: BufferPool,
        shard_rank: int,
    ):
        self.layout = layout
        self.groups = groups
        self.comm = comm
        self.policy = policy
        self.pool = pool
        self.shard_rank = shard_rank
        self._order = layout.buckets_in_launch_order
        for group in layout.groups:  # [Note: stage 1's shard inside its accumulator] relies on it
            starts = [b.start for b in self._order if b.group == group.group]
            assert starts == sorted(starts), "a group's buckets must launch in buffer order"
        self.active = False
        self._sync = False
        self._missing: dict[int, int] = {}
        self._seen: set[tuple[int, int]] = set()
        self._late: set[int] = set()  # buckets with gradients that arrived after their launch
        self._next = 0
        self._inflight: InflightQueue[Bucket] = InflightQueue(MAX_INFLIGHT if policy.overlap else 0, wait_plain)
        self._staging: dict[int, torch.Tensor] = {}
        self._adopted: set[int] = set()  # buckets whose staging is a gradient itself ([Note: a bucket of one ..])
        _sole_references()  # measured here, not first inside a backward hook
        self._written: dict[int, set[tuple[int, int]]] = {}  # per staged bucket: the (offset, numel) copied in
        self._first_window_step = True  # stage 2: the shard still holds zeros; reduce straight into it
        self._window_reduced = False  # stage 0/1: this window's gradients were reduced ([Note: a second backward])
        # stage 0/1: per bucket, the (offset, numel) of the full accumulator written in this window
        # ([Note: the full accumulator is not zero-filled per window])
        self._full_written: dict[int, set[tuple[int, int]]] = {b.id: set() for b in self._order}

    # -- one backward pass -----------------------------------------------------------------------
    def begin_backward(self, sync: bool) -> None:
        """Start a micro-step's backward; `sync` says whether its gradients are communicated."""
        self.active = True
        self._sync = sync or self._window_reduced  # gradients added after a reduction are reduced too
        if not self._sync and not self.policy.partition_grads:  # [Note: stage 1's accumulator on demand]
            for buffers in self.groups:
                if buffers.grad_full is None:
                    buffers.add_full_accumulator()
        self._missing = {b.id: len(b.slots) for b in self._order}
        self._seen.clear()
        self._late.clear()
        self._next = 0

    def on_grad_ready(self, group: int, slot_index: int, param: nn.Parameter) -> list[Bucket]:
        """A parameter's gradient was accumulated (its post-accumulate-grad hook)."""
        grad, refs = _take_grad(param)
        if grad is None:
            return []
        sole = refs == _sole_references() and _sole_storage(grad)  # [Note: a bucket of one parameter ..]
        param_grad, grad = grad, local_grad(param, grad)  # [Note: DTensor parameters]
        buffers = self.groups[group]
        slot = buffers.layout.slots[slot_index]
        bucket = self._bucket(group, slot.bucket)
        first_time = (group, slot_index) not in self._seen
        if not first_time and self._sync and self._launched(bucket):  # [Note: gradients after their bucket's ..]
            self._accumulate(buffers, bucket, slot.offset, slot.numel, grad, staged=True)
            self._late.add(bucket.id)
            return []
        self._accumulate(buffers, bucket, slot.offset, slot.numel, grad, adoptable=sole and grad is param_grad)
        if first_time and self._sync:
            self._seen.add((group, slot_index))
            self._missing[bucket.id] -= 1
            return self._launch_ready()
        return []

    def finish_backward(self) -> list[Bucket]:
        """Launch what the hooks did not, wait for every collective, and finish the micro-step."""
        if not self.active:
            return []
        done: list[Bucket] = []
        if self._sync:
            while self._next < len(self._order):
                done += self._launch(self._order[self._next])
                self._next += 1
            done += self._inflight.drain()
            for bucket in [b for b in self._order if b.id in self._late]:  # [Note: gradients after their bucket's ..]
                done += self._launch_partitioned(self.groups[bucket.group], bucket, late=True)
            done += self._inflight.drain()
            if self.policy.partition_grads:
                self._first_window_step = False
            else:
                self._window_reduced = True
        self.active = False
        return done

    def reset_window(self) -> None:
        """After an optimizer step (or zero_grad): gradient accumulators start again from zero (stages 0/1 lazily:
        [Note: the full accumulator is not zero-filled per window])."""
        for buffers in self.groups:
            if buffers.grad_full is None:
                buffers.grad_shard.zero_()  # stage 2 adds every micro-step's reduction into it
        for written in self._full_written.values():
            written.clear()
        self._first_window_step = True
        self._window_reduced = False

    def settle(self) -> None:
        """[Note: the full accumulator is not zero-filled per window]
        Stages 0/1 used to zero their full gradient accumulator (and stage 1 its gradient shard) after every step:
        a write of the whole model's gradients, and every first gradient then added to zeros. Now a gradient's first
        arrival in a window is copied into the accumulator, a bucket's ranges no gradient wrote are zeroed right
        before its reduction, and the stage-1 shard is overwritten by the window's first reduce-scatter. Before
        anything reads the buffers outside a reduction (the optimizer step, `full_grad`), this makes a window that
        reduced nothing read as zeros, as it did when they were zero-filled. The stage-1 shard is the front of the
        accumulator ([Note: stage 1's shard inside its accumulator]): zeroing it ends the window's accumulation, so
        only the step calls this then (`full_grad` reads the accumulation itself)."""
        if self.active or self._window_reduced:
            return
        for bucket in self._order:
            buffers = self.groups[bucket.group]
            if buffers.grad_full is None:
                continue
            self._zero_unwritten_full(buffers, bucket)
            if buffers.grad_shard is not buffers.grad_full:
                buffers.grad_shard.narrow(0, bucket.shard_start, bucket.shard_numel).zero_()

    def local_accumulation(self, group: int, offset: int, numel: int) -> torch.Tensor:
        """Elements [offset, offset + numel) of `group`'s full accumulator as this window has written them so far
        (zero where no gradient arrived yet: [Note: the full accumulator is not zero-filled per window]), in fp32;
        before the window's reduction (`window_unreduced`)."""
        full = self.groups[group].grad_full
        assert full is not None
        out = torch.zeros(numel, dtype=torch.float32, device=full.device)
        for bucket in (b for b in self._order if b.group == group):
            for start, length in self._full_written[bucket.id]:
                lo, hi = max(start, offset), min(start + length, offset + numel)
                if lo < hi:
                    out[lo - offset : hi - offset].copy_(full[lo:hi])
        return out

    @property
    def window_unreduced(self) -> bool:
        """Stages 0-1 hold this window's gradients unreduced in the full accumulator (before the boundary's backward
        reduces them, or `step()` with caller-owned windows): no rank holds a reduced gradient yet."""
        return not self._window_reduced and any(b.grad_full is not None for b in self.groups)

    def _zero_unwritten_full(self, buffers: GroupBuffers, bucket: Bucket) -> None:
        assert buffers.grad_full is not None
        written = [(offset - bucket.start, numel) for offset, numel in self._full_written[bucket.id]]
        zero_unwritten(buffers.grad_full.narrow(0, bucket.start, bucket.numel), written)

    # -- internals -------------------------------------------------------------------------------
    def _bucket(self, group: int, bucket_id: int) -> Bucket:
        bucket = self._order[bucket_id]  # build_layout numbers buckets by launch position
        assert bucket.id == bucket_id and bucket.group == group
        return bucket

    def _launched(self, bucket: Bucket) -> bool:
        return bucket.id < self._next

    def _accumulate(
        self,
        buffers: GroupBuffers,
        bucket: Bucket,
        offset: int,
        numel: int,
        grad: torch.Tensor,
        staged: bool = False,
        adoptable: bool = False,
    ) -> None:
        if buffers.grad_full is not None and not self._window_reduced and not staged:
            written = self._full_written[bucket.id]
            target = buffers.grad_full.narrow(0, offset, numel)
        else:
            staging = self._staging.get(bucket.id)
            if staging is None and adoptable and self._fills(bucket, offset, numel, grad):
                self._staging[bucket.id] = grad.view(-1)  # [Note: a bucket of one parameter reduces its own ..]
                self._written[bucket.id] = {(offset, numel)}
                self._adopted.add(bucket.id)
                return
            if staging is None:  # [Note: staged gradients are copied, not added to zeros]
                staging = self.pool.acquire(bucket.numel, self.policy.comm_dtype, zero=False)
                self._staging[bucket.id] = staging
                self._written[bucket.id] = set()
            written = self._written[bucket.id]
            target = staging.narrow(0, offset - bucket.start, numel)
        flat_grad = grad.reshape(-1)
        target.add_(flat_grad) if (offset, numel) in written else target.copy_(flat_grad)
        written.add((offset, numel))

    def _fills(self, bucket: Bucket, offset: int, numel: int, grad: torch.Tensor) -> bool:
        """Whether `grad` can be `bucket`'s staging itself ([Note: a bucket of one parameter reduces its own ..])."""
        whole = offset == bucket.start and numel == bucket.numel and len(bucket.slots) == 1
        return (
            whole
            and grad.dtype == self.policy.comm_dtype
            and grad.device == self.pool.device
            and grad.is_contiguous()
            and grad.storage_offset() == 0
            and grad.untyped_storage().nbytes() == numel * grad.element_size()
        )

    def _launch_ready(self) -> list[Bucket]:
        done: list[Bucket] = []
        while self._next < len(self._order) and self._missing[self._order[self._next].id] == 0:
            done += self._launch(self._order[self._next])
            self._next += 1
        return done

    def _launch(self, bucket: Bucket) -> list[Bucket]:
        """Start `bucket`'s collective; returns the buckets finished to keep [Note: bounded in-flight reductions]
        (all of them without overlap_comm, which waits for each collective in launch order)."""
        buffers = self.groups[bucket.group]
        if self.policy.partition_grads or self._window_reduced or buffers.grad_full is None:
            return self._launch_partitioned(buffers, bucket)
        return self._launch_full(buffers, bucket)

    def _source_in_comm_dtype(self, source: torch.Tensor) -> tuple[torch.Tensor, bool]:
        if source.dtype == self.policy.comm_dtype:
            return source, False
        staged = self.pool.acquire(source.numel(), self.policy.comm_dtype, zero=False)
        staged.copy_(source)
        return staged, True

    def _launch_full(self, buffers: GroupBuffers, bucket: Bucket) -> list[Bucket]:
        """Stage 0/1: the bucket's accumulated full gradients are reduced (into the shard for stage 1)."""
        assert buffers.grad_full is not None
        self._zero_unwritten_full(buffers, bucket)
        source = buffers.grad_full.narrow(0, bucket.start, bucket.numel)
        send, staged = self._source_in_comm_dtype(source)
        if self.policy.prescale != 1.0:
            send.mul_(self.policy.prescale)
        sharded = self.layout.shard_count > 1
        target = buffers.grad_shard.narrow(0, bucket.shard_start, bucket.shard_numel)
        lo, _ = bucket.owner_range(self.shard_rank)
        mine = send.narrow(0, lo - bucket.start, bucket.shard_numel)  # this rank's chunk of what is sent
        if not sharded or not self.policy.use_reduce_scatter:
            handle = self.comm.all_reduce(send, async_op=self.policy.overlap)

            def finish_all_reduce() -> None:
                if sharded:
                    self._place(target, mine)
                elif staged:
                    source.copy_(send)
                if staged:
                    self.pool.release(send)

            return self._inflight.push(handle, finish_all_reduce, bucket, "all-reduce")
        # in place, into this rank's chunk of its own input ([Note: stage 1's shard inside its accumulator]): the
        # full accumulator is scratch once reduced (later gradients of the window are staged, [Note: a second
        # backward], and the next window overwrites it), so gloo may reduce in place (no copy of the whole bucket)
        handle = self.comm.reduce_scatter(mine, send, async_op=self.policy.overlap, input_is_scratch=True)

        def finish_reduce_scatter() -> None:
            self._place(target, mine)
            if staged:
                self.pool.release(send)

        return self._inflight.push(handle, finish_reduce_scatter, bucket, "reduce-scatter")

    def _place(self, target: torch.Tensor, result: torch.Tensor) -> None:
        """target := result, where the two may be the same elements or overlap within the accumulator ([Note: stage
        1's shard inside its accumulator]: the slice moves down to its place in the shard)."""
        if result.data_ptr() == target.data_ptr() and result.dtype == target.dtype:
            return
        if not _overlap(target, result):
            target.copy_(result)
            return
        moved = self.pool.acquire(result.numel(), result.dtype, zero=False)
        moved.copy_(result)
        target.copy_(moved)
        self.pool.release(moved)

    def _drop(self, staging: torch.Tensor, pooled: bool) -> None:
        """A bucket's staging after its collective finished: back to the pool, or, a gradient the bucket took
        ([Note: a bucket of one ..]), freed where the current stream, which waited for the collective, is past it."""
        if pooled:
            self.pool.release(staging)
        elif staging.device.type == "cuda":
            staging.record_stream(torch.cuda.current_stream(staging.device))

    def _launch_partitioned(self, buffers: GroupBuffers, bucket: Bucket, late: bool = False) -> list[Bucket]:
        """Stage 2 (and stage 0/1 after a window's first reduction: [Note: a second backward]; `late`: [Note:
        gradients after their bucket's reduction]): reduce the staged bucket and add this rank's slice into its
        gradient shard."""
        staging = self._staging.pop(bucket.id, None)
        pooled = bucket.id not in self._adopted  # else the gradient itself, dropped after ([Note: a bucket of one ..])
        self._adopted.discard(bucket.id)
        if staging is None:  # no parameter of this bucket got a gradient on this rank
            staging = self.pool.acquire(bucket.numel, self.policy.comm_dtype)
        else:
            zero_unwritten(staging, [(offset - bucket.start, n) for offset, n in self._written.pop(bucket.id)])
        if self.policy.prescale != 1.0:
            staging.mul_(self.policy.prescale)
        target = buffers.grad_shard.narrow(0, bucket.shard_start, bucket.shard_numel)
        if not self.policy.use_reduce_scatter or self.layout.shard_count == 1:
            handle = self.comm.all_reduce(staging, async_op=self.policy.overlap)
            lo, _ = bucket.owner_range(self.shard_rank)

            def finish_all_reduce() -> None:
                target.add_(staging.narrow(0, lo - bucket.start, bucket.shard_numel))
                self._drop(staging, pooled)

            return self._inflight.push(handle, finish_all_reduce, bucket, "all-reduce")
        # the window's first reduction lands in the zeroed shard (stage 1 without its accumulator: [Note: stage 1's ..])
        first = self._first_window_step if self.policy.partition_grads else not self._window_reduced
        direct = first and not late and target.dtype == staging.dtype
        out = target if direct else self.pool.acquire(bucket.shard_numel, staging.dtype, zero=False)
        handle = self.comm.reduce_scatter(out, staging, async_op=self.policy.overlap, input_is_scratch=True)

        def finish_reduce_scatter() -> None:
            if not direct:
                target.add_(out)
                self.pool.release(out)
            self._drop(staging, pooled)

        return self._inflight.push(handle, finish_reduce_scatter, bucket, "reduce-scatter")


def _take_grad(param: nn.Parameter) -> tuple[torch.Tensor | None, int]:
    """`param.grad`, cleared, and the Python references to it as this function sees them: `_sole_references()` when
    nothing but this function holds it ([Note: a bucket of one parameter reduces its own gradient])."""
    grad = param.grad
    param.grad = None
    return grad, sys.getrefcount(grad)


@cache
def _sole_references() -> int:
    """What `_take_grad` counts for a gradient autograd accumulated and nothing else refers to, measured once in
    this interpreter (3 on CPython 3.11; 3.14 documents that borrowed local references may count fewer)."""
    probe = nn.Parameter(torch.zeros(1))
    with torch.enable_grad():
        (probe * 2).sum().backward()
    return _take_grad(probe)[1]


def _sole_storage(grad: torch.Tensor) -> bool:
    """No other tensor shares `grad`'s memory (a view, `.detach()`, `.data`): autograd hands a parameter that entered
    the graph through a view and an add (`h + p.view(...)`) a view of the add's output gradient, which backward still
    reads along the other path. Counted: `grad` and the storage object asked."""
    if type(grad) is not torch.Tensor or grad.layout != torch.strided or grad.requires_grad:
        return False  # a subclass (DTensor), a sparse gradient, one with a graph (create_graph)
    count = getattr(torch._C, "_storage_Use_Count", None)
    return count is not None and count(grad.untyped_storage()._cdata) == 2


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    return a.data_ptr() < b.data_ptr() + b.nbytes and b.data_ptr() < a.data_ptr() + a.nbytes
