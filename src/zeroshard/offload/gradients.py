"""Where a reduced gradient shard waits for the optimizer step: one object per strategy, from the master's tier.

[Note: gradients to the host during backward]
The optimizer steps fp32 masters on the master tier. A gradient shard that is already fp32 on that device is
used in place. Otherwise, with the master in host memory (`offload_optimizer.device: "cpu"`), each shard's
fp32 host copy is filled as soon as its reduction is final on the accumulation boundary (on CUDA on a side
stream, into pinned memory), so the step finds it there; a copy that was not refreshed in backward is made at
the step. On the device, and with NVMe, a temporary is made per step chunk instead (no resident copy).

[Note: a gradient shard leaves once its host copy holds it]
Stage 3 then has no use for the device shard until the next window: as DeepSpeed, which keeps only its reduce
bucket on the GPU with the optimizer offloaded, the unit releases the shard's memory right after the boundary's copy
is queued (`ShardedUnit.hand_grad_to_copy`; with accumulation the shard still collects the window's earlier
micro-steps on the device). The step needs two things from it first: its norm for clipping and its inf/nan evidence
(max |x|, which nan propagates), taken by `let_go` on the compute stream before the memory goes and combined at the
step in the order the norm sums them (`norms`: a released shard's record, any other shard read as before), so the
clipping scale is the same to the bit. On CUDA the copy may still be reading the shard on the side stream: the
caching allocator is told (`record_stream`) and keeps the block from reuse until that copy is done. `full_grad`
reads the copy (after the side stream's copies have landed; fp32 of a bf16 value is exact); a further backward into
the same window gets the shard back from it (`ShardedUnit.grad_resident`). With gradient accumulation the shard
collects the window's earlier micro-steps on the device and leaves at the boundary.

[Note: gradients on NVMe]
With the optimizer state on NVMe, stage 3's gradient shards go there too, each written as soon as its unit's
reduction finishes (at most MAX_PENDING_WRITES in memory); their norms and inf/nan flags are taken on the
accumulation boundary right before the write, so the step computes the clipping scale without reading them
back, then reads them chunk by chunk with the optimizer state.

[Note: setting a gradient]
DeepSpeed's `safe_set_full_grad` / `safe_set_local_grad` / `safe_update_full_grad_vectorized` replace a parameter's
reduced gradient between the boundary's backward and the step (gradient surgery: masking rows of an embedding,
clipping one layer). The value is in `safe_get_full_grad`'s terms (averaged over ranks, unscaled); the shards hold
sums that the step multiplies by its scale, so this rank's elements are divided by that scale and rounded to the
shard's dtype (wherever they are written: the same value on every tier), then written where the step will read them:
the shard itself; a stage-3 shard released into its host copy stays released and the copy takes the values (still
`grad_copy_ready`); a shard on NVMe is read in, written and written back. Whatever else the step would have read
goes: a host copy that stages 1-2 made in backward is made again at the step, and the boundary record that stands
for a released or swapped-out shard is taken again from the new values (`rewritten`), so the clipping norm and the
inf/nan check see them. Reading the value back gives it exactly when the division is exact in the shard's dtype
(a power-of-two scale: world size and gradient_predivide_factor powers of two; bf16 gradients hold bf16 values).
Refused where no reduced gradient exists yet: stages 0-1 before their window's reduction (mid-window, or with
caller-owned windows, which `step()` reduces), and with super_offload between the boundary's backward and the step
(its optimizer steps ran in that backward: [Note: speculative host steps]).

[Note: publishing a host master to the GPU]
With the optimizer offloaded and the compute parameters on the GPU, `param.copy_(master)` (fp32 host -> bf16
device) makes torch cast on the host into a pageable temporary and copy that synchronously: an extra pass
over host memory and a slow, blocking transfer per unit or bucket (issue 13's optimizer-offload row spent ~1.6 s of
a 3.9 s step outside Adam and the gradient copies). From a pinned master the fp32 values go over
asynchronously instead and are cast on the GPU (twice the bytes over PCIe at full DMA speed, no host
pass, nothing blocks; one unit's fp32 temporary on the GPU). Rounding to bf16 is the same on either side.
The host must not write the master again before that copy has read it: the returned event is waited on before
the step returns (stage 3: `ShardedUnit.wait_published`, a sub-group's copies running while the next sub-group's
Adam does; stages 1-2: a group's copies run while the next group's Adam does, all waited for at the step's end,
except that a group whose master goes back to NVMe after its step waits for its own first), so no copy outlives the
step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from zeroshard.memory import StrategyMemory
from zeroshard.offload.residency import Residency
from zeroshard.offload.tier import Tier
from zeroshard.precision.loss_scaler import has_inf_or_nan
from zeroshard.zero.stepmath import tensor_norms

MAX_PENDING_WRITES = 2


@dataclass(frozen=True)
class GradShard:
    """A strategy's gradient shard as the tier sees it: its swap key, the tensor, whether it gets gradients."""

    key: str
    shard: torch.Tensor
    trainable: bool = True


@dataclass(frozen=True)
class BoundaryStats:
    """What the step needs of a gradient shard that leaves memory before it ([Note: gradients on NVMe], [Note: a
    gradient shard leaves once its host copy holds it]): its fp32 norm and, when overflow is checked, its largest
    magnitude (a device tensor, read at the step: no host sync per shard during backward)."""

    norms: list[torch.Tensor]  # as `tensor_norms` gives them: none for an empty shard (a frozen unit's)
    peak: torch.Tensor | None

    @staticmethod
    def of(shard: torch.Tensor, check_overflow: bool) -> BoundaryStats:
        overflow = check_overflow and shard.numel() > 0
        peak = torch._foreach_norm([shard], ord=float("inf"))[0].float() if overflow else None
        return BoundaryStats(tensor_norms([shard]), peak)

    @staticmethod
    def any_overflow(records: Sequence[BoundaryStats]) -> bool:
        peaks = [r.peak for r in records if r.peak is not None]
        return bool(peaks) and not bool(torch.isfinite(torch.stack(peaks)).all())


def released(shard: torch.Tensor) -> bool:
    """Whether a gradient shard's memory was released (after its host copy, or between windows)."""
    return shard.numel() > 0 and shard.untyped_storage().nbytes() == 0


def copy_aside(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
    """dst := src; on CUDA (a `stream` given) asynchronously on that side stream, after the work already queued
    on the current stream (`landed()` before the host reads `dst`)."""
    if stream is None:
        dst.copy_(src)
        return
    stream.wait_stream(torch.cuda.current_stream(src.device))
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)


def publish_master(dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event | None:
    """dst (the compute parameters) := src (an updated master): from pinned host memory to the GPU asynchronously,
    cast on the GPU, returning the event to wait on before `src` is written again ([Note: publishing a host
    master to the GPU]). A GPU master into a host shard (partial offload with offload_param) is cast on the GPU
    (half the bytes cross for bf16; no pass on the host), asynchronously into pinned memory: then its event must
    be waited on before the host reads `dst`. Any other pair of devices copies at once and returns None."""
    if src.is_cuda and dst.device.type == "cpu":
        dst.copy_(src.to(dst.dtype), non_blocking=dst.is_pinned())
        return _recorded() if dst.is_pinned() else None
    if not (dst.is_cuda and src.device.type == "cpu" and src.is_pinned()):
        dst.copy_(src)
        return None
    if src.dtype == dst.dtype:
        dst.copy_(src, non_blocking=True)
    else:
        staged = torch.empty(src.shape, dtype=src.dtype, device=dst.device)
        staged.copy_(src, non_blocking=True)
        dst.copy_(staged)  # the cast, on the GPU, in stream order after the copy
    return _recorded()


def _recorded() -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record()
    return event


class GradientTier:
    """Gradients kept in memory; the optimizer gets the shard itself or a per-step fp32 temporary."""

    # whether this tier keeps gradient shards in a store of its own (swap files): if not, stage 3 frees them between
    # steps ([Note: gradient shards exist from reduction to step]), and from a host copy's boundary on
    holds_shards = False

    def __init__(self, tier: Tier, copy_stream: torch.cuda.Stream | None, check_overflow: bool):
        self.tier = tier
        self.copy_stream = copy_stream
        self.check_overflow = check_overflow  # fp16 (and bf16 with check_grad_overflow): inf/nan flags wanted
        self._stats: dict[str, BoundaryStats] = {}  # of shards that left memory before the step, by key

    def copy_for(self, shard: torch.Tensor, master: torch.Tensor) -> torch.Tensor | None:
        """The tensor (in the master's dtype: fp32, or bf16 with [Note: bf16 master weights]) the optimizer reads
        `shard`'s gradients from: the shard itself when it has that dtype on the master's device, else a resident
        copy on this tier, or None (a temporary at each step)."""
        if shard.dtype == master.dtype and shard.device == master.device:
            return shard
        return None

    def part_for(self, key: str, master_tier: Tier) -> GradientTier:
        """The tier that handles gradient shard `key`, whose master lives on `master_tier` (stage 3): this one,
        unless the masters are split ([Note: partial offload])."""
        return self

    def place(self, slot: GradShard) -> None:
        """`slot.shard` is a gradient shard this tier keeps between its reduction and the step (stage 3)."""

    def received(self, slot: GradShard, copy: torch.Tensor | None, boundary: bool) -> bool:
        """`slot.shard` (or a slice of it) is final for this micro-step; returns whether `copy` now holds it."""
        return False

    def let_go(self, slot: GradShard) -> None:
        """`slot.shard`'s values are in its copy (`received` said so) and stage 3 is about to release its memory:
        its norm and inf/nan evidence are recorded for the step ([Note: a gradient shard leaves once its host copy
        holds it])."""
        self._stats[slot.key] = BoundaryStats.of(slot.shard, self.check_overflow)

    def recorded(self, key: str) -> BoundaryStats | None:
        """The boundary record `let_go` took of shard `key` in this window, if any."""
        return self._stats.get(key)

    def rewritten(self, slot: GradShard) -> None:
        """`slot.shard` (resident) got new values after the boundary ([Note: setting a gradient]): a record taken of
        the old ones is taken again."""
        if slot.key in self._stats:
            self._stats[slot.key] = BoundaryStats.of(slot.shard, self.check_overflow)

    def finish_backward(self) -> None:
        """Every shard of this backward was `received`: nothing is left in flight to the tier."""

    def landed(self) -> None:
        """Before the step reads the copies: those made during backward have arrived."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    def reset(self) -> None:
        """After the step (or zero_grad): no boundary statistics are kept."""
        self._stats.clear()

    @staticmethod
    def for_step(
        shard: torch.Tensor, master: torch.Tensor, copy: torch.Tensor | None, ready: bool, scale: float
    ) -> torch.Tensor:
        """The fp32 gradient the optimizer applies to `master`: `shard` times `scale`, in `copy` when there is one
        (refreshed here unless backward did), else in place (fp32 on the master's device) or in a temporary."""
        if copy is shard:
            if scale != 1.0:
                shard.mul_(scale)
            return shard
        if copy is None:
            copy = shard.to(device=master.device, dtype=master.dtype)
        elif not ready:
            copy.copy_(shard)
        if scale != 1.0:
            copy.mul_(scale)
        return copy

    def norms(
        self, slots: Sequence[GradShard], prepare: Callable[[], None], with_norms: bool = True
    ) -> tuple[list[torch.Tensor], bool]:
        """Per-shard fp32 norms (in `slots` order, empty shards left out; none without `with_norms`:
        zero_optimization.compute_grad_norm false) and this rank's inf/nan flag: a shard released after its host copy
        counts by its boundary record (`let_go`); `prepare` makes one without a record resident again (it reads it
        back from the copy)."""
        if any(released(s.shard) and self.recorded(s.key) is None for s in slots):
            prepare()
        norms: list[torch.Tensor] = []
        held: list[torch.Tensor] = []
        records: list[BoundaryStats] = []
        for s in slots:
            record = self.recorded(s.key) if released(s.shard) else None
            if record is None:
                norms += tensor_norms([s.shard]) if with_norms else []
                held.append(s.shard)
            else:
                norms += record.norms
                records.append(record)
        return norms, self.check_overflow and (has_inf_or_nan(held) or BoundaryStats.any_overflow(records))

    def count(self, memory: StrategyMemory, copies: int) -> None:
        self.tier.count_grad_copies(memory, copies)


class StepTimeCopies(GradientTier):
    """The compute device: gradients stay where they were reduced (see the base class)."""


class BackwardCopies(GradientTier):
    """Host memory: each shard's fp32 host copy is refreshed as soon as the shard is final on the boundary; stage 3
    then releases the shard ([Note: a gradient shard leaves once its host copy holds it])."""

    def copy_for(self, shard: torch.Tensor, master: torch.Tensor) -> torch.Tensor | None:
        same = super().copy_for(shard, master)
        return same if same is not None else self.tier.zeros(shard.numel(), master.dtype)

    def received(self, slot: GradShard, copy: torch.Tensor | None, boundary: bool) -> bool:
        if copy is None or copy is slot.shard or not boundary:
            return False
        copy_aside(copy, slot.shard, self.copy_stream)
        return True


class SplitGradients(GradientTier):
    """Partial offload ([Note: partial offload]): each gradient shard is handled as its sub-group's master tier
    wants, host copies during backward for the offloaded sub-groups, step-time temporaries for the others."""

    def __init__(self, tier: Tier, device: GradientTier, host: GradientTier):
        super().__init__(tier, host.copy_stream, host.check_overflow)
        self.device, self.host = device, host
        self._parts: dict[str, GradientTier] = {}

    def part_for(self, key: str, master_tier: Tier) -> GradientTier:
        part = self.host if master_tier.offloaded else self.device
        self._parts[key] = part
        return part

    def received(self, slot: GradShard, copy: torch.Tensor | None, boundary: bool) -> bool:
        return self._parts[slot.key].received(slot, copy, boundary)

    def let_go(self, slot: GradShard) -> None:
        self._parts[slot.key].let_go(slot)

    def recorded(self, key: str) -> BoundaryStats | None:
        return self._parts[key].recorded(key) if key in self._parts else None

    def rewritten(self, slot: GradShard) -> None:
        if slot.key in self._parts:
            self._parts[slot.key].rewritten(slot)

    def finish_backward(self) -> None:
        self.device.finish_backward()
        self.host.finish_backward()

    def reset(self) -> None:
        self.device.reset()
        self.host.reset()

    def count(self, memory: StrategyMemory, copies: int) -> None:
        self.host.count(memory, copies)  # resident fp32 copies exist for the offloaded sub-groups only


class SwappedGradients(GradientTier):
    """NVMe: shards `place`d here are written to the optimizer's swap files after each reduction, with their
    norms recorded on the boundary ([Note: gradients on NVMe]); the step reads them back chunk by chunk."""

    holds_shards = True  # their memory is the swap store's business

    def __init__(self, tier: Tier, copy_stream: torch.cuda.Stream | None, check_overflow: bool):
        super().__init__(tier, copy_stream, check_overflow)
        self.store: Residency = tier.residency
        self._placed: set[str] = set()
        self._writes: list[str] = []

    def place(self, slot: GradShard) -> None:
        """`slot.shard` lives in the swap files between its reduction and the step."""
        self._placed.add(slot.key)
        self.store.place(slot.key, [slot.shard])

    def received(self, slot: GradShard, copy: torch.Tensor | None, boundary: bool) -> bool:
        if slot.key not in self._placed:
            return False
        if boundary:
            self.let_go(slot)
        self.store.evict(slot.key)
        self._writes.append(slot.key)
        while len(self._writes) > MAX_PENDING_WRITES:
            self.store.settle(self._writes.pop(0))
        return False

    def finish_backward(self) -> None:
        for key in self._writes:
            self.store.settle(key)
        self._writes.clear()

    def norms(
        self, slots: Sequence[GradShard], prepare: Callable[[], None], with_norms: bool = True
    ) -> tuple[list[torch.Tensor], bool]:
        """From the boundary's records; if one is missing (a backward outside the engine's accounting), every
        placed shard is read back (`prepare` makes them resident first). Optimizer offload always has the norms
        (compute_grad_norm false refuses it: config/checks.py)."""
        if not any(s.key in self._placed for s in slots):
            return super().norms(slots, prepare)
        if all(s.key in self._stats or not s.trainable for s in slots):
            norms, records = [], []
            for s in slots:
                record = self._stats.get(s.key)
                if record is not None:
                    norms += record.norms
                    records.append(record)
                elif s.shard.numel():  # a frozen shard holds zeros
                    norms.append(torch.zeros((), device=s.shard.device))
            return norms, self.check_overflow and BoundaryStats.any_overflow(records)
        prepare()
        with self.store.resident([(s.key, s) for s in slots], lambda s: [s.shard]):
            return super().norms(slots, prepare)
