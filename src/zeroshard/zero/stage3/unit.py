"""One unit's sharded and gathered forms, and the collectives that move between them.

[Note: gathered storage]
Each unit owns one full-size buffer in the compute dtype whose storage is resized to zero when the
unit is released and back when it is gathered again, always the same storage object. Autograd's saved
tensors that view the parameters (e.g. `weight.t()`) therefore stay valid: backward re-gathers into
the very memory they point to. While released, each parameter's `.data` is an empty placeholder, so
reading a released parameter gives an empty tensor rather than freed memory. One release is different: the end
of a pin (`GatheredParameters`, `state_dict()`'s gather, generation's), whose caller may keep the tensors it read
(DeepSpeed-Chat saves `p.data.cpu()`, which on the CPU is the buffer itself): there the unit hands the storage over
and takes a new, empty one, as DeepSpeed gathers into a new buffer each time; the old memory is freed as soon as
nothing holds it. A block between a forward and its backward costs memory: the forward's saved tensors keep the old
buffer until the backward, which gathers a new one (the unit held twice meanwhile; the gradients are the same). No
bookkeeping tells reliably whether a backward will come (an evaluation forward with grad never has one), and an
empty saved model is the worse failure.

[Note: gradient shards exist from reduction to step]
A unit's gradient shard is read only from its first reduction in an accumulation window to the optimizer step.
Kept for the whole run (fp32: 4 bytes per parameter / N, 48 MiB per rank for the 25M-parameter GPT on 2 ranks)
it is resident at the start of backward, where stage 3's peak is (the head's backward: activations, the gathered
tied weight and its full gradient; issue 12, docs/benchmarks_resident.md). So, as FSDP2's sharded gradients that
`zero_grad(set_to_none=True)` frees, a transient shard's storage is resized to zero by `zero_grad` (after every
step) and back by the window's first reduction, whose reduce-scatter then writes straight into it; the window's
later micro-steps add into it as before. The tensor and its storage object stay the same, so the step's views of
it (`Piece.grad`, the shard serving as the optimizer's copy) stay valid, as the full buffer's do ([Note: gathered
storage]). Between steps a freed shard reads as zeros (`grad_zero`): `grad_resident` allocates it zero-filled
for whoever reads it first (a step with no backward in its window, `full_grad`), and `memory_report()` counts
what is allocated now (no gradients between steps: the ZeRO formulas describe the states after backward).
On CUDA the storage is freed and allocated on the compute stream, after the reduce-scatter's `wait` has ordered
that stream after the collective. With the optimizer offloaded to host memory a shard
leaves even earlier, as soon as the boundary's host copy holds it ([Note: a gradient shard leaves once its host copy
holds it] in offload/gradients.py). Shards in the swap files (`GradientTier.holds_shards`) keep their buffers; the
NVMe tier frees its own ([Note: gradients on NVMe]).

[Note: frozen parameters at stage 3]
A frozen parameter (a LoRA base weight; every parameter in inference) is held as DeepSpeed's stage 3 holds it: its
compute-dtype shard only, no fp32 master, no gradient, no reduction. The unit's flat buffer has two sections
(`layout_unit`): the trainable parameters, then the frozen ones, each padded to a multiple of N x 16 and split
evenly over the ranks; rank r's shard is the r-th chunk of each, trainable chunk first. So the first
`trainable_shard_numel` elements of every shard are all its trainable ones: the master and the gradient shard cover
that prefix, and backward stages and reduce-scatters the trainable section only (`trainable_extent`). A LoRA
decoder layer thus moves its adapters' gradients, not its base weights' zeros, holds at bf16 2 bytes per frozen
parameter / N instead of 2 + 4 (master) + 2 (gradient), and spreads its adapters' masters and optimizer state over
all N ranks, as DeepSpeed splits every parameter. A gather all-gathers each section in place (`sections.py`): two
collectives for a unit with both kinds, one otherwise (a unit with no frozen parameter has one section and the
layout it always had). Full fp32 values of a frozen parameter are its compute values (`fp32_shard`).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, auto

import torch
from torch import nn

from zeroshard.comm.collectives import Collectives, Handle
from zeroshard.errors import ZeroshardError
from zeroshard.offload.gradients import publish_master
from zeroshard.offload.host_memory import fresh
from zeroshard.offload.residency import Residency
from zeroshard.offload.tier import Tier
from zeroshard.zero.pool import BufferPool, zero_unwritten
from zeroshard.zero.quant import BlockQuantizer
from zeroshard.zero.stage3.ds_param import ZeroParamStatus, mark, rank_parts, set_status, show
from zeroshard.zero.stage3.packed import PackedTail
from zeroshard.zero.stage3.plan import PERSISTENT, UnitLayout
from zeroshard.zero.stage3.sections import gather_flat
from zeroshard.zero.stage3.streams import copy_stream


class UnitState(Enum):
    SHARDED = auto()
    GATHERING = auto()
    GATHERED = auto()


class ShardedUnit:
    """Parameters of one unit: a compute-dtype shard, a master shard (fp32 unless bf16 masters), and a gradient
    shard."""

    def __init__(
        self,
        index: int,
        name: str,
        module: nn.Module | None,
        layout: UnitLayout,
        params: list[nn.Parameter],
        comm: Collectives,
        compute_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        device: torch.device,
        master_tier: Tier,
        param_tier: Tier,
        fill: Callable[[torch.Tensor, int, int], None] | None = None,
        keeps_gradients: bool = True,
        master_dtype: torch.dtype = torch.float32,
        frozen_quantizer: BlockQuantizer | None = None,
    ):
        """`fill(out, lo, hi)`, when given, writes elements [lo, hi) of the flat buffer into `out` (a checkpoint
        read, [Note: streaming load]); otherwise the shard is copied from the parameters' values. Without
        `keeps_gradients` (inference: no optimizer) no parameter is trainable and no gradient memory is held.
        `frozen_quantizer`: the frozen part of the shard is held quantized ([Note: quantized frozen weights])."""
        self.index = index
        self.name = name
        self.module = module
        self.layout = layout
        self.params = params
        self.comm = comm  # the group the unit is sharded over: the world's, or [Note: units apart] in plan.py
        self.shard_rank = shard_rank = comm.rank
        self.persistent = name == PERSISTENT
        self.trainable = [i for i, p in enumerate(params) if p.requires_grad and keeps_gradients]
        self.trainable_set = frozenset(self.trainable)
        # a streamed unit's full buffer is not written before its first gather: untouched, it costs no memory
        alloc = torch.empty if fill is not None and not self.persistent else torch.zeros
        self.full = alloc(layout.numel, dtype=compute_dtype, device=device)
        by_index = {slot.index: slot for slot in layout.slots}
        self._slots = [by_index[i] for i in range(len(params))]  # in parameter order
        self.views = [
            self.full.narrow(0, s.offset, s.numel).view(p.shape) for s, p in zip(self._slots, params, strict=True)
        ]
        if fill is None:
            for view, param in zip(self.views, params, strict=True):
                view.copy_(param.detach())
        elif self.persistent:  # it stays gathered: every rank reads all of it (parameters below the threshold)
            fill(self.full, 0, layout.numel)
        from_full = fill is None or self.persistent
        # the compute-dtype shard lives on the parameter tier (CPU with offload_param), the master (fp32, or bf16:
        # [Note: bf16 master weights]) on the optimizer tier; one tensor when the tiers allow it and the dtypes match
        trained = layout.trainable_shard_numel  # [Note: frozen parameters at stage 3]
        aliases = compute_dtype == master_dtype and master_tier.shares_shard_with(param_tier)
        # the frozen section's chunk is packed ([Note: quantized frozen weights] in packed.py), the rest kept
        packs = frozen_quantizer is not None and not self.persistent and layout.frozen_width > 0
        kept = layout.shard_numel - layout.frozen_width
        # zeros: a streamed read leaves the padding as it is, and it shares the frozen chunk's quantization blocks
        whole = torch.zeros(layout.shard_numel, dtype=compute_dtype, device=param_tier.device) if packs else None
        self.shard = param_tier.zeros(kept if packs else layout.shard_numel, compute_dtype)
        values = self.shard if whole is None else whole
        if from_full:
            values.copy_(layout.take(self.full, shard_rank))
        else:
            for lo, hi, at in layout.shard_ranges(shard_rank):
                fill(values[at : at + hi - lo], lo, hi)  # type: ignore[misc]  # not None here
        self.tail: PackedTail | None = None
        if whole is not None:
            assert frozen_quantizer is not None
            self.shard.copy_(whole[:kept])
            self.tail = PackedTail(frozen_quantizer, kept, layout.frozen_width, param_tier)
            self.tail.pack(whole[kept:])
            del whole, values
        if aliases:
            self.master = self.shard
        else:  # from the compute-dtype values, as a model loaded in that dtype would give
            self.master = master_tier.zeros(trained, master_dtype)
            self.master.copy_(self.shard_values()[:trained])
        # a transient shard holds memory only from a window's first reduction to its step ([Note: gradient shards
        # exist from reduction to step])
        self.grad_shard = torch.zeros(trained if self.trainable else 0, dtype=grad_dtype, device=device)
        self.grad_transient = False  # set by build_units from the gradient tier (`GradientTier.holds_shards`)
        # the fp32 gradient the optimizer reads, from the gradient tier (offload/gradients.py): the shard itself, a
        # host copy refreshed during backward (`grad_copy_ready`), or None (a temporary at the step)
        self.grad_copy: torch.Tensor | None = None
        self.grad_copy_ready = False
        self.state = UnitState.GATHERED
        self._pending: Handle | None = None
        self._copied_in: torch.cuda.Event | None = None
        self._published: torch.cuda.Event | None = None  # publish_master's, until the copy has read the master
        self.placeholders = [torch.empty(0, dtype=compute_dtype, device=device) for _ in params]
        # the compute shard between uses: in memory, or on NVMe (offload_param nvme: read per gather, written per step)
        self.home: Residency = param_tier.residency
        # the parameters show the views, with DeepSpeed's ds_* attributes ([Note: DeepSpeed's parameter attributes])
        parts = rank_parts(layout, self._slots, self.shard, shard_rank, resident=not self.home.leaves_memory)
        mark(params, self.views, parts, self.persistent)
        self.key = f"param/{index}"  # `place_shard` moves it to its home once every view of it exists
        # the gradient shard from its reduction to the step: in memory, or on NVMe with the optimizer state (ZeRO-
        # Infinity); `grad_zero`: its value is zero without its being in memory (after the step: on NVMe, transient)
        self.grad_home: Residency = master_tier.residency
        self.grad_key = f"grad/{index}"
        self.grad_zero = False
        # the boundary's host copy holds the shard's values and its memory is released until the next window or a
        # read ([Note: a gradient shard leaves once its host copy holds it]); on CUDA the copy ran on this stream
        self.grad_in_copy = False
        self._grad_copy_stream: torch.cuda.Stream | None = None
        self.grad_restores = 0  # times the shard was read back from its copy (a further backward into the window)
        # backward bookkeeping
        self.staging: torch.Tensor | None = None
        # parameters whose gradient is in `staging`: this backward's (`seen`), or, in a coalesced block, any of its
        # backwards' ([Note: coalesced gradient reduction])
        self.written: set[int] = set()
        self.seen: set[int] = set()
        self.reduce_launched = False
        self.gathers = 0
        self.pins = 0  # while > 0 the unit stays gathered (state_dict, GatheredParameters, generation)

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def trainable_numel(self) -> int:
        return sum(self._slots[i].numel for i in self.trainable)

    # -- gather / release --------------------------------------------------------------------------
    def gather(self, async_op: bool, collect: Callable[..., Handle] | None = None, why: str = "") -> None:
        """Start (or finish) bringing the full parameters back over the unit's group; no-op when already gathered.
        `collect`, when given, replaces `comm.all_gather` (ZeRO++'s quantized or secondary-partition gathers,
        zero/zeropp/); `why` names the caller's call in a divergence report (`state_dict()`, which every rank must
        make)."""
        if self.state is not UnitState.SHARDED:
            return
        fresh(self.full.untyped_storage(), self.full.numel() * self.full.element_size())
        self.home.fetch(self.key)  # no-op when resident (in memory, or read ahead)
        self.home.ready(self.key)
        comm = self.comm
        if collect is None and self.tail is not None:  # [Note: quantized frozen weights] in packed.py
            collect = self.tail.gather(self, comm)
        label = f"gather of unit {self.name!r}" + (f" for {why}" if why else "")
        if self.shard.device != self.full.device and self.full.is_cuda:
            stream = copy_stream(self.full.device)
            stream.wait_stream(torch.cuda.current_stream(self.full.device))
            with torch.cuda.stream(stream):
                self._pending = self._issue(comm, collect, async_op, label)
                self._copied_in = torch.cuda.Event()  # after the gather: covers a synchronous one's wait too
                self._copied_in.record(stream)
        else:
            self._pending = self._issue(comm, collect, async_op, label)
        self.gathers += 1
        self.state = UnitState.GATHERING
        set_status(self.params, ZeroParamStatus.INFLIGHT)

    def _issue(self, comm: Collectives, collect: Callable[..., Handle] | None, async_op: bool, label: str) -> Handle:
        """The gather's collectives; offload_param: this rank's shard is copied into its place in the full buffer
        first and gathered in place (source None; a packed unit's gather copies its own parts)."""
        source: torch.Tensor | None = self.shard
        if self.shard.device != self.full.device and self.tail is None:
            for lo, hi, at in self.layout.shard_ranges(self.shard_rank):
                self.full[lo:hi].copy_(self.shard[at : at + hi - lo], non_blocking=self.full.is_cuda)
            source = None  # in place
        if collect is not None:  # ZeRO++'s gathers (zeropp/weights.py) take the same None
            return collect(self.full, source, async_op=async_op, label=label)
        return gather_flat(comm.all_gather, self.layout, self.full, source, self.shard_rank, None, async_op, label)

    def after_copy_in(self) -> None:
        """CUDA, offloaded shards: the compute stream waits for the copy stream (copy, ZeRO++'s packing) before the
        handle's finishers run on it (ZeRO++'s unpacking, hpZ's fill read what the copy stream wrote)."""
        if self._copied_in is not None:
            torch.cuda.current_stream(self.full.device).wait_event(self._copied_in)

    def wait_gathered(self) -> None:
        if self.state is UnitState.GATHERING:
            assert self._pending is not None
            self.after_copy_in()
            self._pending.wait()
            self._pending = None
            if self._copied_in is not None:
                if self.home.leaves_memory:  # the host buffer goes back to the swapper below
                    self._copied_in.synchronize()
                self._copied_in = None
            self.home.drop(self.key)  # unchanged since it was read: the disk copy is current
            show(self.params, self.views, ZeroParamStatus.AVAILABLE)
            self.state = UnitState.GATHERED

    def release(self, hand_over: bool = False) -> None:
        """`hand_over`: the end of a pin; the storage is left to whoever holds it ([Note: gathered storage])."""
        if self.state is UnitState.SHARDED or self.persistent or self.pins:
            return
        self.wait_gathered()
        show(self.params, self.placeholders, ZeroParamStatus.NOT_AVAILABLE)
        if hand_over:
            full = torch.empty_like(self.full)  # views need memory; emptied after (set_ would keep a whole unit)
            slots = zip(self._slots, self.views, strict=True)
            self.views = [full.narrow(0, s.offset, s.numel).view(v.shape) for s, v in slots]
            full.untyped_storage().resize_(0)
            self.full = full
        else:
            self.full.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED

    def lend_shape(self, index: int) -> None:
        """A gradient arrives for a released parameter (an embedding's, [Note: root unit by module]): autograd
        accumulates it against the parameter's shape and strides, so until `return_shape` the parameter shows its
        view, whose storage holds no memory or is being gathered into (nothing reads it)."""
        if self.state is not UnitState.GATHERED:
            self.params[index].data = self.views[index]

    def return_shape(self, index: int) -> None:
        if self.state is UnitState.SHARDED:
            self.params[index].data = self.placeholders[index]

    # -- gradients ---------------------------------------------------------------------------------
    def stage_grad(self, param_index: int, grad: torch.Tensor, pool: BufferPool, comm_dtype: torch.dtype) -> bool:
        """Add a parameter's gradient into the unit's staging buffer; True once all have arrived."""
        if self.reduce_launched:
            raise ZeroshardError(
                f"a gradient for {self._slots[param_index].name!r} arrived after unit {self.name!r} was "
                "reduced in this backward; call engine.backward once per micro-step (non-reentrant checkpointing)"
            )
        if self.staging is None:  # [Note: staged gradients are copied, not added to zeros]
            self.staging = pool.acquire(self.layout.trainable_extent, comm_dtype, zero=False)
        slot = self._slots[param_index]
        target = self.staging.narrow(0, slot.offset, slot.numel)
        target.add_(grad.reshape(-1)) if param_index in self.written else target.copy_(grad.reshape(-1))
        self.written.add(param_index)
        self.seen.add(param_index)
        return len(self.seen) == len(self.trainable)

    def launch_reduce(
        self,
        pool: BufferPool,
        comm_dtype: torch.dtype,
        prescale: float,
        direct: bool,
        async_op: bool,
        scatter: Callable[..., Handle] | None = None,
    ) -> tuple[Handle, Callable[[], None]]:
        """Reduce-scatter the staged gradients into this rank's gradient shard (accumulating); `scatter`, when
        given, replaces the unit's `comm.reduce_scatter` (ZeRO++ qgZ, zero/zeropp/grads.py)."""
        if self.staging is None:  # no gradient arrived on this rank
            staging = pool.acquire(self.layout.trainable_extent, comm_dtype)
        else:
            staging = self.staging
            zero_unwritten(staging, [(self._slots[i].offset, self._slots[i].numel) for i in self.written])
        self.staging = None
        self.written = set()
        self.reduce_launched = True
        staging = self._trainable_part(staging, pool)
        if prescale != 1.0:
            staging.mul_(prescale)
        into_shard = direct and self.grad_shard.dtype == staging.dtype
        self.grad_resident(overwrite=into_shard)  # NVMe: reading the accumulated shard overlaps the collective
        out = self.grad_shard if into_shard else pool.acquire(self.grad_shard.numel(), staging.dtype, zero=False)
        label = f"reduce-scatter of unit {self.name!r}"
        if scatter is not None:  # ZeRO++'s quantized reduction (zero/zeropp/grads.py)
            handle = scatter(out, staging, async_op=async_op, label=label)
        else:
            handle = self.comm.reduce_scatter(out, staging, async_op=async_op, label=label, input_is_scratch=True)

        def finish() -> None:
            if not into_shard:
                self.grad_home.ready(self.grad_key)
                self.grad_shard.add_(out)
                pool.release(out)
            pool.release(staging)

        return handle, finish

    def _trainable_part(self, staging: torch.Tensor, pool: BufferPool) -> torch.Tensor:
        """What is reduce-scattered of the staged gradients: every rank's trainable prefix ([Note: frozen parameters
        at stage 3]); `staging` itself when that is all of it (the trainable section is all that is staged), else
        a pooled copy of the prefixes (a unit of one section whose trainable elements end early; `staging` goes
        back)."""
        width, count = self.layout.trainable_shard_numel, self.layout.shard_count
        if width * count == staging.numel():
            return staging
        part = pool.acquire(width * count, staging.dtype, zero=False)
        part.view(count, width).copy_(staging.view(count, self.layout.shard_numel)[:, :width])
        pool.release(staging)
        return part

    def grad_resident(self, overwrite: bool = False) -> None:
        """Start making the gradient shard resident (`grad_home.ready` waits): a zero shard is allocated, not
        read, and zero-filled unless every element is about to be `overwrite`n; one released after its host copy
        is read back from it."""
        if self.grad_in_copy:
            self._grad_from_copy()
            return
        if not self.grad_zero:
            self.grad_home.fetch(self.grad_key)
            return
        self.grad_home.claim(self.grad_key)
        if self.grad_transient:  # [Note: gradient shards exist from reduction to step]
            fresh(self.grad_shard.untyped_storage(), self.grad_shard.numel() * self.grad_shard.element_size())
        if not overwrite:
            self.grad_shard.zero_()
        self.grad_zero = False

    def hand_grad_to_copy(self, stream: torch.cuda.Stream | None) -> None:
        """The boundary's host copy holds this (transient) shard's values, queued on `stream` on CUDA: its memory
        goes now ([Note: a gradient shard leaves once its host copy holds it])."""
        if stream is not None:  # the copy may still be reading it: the allocator keeps the block until it is done
            self.grad_shard.record_stream(stream)
        self.grad_shard.untyped_storage().resize_(0)
        self.grad_in_copy = True
        self._grad_copy_stream = stream

    def _grad_from_copy(self) -> None:
        assert self.grad_copy is not None
        fresh(self.grad_shard.untyped_storage(), self.grad_shard.numel() * self.grad_shard.element_size())
        if self._grad_copy_stream is not None:  # the host reads the buffer (a casting copy casts on the host)
            self._grad_copy_stream.synchronize()
        self.grad_shard.copy_(self.grad_copy)
        self.grad_in_copy = False
        self.grad_restores += 1

    def zero_grad_shard(self) -> None:
        """The gradient shard := 0: a transient shard by freeing its memory, on NVMe by marking it (nothing is
        written), otherwise by zero-filling it."""
        if self.grad_transient:  # [Note: gradient shards exist from reduction to step]
            self.grad_shard.untyped_storage().resize_(0)
            self.grad_zero = True
            self.grad_in_copy = False
        elif self.grad_home.is_resident(self.grad_key):
            self.grad_shard.zero_()
        else:
            self.grad_zero = True

    def drop_staging(self, pool: BufferPool) -> None:
        """Gradients staged and not reduced (a coalesced block's) are dropped, without communicating."""
        if self.staging is not None:
            pool.release(self.staging)
            self.staging = None
        self.written = set()
        self.seen.clear()

    def end_backward(self) -> None:
        self.seen.clear()
        self.reduce_launched = False

    # -- after the optimizer step ------------------------------------------------------------------
    def place_shard(self) -> None:
        self.home.place(self.key, self.stored())

    def stored(self) -> list[torch.Tensor]:
        """The tensors of this unit's compute shard at its home: the shard, and a packed tail's codes."""
        return [self.shard] if self.tail is None else [t for t in (self.shard, self.tail.codes) if t.numel()]

    def shard_values(self, device: torch.device | None = None) -> torch.Tensor:
        """This rank's whole shard in the compute dtype: the shard itself, or a copy (on `device`, default the
        shard's) with a packed tail's values ([Note: quantized frozen weights] in packed.py)."""
        if self.tail is None:
            return self.shard
        device = device or self.shard.device
        return torch.cat([self.shard.to(device), self.tail.values(self.shard.dtype, device)])

    def master_from_shard(self) -> None:
        """The master (when separate) := the compute values it covers, the frozen ones of a packed tail too."""
        if self.master is not self.shard:
            self.master.copy_(self.shard_values(self.master.device)[: self.master.numel()])

    def load_values(self, values: torch.Tensor) -> None:
        """The shard := `values` (the whole shard, compute dtype; resident), a packed tail quantized again."""
        self.shard.copy_(values[: self.shard.numel()])
        if self.tail is not None:
            self.tail.pack(values[self.shard.numel() :])

    def master_resident(self) -> None:
        """Before the optimizer steps this unit: a master that is the compute shard is read in (`settle_shard`
        after `publish` writes it back); a separate master is the optimizer store's business."""
        if self.master is self.shard:
            self.home.fetch(self.key)
            self.home.ready(self.key)

    def publish(self) -> None:
        """Copy the updated master shard into the compute-dtype shard (no copy when they are one tensor); a
        shard on NVMe starts being written back (`settle_shard` waits and frees it). From a pinned host master the
        copy is asynchronous: [Note: publishing a host master to the GPU] in offload/gradients.py."""
        if self.master is not self.shard:
            # a packed unit's shard may keep fewer elements than the master covers (the rest are frozen)
            trained = min(self.master.numel(), self.shard.numel())
            if trained == 0:  # all frozen: nothing changed ([Note: frozen parameters at stage 3])
                return
            if trained < self.shard.numel() or self.tail is not None:  # the frozen rest is kept: read (NVMe)
                self.home.fetch(self.key)
                self.home.ready(self.key)
            else:
                self.home.claim(self.key)
            self._published = publish_master(self.shard[:trained], self.master[:trained])
            if self.home.leaves_memory:  # the write to NVMe reads the host shard a GPU master is copied into
                self.wait_published()
        self.home.evict(self.key)

    def wait_published(self) -> None:
        """Before the host master is written again, or a host shard read: the copy `publish` started is done."""
        if self._published is not None:
            self._published.synchronize()
            self._published = None

    def overwrite_shard(self, values: torch.Tensor) -> None:
        """The compute shard := `values` (and the master, when separate), written through to its home."""
        self.home.claim(self.key)
        self.load_values(values)
        self.master_from_shard()
        self.home.evict(self.key)
        self.home.settle(self.key)

    def separate_master(self) -> list[torch.Tensor]:
        """The master shard where it is a tensor of its own (and not empty), for the optimizer's store."""
        return [self.master] if self.master is not self.shard and self.master.numel() > 0 else []

    def fp32_shard(self) -> torch.Tensor:
        """This rank's shard in fp32 (a copy unless the master is fp32): the master, and the compute values where
        there is no master (frozen parameters: [Note: frozen parameters at stage 3])."""
        master = self.master.float()  # itself when fp32; bf16 masters: [Note: bf16 master weights]
        if self.master.numel() == self.layout.shard_numel:
            return master
        rest = self.shard_values(self.master.device)[self.master.numel() :].to(self.master.device, torch.float32)
        return torch.cat([master, rest])

    def settle_shard(self) -> None:
        self.home.settle(self.key)
